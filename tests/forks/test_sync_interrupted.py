"""sync after an interrupted `git submodule update --init`: clones left off the pin are checked out at
it, unless they hold work of ours.

Git clones every submodule with `--no-checkout` first and checks them out only when all clones
succeeded; when one host is unreachable it aborts, and the clones already made stay at the remote's
default branch with no index and an empty work tree.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.forks.conftest import V1_FILES, Project, commit, commit_series, git


def interrupt_submodule_update(project: Project) -> None:
    """`git submodule update --init` with gitonly's host unreachable: demo is cloned, then git aborts."""
    git(project.root, "submodule", "init")
    unreachable = project.root.parent / "unreachable.git"
    git(project.root, "config", "submodule.third_party/gitonly.url", str(unreachable))
    proc = subprocess.run(["git", "submodule", "update", "--init"], cwd=project.root, capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "unreachable.git" in proc.stderr, proc.stderr
    assert git(project.fork, "symbolic-ref", "HEAD") == "refs/heads/main"
    assert git(project.fork, "rev-parse", "HEAD") == project.upstream.v2, "the remote's default branch"
    assert [p.name for p in project.fork.iterdir()] == [".git"], "the clone was never checked out"
    assert not (project.root / "third_party" / "gitonly" / ".git").exists()


def test_sync_checks_out_the_pin_in_a_clone_an_interrupted_update_left(project, capsys):
    interrupt_submodule_update(project)
    v1, v2 = project.upstream.v1, project.upstream.v2
    assert project.cli("status", "demo") == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("demo"))
    assert row.endswith(f"off pin ({v2[:12]}), run sync"), "no uncommitted count: nobody changed a file"

    assert project.cli("sync", "demo") == 0
    assert capsys.readouterr().out == (f"demo: was at {v2[:12]} (branch main, never checked out: an interrupted"
                                       f" clone), off the pin: checked out the pin {v1[:12]} (v1)\n")
    assert git(project.fork, "rev-parse", "HEAD") == v1
    assert git(project.fork, "symbolic-ref", "-q", "HEAD", check=False) == "", "detached, as submodule update"
    assert git(project.fork, "status", "--porcelain") == ""
    assert {p: (project.fork / p).read_text() for p in V1_FILES} == V1_FILES
    assert git(project.fork, "config", "recipe.base") == v1

    assert project.cli("sync", "demo") == 0
    assert capsys.readouterr().out == "demo: already present (git)\n"
    commit_series(project)  # recipe/demo: three commits on the pin, HEAD off the pin by design
    tip = git(project.fork, "rev-parse", "HEAD")
    capsys.readouterr()
    assert project.cli("sync", "demo") == 0
    assert capsys.readouterr().out == "demo: already present (git)\n"
    assert git(project.fork, "symbolic-ref", "--short", "HEAD") == "recipe/demo"
    assert git(project.fork, "rev-parse", "HEAD") == tip != v1
    assert project.cli("status", "--check", "demo") == 0


class Ours(NamedTuple):
    said: tuple[str, ...]  # what the refusal must name
    keep: Callable[[], None]  # the refusal's "to keep it" steps
    kept: Callable[[], bool]  # the work is still there afterwards


def _local_commit(fork: Path) -> Ours:
    git(fork, "checkout", "-q", "--force", "main")
    commit(fork, {"new.py": "x = 1\n"}, "Local experiment", "Trying something.")
    return Ours(("1 commit(s) on no upstream branch or tag", "Local experiment", "(the commits stay on main)"),
                lambda: git(fork, "checkout", "-q", "--detach", "v1"),
                lambda: git(fork, "log", "-1", "--format=%s", "main") == "Local experiment")


def _uncommitted_change(fork: Path) -> Ours:
    git(fork, "checkout", "-q", "--force", "main")
    (fork / "app.py").write_text("changed\n")
    return Ours(("1 uncommitted file(s) (app.py)", "to keep it: `git stash --include-untracked`, then",
                 ", then `git clean -fd`"),
                lambda: [git(fork, *step) for step in (("stash", "-q", "--include-untracked"),
                                                       ("checkout", "-q", "--detach", "v1"))],
                lambda: "+changed" in git(fork, "stash", "show", "-p"))


def _file_in_the_empty_clone(fork: Path) -> Ours:
    (fork / "notes.txt").write_text("mine\n")
    moved = fork.parent / "notes.txt"
    return Ours(("1 uncommitted file(s) (notes.txt)", "never checked out",
                 "to keep it: move them out of the tree, then"),
                lambda: [(fork / "notes.txt").rename(moved), git(fork, "checkout", "-q", "--detach", "v1")],
                lambda: moved.read_text() == "mine\n")


@pytest.mark.parametrize("make_ours", [_local_commit, _uncommitted_change, _file_in_the_empty_clone])
def test_sync_refuses_an_off_pin_clone_that_holds_work_of_ours(project, capsys, make_ours):
    interrupt_submodule_update(project)
    ours = make_ours(project.fork)
    head = git(project.fork, "rev-parse", "HEAD")
    status = git(project.fork, "status", "--porcelain")

    assert project.cli("sync", "demo") == 2
    err = capsys.readouterr().err
    assert f"not at the pin {project.upstream.v1[:12]} (v1), and holds work of ours" in err
    assert all(part in err for part in ours.said), err
    assert f"`git checkout --detach {project.upstream.v1[:12]}`" in err
    assert f"to discard it: `git checkout --force --detach {project.upstream.v1[:12]}`" in err
    assert git(project.fork, "rev-parse", "HEAD") == head
    assert git(project.fork, "status", "--porcelain") == status, "nothing of ours was touched"
    assert project.cli("status", "demo") == 0
    assert f"off pin ({head[:12]})" in capsys.readouterr().out

    ours.keep()
    assert project.cli("sync", "demo") == 0
    assert capsys.readouterr().out == "demo: already present (git)\n"
    assert ours.kept()
