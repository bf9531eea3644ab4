"""`install --device cpu` on the real forks from PyPI, in a scratch copy of the repository.

The acceptance run of the install issue: verl (with our series), vLLM 0.9.1+cpu (the CPU kernels
built from our fork; from the wheel cache after the first build, about 5 minutes) and megatron.core
import from the new environment, vLLM's platform is cpu, stack.json records the commits, and a
second run does nothing. Skipped, saying why, when the package index cannot be reached.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.forks.test_real_sources import _index_unreachable
from tests.stack import missing
from tools.forks.cli import main as forks_main
from tools.install.cli import main as install_main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.network


def test_cpu_install_of_the_real_stack(tmp_path, capsys):
    reason = _index_unreachable()
    if reason:
        missing(reason, "the cpu install fetches the stack from it")
    root = tmp_path / "project"
    (root / "third_party").mkdir(parents=True)
    shutil.copy(ROOT / "third_party/forks.toml", root / "third_party/forks.toml")
    shutil.copytree(ROOT / "third_party/patches", root / "third_party/patches")
    shutil.copytree(ROOT / "requirements", root / "requirements")
    assert forks_main(["--root", str(root), "sync", "--source", "pypi", "--profile", "cpu"]) == 0

    args = ["--root", str(root), "--device", "cpu", "--venv", str(root / ".venv")]
    assert install_main(args) == 0, capsys.readouterr().err
    python = root / ".venv/bin/python"
    probe = ("import verl, vllm, megatron.core, importlib.metadata as m;"
             "from vllm.platforms import current_platform;"
             "print(m.version('vllm'), m.version('verl'), m.version('megatron-core'), current_platform.device_type)")
    env = {"VLLM_PLUGINS": "none", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    versions = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True, cwd=tmp_path,
                              env=env).stdout.split()
    assert versions[-4:] == ["0.9.1+cpu", "0.4.0", "0.12.3", "cpu"]

    stack = json.loads((root / ".venv/stack.json").read_text())
    for name in ("verl", "vllm", "megatron"):
        fork = stack["forks"][name]
        assert fork["source"] == "pypi" and fork["commit"] and fork["branch_tip"]
        assert fork["series_sha256"]
    assert stack["packages"]["transformers"] == "4.51.1"

    capsys.readouterr()
    assert install_main(args) == 0
    out = capsys.readouterr().out
    for step in ("venv", "torch", "megatron", "vllm", "verl", "requirements", "smoke"):
        assert f"{step}: up to date" in out
