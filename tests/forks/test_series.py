"""export (determinism, --check, stale files) and check (lint, apply to the pin)."""

from __future__ import annotations

from tests.forks.conftest import PATCHES, bad_patch, commit, git


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_export_writes_one_file_per_commit_with_series_order(with_series):
    p = with_series
    names = [n for n in (p.patches / "series").read_text().splitlines() if not n.startswith("#")]
    assert names == ["add-a-feature-flag.patch", "fix-typo-in-helper.patch", "raise-the-default-batch.patch"]
    text = (p.patches / names[0]).read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Subject: Add a feature flag\n" in text and "Reason:" in text
    assert "\n-- \n" not in text, "no git version signature"
    assert " | " not in text.split("diff --git")[0], "no diffstat"


def test_export_is_byte_identical_when_nothing_changed(with_series):
    before = _snapshot(with_series.patches)
    assert with_series.cli("export", "demo") == 0
    assert _snapshot(with_series.patches) == before


def test_export_ignores_user_diff_and_format_configuration(with_series, isolated_git):
    before = _snapshot(with_series.patches)
    with isolated_git.open("a") as cfg:
        cfg.write("[diff]\n\tnoprefix = true\n\talgorithm = histogram\n\tcontext = 7\n"
                  "[format]\n\tsignOff = true\n\tnumbered = true\n[core]\n\tabbrev = 7\n")
    assert with_series.cli("export", "demo") == 0
    assert _snapshot(with_series.patches) == before


def test_reapply_then_export_round_trips(with_series):
    p = with_series
    before = _snapshot(p.patches)
    git(p.fork, "checkout", "-q", "--detach", p.upstream.v1)
    git(p.fork, "branch", "-q", "-D", "recipe/demo")
    assert p.cli("apply", "demo") == 0
    assert p.cli("export", "demo") == 0
    assert _snapshot(p.patches) == before


def test_export_check_reports_new_commits_and_export_adds_them(with_series, capsys):
    p = with_series
    assert p.cli("export", "--check", "demo") == 0
    commit(p.fork, {"extra.py": "y = 2\n"}, "Add extra module", "Needed by the launcher.")
    assert p.cli("export", "--check", "demo") == 1
    out = capsys.readouterr().out
    assert "add-extra-module.patch" in out and "series" in out
    assert p.cli("export", "demo") == 0
    assert "add-extra-module.patch" in (p.patches / "series").read_text()
    assert p.cli("export", "--check", "demo") == 0
    assert p.cli("apply", "demo") == 0  # branch and series agree: nothing to refuse


def test_export_removes_stale_patches(with_series):
    p = with_series
    git(p.fork, "reset", "-q", "--hard", "HEAD~1")
    assert p.cli("export", "demo") == 0
    assert not (p.patches / "raise-the-default-batch.patch").exists()
    assert "raise-the-default-batch" not in (p.patches / "series").read_text()


def test_export_check_skips_forks_without_a_branch(project, capsys):
    assert project.cli("export", "--check") == 0
    assert "skipped" in capsys.readouterr().out


def test_check_passes_on_a_clean_series_and_replays_it(with_series, capsys):
    assert with_series.cli("check", "demo") == 0
    assert "applies to the pin" in capsys.readouterr().out


def test_check_lint_without_source(with_series, capsys):
    import shutil

    shutil.rmtree(with_series.fork)
    with_series.fork.mkdir()
    assert with_series.cli("check", "demo") == 0
    assert "lint only" in capsys.readouterr().out


def test_check_names_every_lint_problem(with_series, capsys):
    p = with_series
    series = p.patches / "series"
    (p.patches / "no-trailers.patch").write_text(bad_patch("Touch readme", ""))
    (p.patches / "bad-status.patch").write_text(
        bad_patch("Another readme touch", "Reason: testing\nUpstream-Status: Maybe later"))
    (p.patches / "dup.patch").write_text(bad_patch(PATCHES[0][0], "Reason: x\nUpstream-Status: Pending"))
    (p.patches / "unlisted.patch").write_text(bad_patch("Unlisted", "Reason: x\nUpstream-Status: Pending"))
    series.write_text(series.read_text() + "no-trailers.patch\nbad-status.patch\ndup.patch\nghost.patch\n")
    assert p.cli("check", "demo") == 1
    out = capsys.readouterr().out
    assert "no-trailers.patch: missing trailer `Reason:" in out
    assert "bad-status.patch: trailer Upstream-Status is 'Maybe later'" in out
    assert "dup.patch: subject 'Add a feature flag' repeats add-a-feature-flag.patch" in out
    assert "lists ghost.patch, which does not exist" in out
    assert "unlisted.patch: not listed in `series`" in out


def test_check_reports_a_patch_that_does_not_apply_to_the_pin(with_series, capsys):
    p = with_series
    target = p.patches / "raise-the-default-batch.patch"
    target.write_text(target.read_text().replace("-batch = 8", "-batch = 9"))
    assert p.cli("check", "demo") == 1
    assert "raise-the-default-batch.patch: does not apply to the pin" in capsys.readouterr().out
