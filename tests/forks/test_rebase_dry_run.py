"""rebase --dry-run: the whole series replayed in a scratch repository, onto a git tag or a PyPI release.

The synthetic history gives each result once. Upstream v2 (and the sdist demo-1.1) differ from v1 by: our
typo fix verbatim (already upstream, same patch-id), a different batch line (our batch patch conflicts, and
our learning-rate patch, whose context is our batch line, needs it), a retuned layer 3 two lines above the
layer our model patch edits (3-way merged), and our README change inside a larger commit (emptied).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import pytest

from tests.forks.conftest import Upstream, commit, commit_series, git, make_project, make_sdist
from tools.forks import manifest as manifest_mod
from tools.forks import rehearsal

MODEL = [f"layer_{i} = {i}" for i in range(1, 11)]
CONFIG = ["batch = 8", "lr = 0.1", *(f"# option {i}" for i in range(3, 11)), "seed = 0"]
V1 = {
    "app.py": "def main():\n    print('hello')\n    return 0\n",
    "util.py": "def helper():\n    retrun 1\n",
    "model.py": "\n".join(MODEL) + "\n",
    "config.py": "\n".join(CONFIG) + "\n",
    "README.md": "demo project\n",
}


def _edit(lines: list[str], **changes: str) -> str:
    """`lines` with the line starting `<key> =` replaced by `<key> = <value>`."""
    return "\n".join(f"{line.split(' =')[0]} = {changes[line.split(' =')[0]]}"
                     if line.split(" =")[0] in changes else line for line in lines) + "\n"


TYPO_FIX = ({"util.py": "def helper():\n    return 1\n"}, "Fix typo in helper", "The helper does not parse.")
UPSTREAM_V2 = [  # (files, subject, body): the commits from v1 to v2
    TYPO_FIX,
    ({"config.py": _edit(CONFIG, batch="32")}, "Default batch 32", ""),
    ({"model.py": _edit(MODEL, layer_3="30")}, "Retune layer 3", ""),
    ({"README.md": "demo project!\n", "NEWS.md": "2.0\n"}, "Release notes", ""),
]
SERIES = [  # (subject, files, body) on top of v1, and what the dry run onto v2 must say of each
    ("Add a feature flag", {"app.py": "def main():\n    FLAG = True\n    return 0\n", "feature.py": "ON = 1\n"},
     "The recipe switches the feature on."),
    (TYPO_FIX[1], TYPO_FIX[0], TYPO_FIX[2]),
    ("Scale layer 5", {"model.py": _edit(MODEL, layer_5="50")}, "Layer 5 is too small for us."),
    ("Raise the default batch", {"config.py": _edit(CONFIG, batch="16")}, "Keeps the devices busy."),
    ("Lower the learning rate", {"config.py": _edit(CONFIG, batch="16", lr="0.05")}, "Batch 16 needs it."),
    ("Seed the run", {"config.py": _edit(CONFIG, batch="16", lr="0.05", seed="1")}, "Reproducible runs."),
    ("Exclaim in the README", {"README.md": "demo project!\n"}, "Enthusiasm."),
]
V2 = {**V1}
for files, _subject, _body in UPSTREAM_V2:
    V2.update(files)

FLAG, TYPO, LAYER, BATCH, LR, SEED, README = (
    "add-a-feature-flag.patch", "fix-typo-in-helper.patch", "scale-layer-5.patch", "raise-the-default-batch.patch",
    "lower-the-learning-rate.patch", "seed-the-run.patch", "exclaim-in-the-readme.patch")
EXPECTED = {
    FLAG: rehearsal.CLEAN,
    TYPO: rehearsal.UPSTREAM,
    LAYER: rehearsal.MERGED,
    BATCH: rehearsal.CONFLICT,
    LR: rehearsal.CONFLICT,
    SEED: rehearsal.CLEAN,  # same file as the batch patch, but it does not need it
    README: rehearsal.UPSTREAM,
}


def _upstream(tmp_path: Path, extra: dict[str, str] | None = None) -> Upstream:
    """v1 (V1, plus `extra` files), then UPSTREAM_V2's commits up to v2."""
    work = tmp_path / "upstream-work"
    work.mkdir()
    git(work, "init", "-q")
    v1 = commit(work, {**V1, **(extra or {})}, "Initial import", date="2024-01-01T00:00:00Z", trailers="")
    git(work, "tag", "v1")
    for day, (files, subject, body) in enumerate(UPSTREAM_V2, 1):
        commit(work, files, subject, body, date=f"2024-02-0{day}T00:00:00Z")
    git(work, "tag", "v2")
    bare = tmp_path / "upstream.git"
    git(tmp_path, "clone", "-q", "--bare", str(work), str(bare))
    return Upstream(work, bare, v1, git(work, "rev-parse", "v2"))


@pytest.fixture
def dry(tmp_path):
    """The project with the seven-patch series applied on a git tree at v1, and demo-1.1 (= v2) beside 1.0."""
    project = make_project(tmp_path, _upstream(tmp_path), files=V1)
    commit_series(project, SERIES)
    make_sdist(project.dist, "1.1", V2)
    return project


def _rehearse(project, onto: str) -> rehearsal.Rehearsal:
    fork = manifest_mod.load(project.root).forks["demo"]
    return rehearsal.rehearse(project.root, fork, onto, [], [project.dist])


def _assert_each_result(r: rehearsal.Rehearsal) -> None:
    assert {o.patch: o.result for o in r.outcomes} == EXPECTED
    by = {o.patch: o for o in r.outcomes}
    assert list(by[BATCH].conflicts) == ["config.py"]
    assert by[BATCH].conflicts["config.py"][0].startswith("@@ -1,4 +1,4 @@")
    assert by[BATCH].needed_by == [LR] and by[LR].needs == [BATCH]
    assert not by[SEED].needs and not by[LAYER].needs
    assert by[README].why.startswith("emptied")


def test_dry_run_gives_each_patch_its_result(dry):
    r = _rehearse(dry, "v2")
    _assert_each_result(r)
    assert r.outcomes[1].why == "as " + git(dry.upstream.work, "rev-parse", "--short=12", "v2~3")  # the typo fix
    assert (r.old.pypi, r.new.pypi) == (None, None)


def _snapshot(fork: Path) -> dict:
    """Everything a dry run must leave alone: refs, HEAD, status, and every byte of work tree and git dir."""
    git_dir = Path(git(fork, "rev-parse", "--absolute-git-dir"))
    status = git(fork, "status", "--porcelain", "--untracked-files=all", "--ignored")
    files = {}
    for top in (fork, git_dir):
        for path in sorted(top.rglob("*")):
            if path.is_file():
                files[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"refs": git(fork, "for-each-ref"), "head": (git(fork, "symbolic-ref", "HEAD"), git(fork, "rev-parse",
            "HEAD")), "status": status, "files": files}


def test_dry_run_leaves_the_fork_untouched_and_writes_a_draft_report(dry, capsys):
    git(dry.fork, "tag", "-d", "v2")  # not in the fork: the dry run fetches it, into its scratch repository
    (dry.fork / "notes.txt").write_text("uncommitted work\n")
    before = _snapshot(dry.fork)
    assert dry.cli("rebase", "demo", "--onto", "v2", "--dry-run") == 1  # a conflict: a check that found problems
    assert _snapshot(dry.fork) == before
    out = capsys.readouterr().out
    assert "clean 2, 3-way merged 1, conflict 2, already upstream 2; needing a left-out patch 1" in out
    report = (dry.patches / "REBASE-v1-v2.md").read_text()
    assert "(draft)" in report and "Nothing was changed" in report
    for i, (name, result) in enumerate(EXPECTED.items(), 1):
        assert f"| {i} | {name} | {result} |" in report
    assert f"needs {BATCH} (left out)" in report and f"needed by {LR}" in report
    assert "PyPI-derived" not in report


def test_a_dry_run_without_conflicts_exits_0(dry, capsys):
    assert dry.cli("rebase", "demo", "--onto", "v1", "--dry-run") == 0
    assert "clean 7, 3-way merged 0, conflict 0, already upstream 0" in capsys.readouterr().out


def test_the_table_is_plain_without_rich(dry, capsys, monkeypatch):
    for name in ("rich", "rich.console", "rich.table", "rich.text"):
        monkeypatch.setitem(sys.modules, name, None)  # importing them now raises ImportError
    assert dry.cli("rebase", "demo", "--onto", "v2", "--dry-run") == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["#", "patch", "result", "detail"]
    assert lines[4].split()[:4] == ["3", LAYER, "3-way", "merged"]
    assert lines[5].split()[:5] == ["4", BATCH, "conflict", "config.py", "(1"]  # hunks counted; the report lists them


def test_dry_run_onto_a_pypi_release_builds_the_history_from_sdists(tmp_path, capsys):
    project = make_project(tmp_path, _upstream(tmp_path), files=V1)
    commit_series(project, SERIES, source="pypi")
    make_sdist(project.dist, "1.1", V2)
    pin = git(project.fork, "rev-parse", "v1")

    r = _rehearse(project, "demo==1.1")
    assert r.old.commit == pin, "the pin's sdist is laid out and committed exactly as `sync` does"
    assert (r.old.pypi.file, r.new.pypi.file) == ("demo-1.0.tar.gz", "demo-1.1.tar.gz")
    expected = {**EXPECTED, TYPO: rehearsal.UPSTREAM}  # one commit holds all of 1.1: no patch-id matches
    assert {o.patch: o.result for o in r.outcomes} == expected
    assert r.outcomes[1].why.startswith("emptied")

    # CI: a fresh clone without the fork's tree needs only the sdists.
    shutil.rmtree(project.fork)
    assert project.cli("rebase", "demo", "--onto", "demo==1.1", "--dry-run", "--find-links", str(project.dist)) == 1
    report = (project.patches / "REBASE-v1-demo_1.1.md").read_text()
    assert "- from: `v1`" in report and "PyPI-derived from demo-1.0.tar.gz" in report
    assert "- to: `demo==1.1`" in report and "PyPI-derived from demo-1.1.tar.gz" in report
    assert f"| 3 | {LAYER} | 3-way merged |" in report
    assert f"needs {BATCH} (left out)" in report


def test_a_pypi_release_is_for_forks_with_a_pypi_source(dry, capsys):
    make_sdist(dry.dist, "1.1", V2)
    assert dry.cli("rebase", "demo", "--onto", "demo==1.1", "--find-links", str(dry.dist)) == 2
    assert "Pass --upstream-commit SHA" in capsys.readouterr().err, "the rebase itself needs the tag's commit"
    assert dry.cli("rebase", "demo", "--onto", "other==1.1", "--dry-run", "--find-links", str(dry.dist)) == 2
    assert "write it as demo==<version>" in capsys.readouterr().err
    assert dry.cli("rebase", "demo", "--onto", "demo==9.9", "--dry-run", "--find-links", str(dry.dist)) == 2
    assert "no sdist of demo==9.9 found" in capsys.readouterr().err
    assert dry.cli("rebase", "gitonly", "--onto", "gitonly==1.1", "--dry-run") == 2
    assert "has no `pypi`" in capsys.readouterr().err


@pytest.fixture
def index(dry):
    """A PEP 503 simple index on localhost serving demo 1.0 and 1.1 with their sha256, as PyPI does."""
    import functools
    import http.server
    import threading

    served = dry.root.parent / "served"
    page = served / "simple" / "demo"
    page.mkdir(parents=True)
    make_sdist(dry.dist, "1.1", V2)
    links = []
    for sdist in sorted(dry.dist.glob("*.tar.gz")):
        shutil.copy(sdist, served / sdist.name)
        links.append(f'<a href="../../{sdist.name}#sha256={hashlib.sha256(sdist.read_bytes()).hexdigest()}">'
                     f"{sdist.name}</a>")
    (page / "index.html").write_text("<html><body>" + "".join(links) + "</body></html>")
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # pytest would show each request on stderr
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(served)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield served, f"http://127.0.0.1:{server.server_port}/simple"
    server.shutdown()


def test_a_release_on_an_index_is_checked_against_the_index_sha256(dry, index, capsys):
    served, url = index
    good = (served / "demo-1.1.tar.gz").read_bytes()
    sha = hashlib.sha256(good).hexdigest()
    make_sdist(served, "1.1", {**V2, "NEWS.md": "tampered\n"})  # the index serves other bytes than it says
    assert dry.cli("rebase", "demo", "--onto", "demo==1.1", "--dry-run", "--index-url", url) == 2
    assert f"not the {sha} of demo==1.1" in capsys.readouterr().err

    (served / "demo-1.1.tar.gz").write_bytes(good)
    assert dry.cli("rebase", "demo", "--onto", "demo==1.1", "--dry-run", "--index-url", url) == 1
    assert f"PyPI-derived from demo-1.1.tar.gz (sha256 {sha})" in (dry.patches / "REBASE-v1-demo_1.1.md").read_text()
