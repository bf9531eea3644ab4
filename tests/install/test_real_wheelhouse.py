"""The cpu wheelhouse for real: fill it from the package index, then install from it into a fresh venv
of a fresh checkout with no index at all, import every fork, read what stack.json records, and run the
install again to find every step up to date.

What a new user of an air-gapped cluster does. The vLLM wheel in it is the CPU-kernel build, taken
from the wheel cache (built there first, about 5 minutes, when the cache lacks it); the offline
install starts from an empty wheel cache, so it must take that wheel from the wheelhouse. Slow
(minutes: some 190 wheels, torch among them). A CI test: what it needs and cannot find (the index,
numa.h) fails it with the reason; it never skips.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.forks.test_real_sources import _index_unreachable
from tools.forks.cli import main as forks_main
from tools.forks.manifest import load
from tools.install.cli import main as install_main

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.network, pytest.mark.slow]


def _scratch(root: Path) -> Path:
    (root / "third_party").mkdir(parents=True)
    shutil.copy(ROOT / "third_party/forks.toml", root / "third_party/forks.toml")
    shutil.copytree(ROOT / "third_party/patches", root / "third_party/patches")
    shutil.copytree(ROOT / "requirements", root / "requirements")
    return root


def test_cpu_wheelhouse_installs_every_fork_with_no_index(tmp_path, monkeypatch, capsys):
    reason = _index_unreachable()
    assert reason is None, f"{reason}: filling a wheelhouse needs the package index (PIP_INDEX_URL to change it)"

    online = _scratch(tmp_path / "online")
    assert forks_main(["--root", str(online), "sync", "--source", "pypi", "--profile", "cpu"]) == 0
    dest = tmp_path / "wheels"
    assert install_main(["--root", str(online), "wheelhouse", "--device", "cpu", "--dest", str(dest)]) == 0, \
        capsys.readouterr().err
    record = json.loads((dest / "wheelhouse.json").read_text())
    assert record["profile"] == "cpu"
    [vllm_wheel] = record["built"].values()
    pins = {name: load(ROOT).forks[name].pypi for name in ("vllm", "verl", "megatron")}
    assert vllm_wheel.startswith(f"vllm-{pins['vllm'].version}+cpu-") and vllm_wheel in record["files"]
    names = {name.split("-")[0].lower() for name in record["files"]}
    assert {"torch", "numba", "verl", "megatron_core", "cmake", "transformers"} <= names
    for pin in pins.values():
        assert pin.file in record["files"], f"{pin.file}: the pinned source, for `tools.forks sync` offline"
    assert not (dest / ".build-env").exists()

    # Offline: no index, none of this machine's pip settings (its find-links hold torch), uv offline,
    # an empty wheel cache, and a checkout whose forks come from the wheelhouse's pinned sources.
    for key in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("UV_OFFLINE", "1")
    monkeypatch.setenv("UV_NO_CONFIG", "1")
    monkeypatch.setenv("RL_RECIPE_WHEEL_CACHE", str(tmp_path / "empty-wheel-cache"))
    offline = _scratch(tmp_path / "offline")
    venv = tmp_path / "offline-venv"
    capsys.readouterr()
    args = ["--root", str(offline), "--device", "cpu", "--venv", str(venv), "--wheelhouse", str(dest)]
    assert install_main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"{vllm_wheel} from the wheelhouse" in out and "building vllm's wheel" not in out

    probe = ("import verl, vllm, megatron.core, importlib.metadata as m;"
             "from vllm.platforms import current_platform;"
             "print(m.version('vllm'), m.version('verl'), m.version('megatron-core'), current_platform.device_type)")
    done = subprocess.run([venv / "bin/python", "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "VLLM_PLUGINS": "none", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    versions = [pin.requirement.split("==")[1] for pin in pins.values()]
    assert done.stdout.split()[-4:] == [versions[0] + "+cpu", *versions[1:], "cpu"]

    # what the install records, and a second run that finds everything done (the checks of the former
    # test_real_install, whose index install is the one `nox -s tests` makes on a fresh machine before this runs)
    stack = json.loads((venv / "stack.json").read_text())
    for name in ("verl", "vllm", "megatron"):
        fork = stack["forks"][name]
        assert fork["commit"] and fork["branch_tip"] and fork["series_sha256"], (name, fork)
    assert stack["packages"]["transformers"] == load(ROOT).stack["cpu"]["transformers"]
    capsys.readouterr()
    assert install_main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    for step in ("venv", "torch", "megatron", "vllm", "verl", "requirements", "smoke"):
        assert f"{step}: up to date" in out, out[-3000:]
