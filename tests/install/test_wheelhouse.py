"""Wheelhouse round trip: fill a folder from local packages, then install from it with no index."""

from __future__ import annotations

import json
import platform
import shutil
import sys

from tools.install import wheelhouse
from tools.install.plan import build_plan
from tools.install.run import execute


def test_wheelhouse_round_trip(fake_stack, tmp_path, monkeypatch):
    ctx = fake_stack.context()
    target = wheelhouse.Target(tmp_path / "wheelhouse", None, "{}.{}".format(*sys.version_info[:2]))
    manifest = wheelhouse.build(ctx, target, wheelhouse.plan(ctx, target))

    files = json.loads(manifest.read_text())["files"]
    names = {name.split("-")[0] for name in files}
    assert {"torch", "fakedep", "verl", "vllm", "megatron_core"} <= names
    assert not (target.dest / ".build-env").exists()

    # Nothing but the wheelhouse: the package folder is gone and every index is switched off.
    shutil.rmtree(fake_stack.links)
    monkeypatch.delenv("PIP_FIND_LINKS")
    monkeypatch.setenv("UV_OFFLINE", "1")
    offline = fake_stack.context(venv=tmp_path / "offline-venv", wheelhouse=target.dest, index_options=())
    outcome = execute(offline, build_plan(offline), say=lambda *a: None)
    assert outcome["smoke"] == "ran"
    stack = json.loads((offline.venv / "stack.json").read_text())
    assert stack["packages"]["torch"] == "9.9.9"


def test_cross_platform_wheelhouse_downloads_binaries_for_the_target(fake_stack, tmp_path):
    ctx = fake_stack.context()
    other = "manylinux_2_28_x86_64" if platform.machine() == "aarch64" else "manylinux_2_28_aarch64"
    target = wheelhouse.Target(tmp_path / "wh", other, "3.11")
    assert target.cross()
    cmds = wheelhouse.plan(ctx, target)
    download = next(c for c in cmds if "download" in c)
    assert "--only-binary=:all:" in download and target.platform in download
    assert "torch==9.9.9" in download and "-r" in download
    built = [c[-1] for c in cmds if "wheel" in c and "--no-deps" in c]
    assert built == [str(ctx.root / "third_party/vllm"), str(ctx.root / "third_party/verl")]
