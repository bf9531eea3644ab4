"""The real forks from their real sources, in a scratch superproject (the checkout is never touched).

PyPI: verl, vLLM, vLLM-Ascend and Megatron-core sdists are downloaded, sha256-checked and laid out;
the MindSpeed forks are reported git-only. Git: every fork whose upstream URL has a mirror
(`git config url.<mirror>.insteadOf <url>`) is synced from it. Both then apply and check our series
on the pinned trees. Each test skips, saying why, when its source cannot be reached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests import stack
from tools.forks import manifest as manifest_mod
from tools.forks.cli import main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.network


def _scratch_project(dest: Path, superproject: bool) -> Path:
    (dest / "third_party").mkdir(parents=True)
    shutil.copy(ROOT / "third_party/forks.toml", dest / "third_party/forks.toml")
    shutil.copytree(ROOT / "third_party/patches", dest / "third_party/patches")
    if superproject:
        shutil.copy(ROOT / ".gitmodules", dest / ".gitmodules")
        subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
        for fork in manifest_mod.load(dest).forks.values():
            subprocess.run(["git", "update-index", "--add", "--cacheinfo", f"160000,{fork.commit},{fork.path}"],
                           cwd=dest, check=True)
    return dest


def _index_unreachable() -> str | None:
    index = os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"
    try:
        urllib.request.urlopen(f"{index.rstrip('/')}/verl/", timeout=15).close()
        return None
    except OSError as exc:
        return f"package index {index} unreachable: {exc}"


def test_pypi_sources_give_four_forks_and_report_mindspeed_git_only(tmp_path, capsys):
    reason = _index_unreachable()
    if reason:
        stack.missing(reason, "the PyPI sources of verl, vLLM, vLLM-Ascend and Megatron-core need it")
    root = _scratch_project(tmp_path / "project", superproject=False)
    assert main(["--root", str(root), "sync", "--source", "pypi"]) == 0
    out = capsys.readouterr().out
    for name in ("verl", "vllm", "vllm-ascend", "megatron"):
        assert f"{name}: synced from PyPI" in out
    for name in ("mindspeed", "mindspeed-llm"):
        assert f"{name}: git-only" in out
    for marker in ("verl/verl/trainer/main_ppo.py", "vllm/vllm/engine/llm_engine.py",
                   "vllm-ascend/vllm_ascend/platform.py", "Megatron-LM/megatron/core/parallel_state.py"):
        assert (root / "third_party" / marker).is_file(), marker
    pypi_forks = ["verl", "vllm", "vllm-ascend", "megatron"]
    assert main(["--root", str(root), "apply", *pypi_forks]) == 0
    assert main(["--root", str(root), "check", *pypi_forks]) == 0
    assert main(["--root", str(root), "status", "--check", *pypi_forks]) == 0


def _mirrored(urls: list[str]) -> set[str]:
    proc = subprocess.run(["git", "config", "--get-regexp", r"^url\..*\.insteadof$"], capture_output=True, text=True)
    prefixes = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if " " in line]
    return {u for u in urls if any(u.startswith(p) for p in prefixes)}


def test_git_mirrors_sync_and_apply_every_mirrored_fork(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("GIT_CONFIG_GLOBAL")  # the user's mirrors live in the real global config
    forks = manifest_mod.load(ROOT).forks.values()
    mirrored = _mirrored([f.url for f in forks])
    names = [f.name for f in forks if f.url in mirrored]
    if not names:
        stack.unavailable(stack.GIT, "no git mirror configured for any fork")
    root = _scratch_project(tmp_path / "project", superproject=True)
    args = ["--root", str(root)]
    assert main([*args, "sync", "--source", "git", *names]) == 0
    assert main([*args, "apply", *names]) == 0
    assert main([*args, "check", *names]) == 0
    assert main([*args, "status", "--check", *names]) == 0
    out = capsys.readouterr().out
    assert out.count("applies to the pin") == len(names)
    missing = sorted({f.name for f in forks} - set(names))
    if missing:
        print(f"not mirrored here, so not synced from git: {', '.join(missing)}")



def _files(tree: Path) -> dict[str, Path]:
    """Every file under `tree` but its .git, by path relative to it."""
    return {p.relative_to(tree).as_posix(): p for p in tree.rglob("*")
            if p.is_file() and ".git" not in p.relative_to(tree).parts[:1]}


def _under(path: str, trees: tuple[str, ...]) -> bool:
    return any(path == t or path.startswith(t + "/") for t in trees)


_VERL_TREES: dict[str, dict[str, Path]] = {}  # source -> the files `sync` laid out, made once per session


def _verl_trees(tmp_path_factory, monkeypatch, capsys) -> tuple[manifest_mod.Fork, dict[str, Path], dict[str, Path]]:
    """verl synced from git (a mirror) and from PyPI into two scratch projects: the fork and both trees' files."""
    monkeypatch.delenv("GIT_CONFIG_GLOBAL")  # the user's mirrors live in the real global config
    verl = manifest_mod.load(ROOT).forks["verl"]
    if not _mirrored([verl.url]):
        stack.unavailable(stack.GIT, f"no git mirror configured for verl ({verl.url}) to compare its sdist with")
    reason = _index_unreachable()
    if reason:
        stack.missing(reason, "the verl sdist comes from it")
    if not _VERL_TREES:
        scratch = tmp_path_factory.mktemp("verl-trees")
        for source, superproject in (("git", True), ("pypi", False)):
            root = _scratch_project(scratch / source, superproject=superproject)
            assert main(["--root", str(root), "sync", "--source", source, "verl"]) == 0
            if source == "pypi":
                said = f"lacks, compared with {verl.ref}: {', '.join(verl.pypi.lacks)}"
                assert said in capsys.readouterr().out, "sync from PyPI names what it lacks"
            _VERL_TREES[source] = _files(root / verl.path)
    return verl, _VERL_TREES["git"], _VERL_TREES["pypi"]


def test_verl_sdist_equals_its_tag_but_for_the_trees_forks_toml_says_it_lacks(tmp_path_factory, monkeypatch, capsys):
    """The sdist-to-tag equality check: verl synced from git (a mirror) and from PyPI, compared file by file.

    Compared: the distribution's package, verl/ (what forks.toml's note says equals the tag). The sdist also ships
    parts of the tag's tests/ and scripts/ (counted, not compared) and none of examples, recipe, docs. The rule: every
    Python file of verl/ at the tag that the sdist lacks lies under a `lacks` path, every Python file both have is
    byte-identical, the sdist has no Python file the tag has not, and every `lacks` path is present at the tag and
    missing from the sdist (so a stale entry fails). Other files of verl/ that differ (READMEs, YAML) are printed,
    not held to the list.
    """
    verl, tag, sdist = _verl_trees(tmp_path_factory, monkeypatch, capsys)
    lacks = verl.pypi.lacks
    assert lacks, "forks.verl.pypi.lacks names the trees the sdist lacks"
    package = verl.distribution.replace("-", "_")
    tag_only = sorted(p for p in tag if p.startswith(f"{package}/") and p not in sdist)
    sdist_only = sorted(p for p in sdist if p.startswith(f"{package}/") and p not in tag)
    differ = sorted(p for p in tag if p.startswith(f"{package}/") and p in sdist
                    and tag[p].read_bytes() != sdist[p].read_bytes())
    python = [p for p in tag_only if p.endswith(".py")]
    compared = sum(p.startswith(f"{package}/") for p in tag)
    print(f"verl {verl.ref}: {compared} files under {package}/ at the tag; the sdist lacks {len(tag_only)}"
          f" ({len(python)} Python), has {len(sdist_only)} the tag has not, {len(differ)} differ")
    for path in tag_only:
        print(f"  tag only: {path}" + ("" if _under(path, lacks) else "  (not Python: not held to lacks)"
                                       if not path.endswith(".py") else "  (outside lacks)"))
    for path in sdist_only + differ:
        print(f"  {'sdist only' if path in sdist_only else 'differs'}: {path}")
    for top in sorted({p.split("/", 1)[0] for p in sdist if "/" in p} - {package, f"{package}.egg-info"}):
        have = [p for p in tag if p.startswith(f"{top}/")]
        print(f"  {top}/: the sdist ships {sum(p in sdist for p in have)} of the tag's {len(have)} files"
              f" ({sum(p.endswith('.py') and p not in sdist for p in have)} Python files not)")
    assert [p for p in python if not _under(p, lacks)] == [], "Python files the sdist lacks outside pypi.lacks"
    assert [p for p in differ if p.endswith(".py")] == [], "Python files that differ between the sdist and the tag"
    assert [p for p in sdist_only if p.endswith(".py")] == [], "Python files of the sdist that the tag has not"
    stale = [t for t in lacks if not any(_under(p, (t,)) for p in tag) or any(_under(p, (t,)) for p in sdist)]
    assert stale == [], "pypi.lacks entries that are not at the tag or not missing from the sdist"


def test_no_verl_patch_changes_a_file_the_sdist_lacks(tmp_path_factory, monkeypatch, capsys):
    """What `check` cannot see without both trees: a patch that changes (not creates) a file of the tag that the sdist
    lacks, anywhere in the tree (tests/ too), does not apply to the tree CI syncs from PyPI."""
    from tools.forks import ops
    from tools.forks.series import Series

    verl, tag, sdist = _verl_trees(tmp_path_factory, monkeypatch, capsys)
    needs = [f"{patch.name}: {path}" for patch in Series(ROOT / verl.patches).paths()
             for path in sorted(ops.patch_paths(patch.read_text(encoding="utf-8")))
             if path in tag and path not in sdist]
    assert needs == [], f"patches of the verl series that change files {verl.pypi.file} lacks"
