"""rebase (drop what landed, stop on conflict, continue, abort, report) and publish."""

from __future__ import annotations

import tomllib

from tests.forks.conftest import git
from tools.forks.series import Series


def _series(p):
    return Series(p.patches).names()


def _gitlink(p):
    return git(p.root, "ls-files", "--stage", "third_party/demo").split()[1]


def test_rebase_dry_run_reports_what_the_rebase_meets_and_changes_nothing(with_series, capsys):
    p = with_series
    tip = git(p.fork, "rev-parse", "recipe/demo")
    assert p.cli("rebase", "demo", "--onto", "v2", "--dry-run") == 1  # the batch patch conflicts
    assert "clean 1, 3-way merged 0, conflict 1, already upstream 1" in capsys.readouterr().out
    report = (p.patches / "REBASE-v1-v2.md").read_text()
    assert "| 2 | fix-typo-in-helper.patch | already upstream | as " in report
    assert "| 3 | raise-the-default-batch.patch | conflict | config.py: @@ " in report
    assert git(p.fork, "rev-parse", "recipe/demo") == tip
    assert p.cli("rebase", "demo", "--onto", "v2") == 3, "the rebase itself meets the conflict the dry run saw"


def test_rebase_stops_on_conflict_and_abort_restores(with_series, capsys):
    p = with_series
    before = {f.name: f.read_bytes() for f in p.patches.iterdir()}
    tip = git(p.fork, "rev-parse", "recipe/demo")
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    err = capsys.readouterr().err
    assert "raise-the-default-batch.patch conflicts with v2 in config.py" in err
    assert "--continue" in err and "--abort" in err
    assert p.cli("rebase", "demo", "--abort") == 0
    assert git(p.fork, "rev-parse", "recipe/demo") == tip
    assert git(p.fork, "symbolic-ref", "--short", "HEAD") == "recipe/demo"
    assert {f.name: f.read_bytes() for f in p.patches.iterdir()} == before
    assert p.cli("status", "--check", "demo") == 0


def test_rebase_continue_finishes_and_moves_everything(with_series, capsys):
    p = with_series
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    (p.fork / "config.py").write_text("batch = 64\nlr = 0.1\n")  # the resolution
    git(p.fork, "add", "config.py")
    assert p.cli("rebase", "demo", "--continue", "--why", "v2 raised the batch to 32; we go to 64") == 0
    out = capsys.readouterr().out
    assert "kept 2, dropped 1, changed 1" in out

    assert _series(p) == ["add-a-feature-flag.patch", "raise-the-default-batch.patch"]
    assert not (p.patches / "fix-typo-in-helper.patch").exists()
    assert "+batch = 64" in (p.patches / "raise-the-default-batch.patch").read_text()
    manifest = tomllib.loads((p.root / "third_party/forks.toml").read_text())["forks"]["demo"]
    assert (manifest["ref"], manifest["commit"]) == ("v2", p.upstream.v2)
    assert _gitlink(p) == p.upstream.v2

    report = (p.patches / "REBASE-v1-v2.md").read_text()
    assert "| 2 | fix-typo-in-helper.patch | dropped | already upstream as " in report
    assert "| 3 | raise-the-default-batch.patch | reworked | v2 raised the batch to 32; we go to 64 |" in report
    assert "| 1 | add-a-feature-flag.patch | ported |  |" in report
    assert "range-diff" in report
    assert not (p.root / "third_party/patches/ports/demo-v2").exists(), "a finished port is removed"

    assert p.cli("check", "demo") == 0  # the new series applies to the new pin
    assert p.cli("status", "--check", "demo") == 0  # pin, gitlink, branch and series agree


def test_rebase_refuses_unexported_work(with_series, capsys):
    from tests.forks.conftest import commit

    commit(with_series.fork, {"x.py": "1\n"}, "Unexported", "Work in progress.")
    assert with_series.cli("rebase", "demo", "--onto", "v2") == 2
    assert "not in the series" in capsys.readouterr().err


def test_rebase_continue_with_an_empty_resolution_drops_the_patch(with_series, capsys):
    p = with_series
    assert p.cli("rebase", "demo", "--onto", "v2") == 3
    git(p.fork, "checkout", "HEAD", "--", "config.py")  # keep upstream's line: nothing left of the patch
    assert p.cli("rebase", "demo", "--continue") == 0
    assert "kept 1, dropped 2" in capsys.readouterr().out
    report = (p.patches / "REBASE-v1-v2.md").read_text()
    assert "| raise-the-default-batch.patch | dropped | emptied by the replay: upstream's tree already has its" \
           " change to config.py |" in report


def test_publish_pushes_and_switches_the_submodule(with_series, tmp_path, capsys):
    p = with_series
    remote = tmp_path / "fork-remote.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    tip = git(p.fork, "rev-parse", "recipe/demo")

    assert p.cli("publish", "demo", "--remote", str(remote), "--dry-run") == 0
    assert "would: " in capsys.readouterr().out
    assert git(remote, "for-each-ref") == ""

    assert p.cli("publish", "demo", "--remote", str(remote)) == 0
    assert git(remote, "rev-parse", "refs/heads/recipe/demo") == tip
    assert git(p.root, "config", "-f", ".gitmodules", "submodule.third_party/demo.url") == str(remote)
    assert git(p.root, "config", "-f", ".gitmodules", "submodule.third_party/demo.branch") == "recipe/demo"
    assert _gitlink(p) == tip
    manifest = tomllib.loads((p.root / "third_party/forks.toml").read_text())["forks"]["demo"]
    assert manifest["published_url"] == str(remote) and manifest["published_commit"] == tip
    assert manifest["commit"] == p.upstream.v1, "the upstream pin stays the series base"
    from tools.forks import manifest as manifest_mod
    from tools.forks import ops

    assert ops.gitlink_problems(manifest_mod.load(p.root)) == []


def test_publish_refuses_unexported_commits(with_series, tmp_path, capsys):
    from tests.forks.conftest import commit

    remote = tmp_path / "r.git"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    commit(with_series.fork, {"x.py": "1\n"}, "Unexported", "Work in progress.")
    assert with_series.cli("publish", "demo", "--remote", str(remote)) == 2
    assert "not in the series" in capsys.readouterr().err
    assert git(remote, "for-each-ref") == ""


def test_a_pulled_rebase_is_followed_by_sync_and_apply(tmp_path, upstream, capsys):
    import shutil

    from tests.forks.conftest import commit_series, make_project

    author, teammate = make_project(tmp_path / "a", upstream), make_project(tmp_path / "b", upstream)
    commit_series(author)
    commit_series(teammate)
    # The teammate cloned before v2 existed: remove every trace of it from their checkout.
    git(teammate.fork, "tag", "-d", "v2")
    for ref in git(teammate.fork, "for-each-ref", "--format=%(refname)").split():
        if ref != "refs/heads/recipe/demo":
            git(teammate.fork, "update-ref", "-d", ref)
    git(teammate.fork, "reflog", "expire", "--expire=now", "--all")
    git(teammate.fork, "gc", "-q", "--prune=now")
    assert git(teammate.fork, "cat-file", "-t", upstream.v2, check=False) != "commit"
    assert author.cli("rebase", "demo", "--onto", "v2") == 3
    (author.fork / "config.py").write_text("batch = 64\nlr = 0.1\n")
    git(author.fork, "add", "config.py")
    assert author.cli("rebase", "demo", "--continue", "--why", "batch 64 on top of v2's 32") == 0
    assert "forks.demo.pypi still names demo==1.0" in capsys.readouterr().out

    # The teammate pulls: forks.toml, the series and the gitlink change.
    shutil.copy(author.root / "third_party/forks.toml", teammate.root / "third_party/forks.toml")
    shutil.rmtree(teammate.patches)
    shutil.copytree(author.patches, teammate.patches)
    git(teammate.root, "update-index", "--cacheinfo", f"160000,{upstream.v2},third_party/demo")

    assert teammate.cli("status", "--check", "demo") == 1
    assert "not at the pin, run sync" in capsys.readouterr().out
    assert teammate.cli("apply", "demo") == 2
    assert "run `python -m tools.forks sync demo`" in capsys.readouterr().err
    assert teammate.cli("sync", "demo") == 0
    assert "updated to the new pin" in capsys.readouterr().out
    assert teammate.cli("apply", "demo") == 0
    assert teammate.cli("export", "--check", "demo") == 0
    assert git(teammate.fork, "rev-parse", "recipe/demo") == git(author.fork, "rev-parse", "recipe/demo")


def test_a_pypi_tree_goes_stale_when_the_pin_moves(project, capsys):
    from tools.forks import manifest as manifest_mod

    assert project.cli("sync", "demo", "--source", "pypi", "--find-links", str(project.dist)) == 0
    manifest_mod.set_keys(project.root / "third_party/forks.toml", "demo",
                          {"ref": "v2", "commit": project.upstream.v2})
    assert project.cli("status", "demo") == 0
    assert "pypi tree not at the pin" in capsys.readouterr().out
    assert project.cli("sync", "demo") == 2
    assert "made for another pin" in capsys.readouterr().err
