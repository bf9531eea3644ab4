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
