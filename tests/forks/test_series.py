"""export (determinism, --check, stale files) and check (lint, apply to the pin)."""

from __future__ import annotations

import pytest

from tests.forks.conftest import PATCHES, SENDABLE_TRAILERS, bad_patch, commit, git
from tools.forks.series import Series, file_name


def _snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_export_writes_one_file_per_commit_with_series_order(with_series):
    p = with_series
    names = Series(p.patches).names()
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


SIGNED = "Signed-off-by: Test User <test@example.invalid>"
GOOD_TRAILERS = f"Reason: testing\nUpstream-Status: Pending\n{SIGNED}"


@pytest.mark.parametrize("subject, trailers, body, expected", [
    ("A" * 73, GOOD_TRAILERS, "Because.", "subject is 73 characters (rule: at most 72); shorten it"),
    ("Touch readme", "Reason: testing\nUpstream-Status: Pending", "Because.",
     "missing trailer `Signed-off-by: Name <email>` (rule: DCO, required upstream); add it with"),
    ("Touch readme", f"Reason: the layout of issue 8\nUpstream-Status: Pending\n{SIGNED}", "Because.",
     "cites our issue tracker ('issue 8' in 'Reason: the layout of issue 8'"),
    ("Touch readme", GOOD_TRAILERS, "Needed for the A3 recipe (issues 6/7).", "cites our issue tracker ('issues 6/7'"),
    ("Touch readme", GOOD_TRAILERS, "Fixes the crash of #12.", "cites our issue tracker ('#12'"),
    ("Touch readme", f"Reason: x\nUpstream-Status: Inappropriate (verl PR #2017 removes it)\n{SIGNED}", "Because.",
     "cites our issue tracker ('#2017'"),
])
def test_check_refuses_a_patch_unfit_to_send(with_series, capsys, subject, trailers, body, expected):
    p = with_series
    (p.patches / "bad.patch").write_text(bad_patch(subject, trailers, body))
    (p.patches / "series").write_text((p.patches / "series").read_text() + "bad.patch\n")
    assert p.cli("check", "demo") == 1
    out = capsys.readouterr().out
    assert f"bad.patch: {expected}" in out, out
    assert out.count("bad.patch:") == 1, "only the broken rule is reported"


def test_check_accepts_72_characters_and_upstream_links(with_series, capsys):
    p = with_series
    upstream = ("Upstream-Status: Submitted https://github.com/vllm-project/vllm/pull/123\n"
                f"Reason: see vllm-project/vllm#456 and https://github.com/volcengine/verl/issues/7\n{SIGNED}")
    (p.patches / "good.patch").write_text(bad_patch("B" * 72, upstream, "Rank issues the same collectives in order."))
    (p.patches / "series").write_text((p.patches / "series").read_text() + "good.patch\n")
    assert p.cli("check", "demo") == 0, capsys.readouterr().out


def test_file_names_end_at_a_word_boundary_within_64_characters():
    subject = "Add TensorCache: batch tensors stay on the worker that produced them"
    assert file_name(subject, set()) == "add-tensorcache-batch-tensors-stay-on-the-worker-that-produced.patch"
    assert file_name(subject, set()) == file_name(subject, set()), "deterministic"
    assert file_name("x" * 70 + " tail", set()) == "x" * 64 + ".patch", "one over-long word is cut"
    assert file_name("Add a feature flag", {"add-a-feature-flag.patch"}) == "add-a-feature-flag-2.patch"
    assert file_name("?!", set()) == "patch.patch"


def test_export_names_a_long_subject_at_a_word_boundary(with_series):
    p = with_series
    subject = "Keep rotary frequencies and router weights on the host without CUDA"
    commit(p.fork, {"extra.py": "y = 2\n"}, subject, "The host has no CUDA.", trailers=SENDABLE_TRAILERS)
    assert p.cli("export", "demo") == 0
    name = "keep-rotary-frequencies-and-router-weights-on-the-host-without.patch"
    assert (p.patches / "series").read_text().splitlines()[-1] == name
    assert (p.patches / name).is_file()
