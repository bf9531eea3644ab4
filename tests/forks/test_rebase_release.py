"""rebase onto a PyPI release, for a fork without upstream's git history (vLLM here: only its sdists).

`--onto demo==1.1 --upstream-commit SHA` replays the series on demo-1.1's sdist laid out on the pin's (the dry
run's base, the same id), keeps SHA in the port, and at the finish pins the tag v1.1 at SHA with the release's
sdist as `pypi`, leaving the fork as `sync` + `apply` make it for that pin. The seven-patch series and upstream
v2 (= demo-1.1) are the dry-run tests': the batch patch conflicts, the learning-rate patch after it too.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest

from tests.forks.conftest import commit_series, git, make_project, make_sdist, sha256
from tests.forks.test_rebase_dry_run import CONFIG, SERIES, V1, V2, _edit, _rehearse, _upstream

FLAG, TYPO, LAYER, BATCH, LR, SEED, README = (
    "add-a-feature-flag", "fix-typo-in-helper", "scale-layer-5", "raise-the-default-batch",
    "lower-the-learning-rate", "seed-the-run", "exclaim-in-the-readme")
DROP_BATCH = ("--drop", BATCH, "--why", "v1.1's batch 32 is enough")
DROP_LR = ("--drop", LR, "--obsolete", "--why", "the lr followed our batch")
UNREACHABLE = "http://127.0.0.1:9/simple"  # the discard port: nothing listens, the connection is refused


def _pypi_project(where: Path, upstream=None):
    """A project whose fork is the PyPI tree of demo 1.0 with the seven patches applied, demo-1.1 (= v2) beside."""
    upstream = upstream or _upstream(where)
    project = make_project(where, upstream, files=V1)
    commit_series(project, SERIES, source="pypi")
    make_sdist(project.dist, "1.1", V2)
    return project


@pytest.fixture
def proj(tmp_path):
    return _pypi_project(tmp_path)


def _port_dir(p) -> Path:
    return p.root / "third_party/patches/ports/demo-v1.1"


def _port(p) -> dict:
    return tomllib.loads((_port_dir(p) / "port.toml").read_text())


def _pin(p) -> dict:
    return tomllib.loads((p.root / "third_party/forks.toml").read_text())["forks"]["demo"]


def _gitlink(p) -> str:
    return git(p.root, "ls-files", "--stage", "third_party/demo").split()[1]


def _release(p, *args: str) -> int:
    return p.cli("rebase", "demo", "--onto", "demo==1.1", "--find-links", str(p.dist), *args)


def _resolve(p, text: str) -> None:
    (p.fork / "config.py").write_text(text)
    git(p.fork, "add", "config.py")


def _like_vllms(p) -> None:
    """The port as third_party/patches/ports/vllm-v0.11.0 has it: written before `upstream` (and [pypi]) existed."""
    path = _port_dir(p) / "port.toml"
    text = path.read_text().split("\n[[patch]]", 1)
    top = [line for line in text[0].split("\n[pypi]")[0].splitlines() if not line.startswith("upstream = ")]
    path.write_text("\n".join(top) + "\n\n[[patch]]" + text[1])


def test_a_release_rebase_pins_the_tags_commit_and_leaves_the_tree_sync_and_apply_make(proj, tmp_path, capsys):
    p, sha = proj, proj.upstream.v2
    assert _release(p, "--upstream-commit", sha, *DROP_BATCH) == 3
    assert f"[5/7] {LR}: conflict" in capsys.readouterr().out
    port = _port(p)
    assert (port["from"], port["to_ref"], port["upstream"]) == (p.upstream.v1, "v1.1", sha)
    assert port["to"] == _rehearse(p, "demo==1.1").new.commit, "the dry run's base: the same files, the same id"
    assert port["pypi"] == {"requirement": "demo==1.1", "file": "demo-1.1.tar.gz",
                            "sha256": sha256(p.dist / "demo-1.1.tar.gz")}
    assert "PyPI-derived commit of demo-1.1.tar.gz" in port["to_note"]

    assert p.cli("rebase", "demo", *DROP_LR) == 0
    assert f"rebased demo onto v1.1 ({sha[:12]})" in capsys.readouterr().out
    pin = _pin(p)
    assert (pin["ref"], pin["commit"]) == ("v1.1", sha), "the tag's upstream commit, not the PyPI-derived one"
    assert pin["pypi"] == port["pypi"]
    assert _gitlink(p) == sha
    assert not _port_dir(p).exists()
    report = (p.patches / "REBASE-v1-v1.1.md").read_text()
    assert f"- to: `v1.1` ({sha})" in report and f"- replayed on: {port['to']}, the PyPI-derived" in report

    # The tree is what `sync` + `apply` make for the new pin: a teammate who pulls gets the same branch.
    assert p.cli("status", "--check", "demo") == 0
    assert p.cli("check", "demo") == 0
    assert p.cli("export", "--check", "demo") == 0
    series = {f.name: f.read_bytes() for f in p.patches.iterdir()}
    assert p.cli("export", "demo") == 0 and {f.name: f.read_bytes() for f in p.patches.iterdir()} == series
    teammate = make_project(tmp_path / "teammate", p.upstream, files=V1)
    shutil.copy(p.root / "third_party/forks.toml", teammate.root / "third_party/forks.toml")
    shutil.rmtree(teammate.patches)
    shutil.copytree(p.patches, teammate.patches)
    git(teammate.root, "update-index", "--cacheinfo", f"160000,{sha},third_party/demo")
    assert teammate.cli("sync", "demo", "--source", "pypi", "--find-links", str(p.dist)) == 0
    assert teammate.cli("apply", "demo") == 0
    assert git(teammate.fork, "rev-parse", "recipe/demo") == git(p.fork, "rev-parse", "recipe/demo")
    root = git(p.fork, "rev-list", "--max-parents=0", "recipe/demo")
    assert root == git(teammate.fork, "rev-parse", "v1.1") == git(p.fork, "rev-parse", "v1.1")
    assert root != port["to"], "sync's root commit (pinned), not the replay's base on the old pin"
    assert git(p.fork, "config", "recipe.upstream-commit") == sha and git(p.fork, "config", "recipe.source") == "pypi"


def test_the_port_keeps_the_upstream_commit_for_continue_and_other_machines(proj, tmp_path, capsys):
    p, sha = proj, proj.upstream.v2
    assert _release(p, "--upstream-commit", sha) == 3
    assert f"[4/7] {BATCH}: conflict" in capsys.readouterr().out
    _resolve(p, _edit(CONFIG, batch="64"))
    assert p.cli("rebase", "demo", "--continue", "--why", "v1.1 raised the batch to 32; we go to 64") == 3
    assert _port(p)["upstream"] == sha
    assert p.cli("rebase", "demo", "--abort") == 0
    assert "`python -m tools.forks rebase demo --onto demo==1.1` goes on from it" in capsys.readouterr().out
    assert p.cli("rebase", "demo", "--status", "--onto", "demo==1.1") == 0
    assert "--onto demo==1.1` replays the port" in capsys.readouterr().out

    other = _pypi_project(tmp_path / "elsewhere", p.upstream)
    shutil.copytree(_port_dir(p), _port_dir(other))
    capsys.readouterr()
    assert _release(other) == 3, "no --upstream-commit: the port has it"
    out = capsys.readouterr().out
    assert f"[4/7] {BATCH}: clean, reworked (from the port)" in out and f"[5/7] {LR}: conflict" in out
    _resolve(other, _edit(CONFIG, batch="64", lr="0.05"))
    assert other.cli("rebase", "demo", "--continue") == 0
    assert (_pin(other)["ref"], _pin(other)["commit"]) == ("v1.1", sha)
    assert other.cli("status", "--check", "demo") == 0 and other.cli("export", "--check", "demo") == 0


def test_a_release_rebase_needs_the_tags_commit_and_one_that_agrees_with_the_port(proj, capsys):
    p, sha = proj, proj.upstream.v2
    assert _release(p) == 2
    err = capsys.readouterr().err
    assert "Pass --upstream-commit SHA, the full 40-hex commit of v1.1" in err
    assert f"`git ls-remote {p.upstream.bare} 'refs/tags/v1.1^{{}}'`" in err
    assert not _port_dir(p).exists()
    assert _release(p, "--upstream-commit", sha[:12]) == 2
    assert "is not a 40-hex commit id" in capsys.readouterr().err
    assert p.cli("rebase", "demo", "--onto", "v2", "--upstream-commit", sha) == 2
    assert "--upstream-commit goes with --onto NAME==VERSION" in capsys.readouterr().err

    assert _release(p, "--upstream-commit", sha) == 3
    assert p.cli("rebase", "demo", "--abort") == 0
    capsys.readouterr()
    assert _release(p, "--upstream-commit", p.upstream.v1) == 2
    assert f"upstream = {sha}, the commit of v1.1 the port began with, but --upstream-commit says" \
           f" {p.upstream.v1}" in capsys.readouterr().err
    # A port begun before `upstream` existed (vllm-v0.11.0's) is picked up; the commit is given once more.
    _like_vllms(p)
    assert _release(p) == 2
    assert _release(p, "--upstream-commit", sha) == 3
    assert _port(p)["upstream"] == sha and _port(p)["pypi"]["file"] == "demo-1.1.tar.gz"


def test_check_replays_a_release_port_on_a_pypi_tree(proj, tmp_path, capsys):
    p = proj
    assert _release(p, "--upstream-commit", p.upstream.v2) == 3
    assert p.cli("rebase", "demo", "--abort") == 0
    other = _pypi_project(tmp_path / "elsewhere", p.upstream)
    shutil.copytree(_port_dir(p), _port_dir(other))
    _like_vllms(other)  # no [pypi]: the release is demo at the version of to_ref v1.1
    to = _port(other)["to"]
    assert git(other.fork, "cat-file", "-t", to, check=False) != "commit"
    capsys.readouterr()

    assert other.cli("check", "demo", "--index-url", UNREACHABLE) == 0, "out of reach: lint only, no crash"
    out = capsys.readouterr().out
    assert f"ok (lint only: v1.1 ({to[:12]}) is not in the pypi tree at third_party/demo (demo==1.1's" \
           " PyPI-derived commit, to replay the port on, could not be built: demo: no sdist of demo==1.1 found;" in out

    assert other.cli("check", "demo", "--index-url", UNREACHABLE, "--find-links", str(other.dist)) == 0
    assert "port third_party/patches/ports/demo-v1.1: ok (lint + the port's patches apply onto v1.1)" in \
        capsys.readouterr().out
    layer = _port_dir(other) / f"{LAYER}.patch"
    good = layer.read_text()
    layer.write_text(good.replace("-layer_5 = 5", "-layer_5 = 6"))
    assert other.cli("check", "demo") == 1, "replayed: a patch that does not apply is found"
    assert f"{LAYER}.patch: does not apply onto v1.1" in capsys.readouterr().out

    layer.write_text(good)
    make_sdist(other.dist, "1.1", {**V2, "NEWS.md": "another 1.1\n"})  # other files: another commit
    git(other.fork, "gc", "-q", "--prune=now")  # the commit built above is on no ref: gone, built again
    assert other.cli("check", "demo", "--index-url", UNREACHABLE, "--find-links", str(other.dist)) == 0
    assert "(demo==1.1's PyPI-derived commit is " in capsys.readouterr().out


def test_a_git_tree_rebases_onto_a_release_and_becomes_the_new_pins_pypi_tree(tmp_path, capsys):
    p = make_project(tmp_path, _upstream(tmp_path), files=V1)
    commit_series(p, SERIES)  # from git
    make_sdist(p.dist, "1.1", V2)
    assert _release(p, "--upstream-commit", p.upstream.v2, *DROP_BATCH) == 3
    assert p.cli("rebase", "demo", *DROP_LR) == 0
    assert (_pin(p)["commit"], _gitlink(p)) == (p.upstream.v2, p.upstream.v2)
    assert git(p.fork, "config", "recipe.source") == "pypi"
    assert p.cli("status", "--check", "demo") == 0 and p.cli("export", "--check", "demo") == 0
