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

    record = json.loads(manifest.read_text())
    names = {name.split("-")[0] for name in record["files"]}
    assert {"torch", "fakedep", "verl", "vllm", "megatron_core"} <= names
    assert not (target.dest / ".build-env").exists()
    # the cpu vllm wheel went through the wheel cache, under the key the install plan asks for
    vllm = next(s for s in build_plan(ctx) if s.name == "vllm").wheel
    assert record["built"] == {vllm.key: "vllm-1.0-py3-none-any.whl"}
    assert (vllm.folder / "vllm-1.0-py3-none-any.whl").is_file()

    # Nothing but the wheelhouse: the package folder is gone, every index is switched off and the
    # wheel cache is a new, empty one: the vllm wheel comes from the wheelhouse, nothing compiles.
    shutil.rmtree(fake_stack.links)
    monkeypatch.delenv("PIP_FIND_LINKS")
    monkeypatch.setenv("UV_OFFLINE", "1")
    fake_stack.log.unlink()
    offline = fake_stack.context(venv=tmp_path / "offline-venv", wheelhouse=target.dest, index_options=(),
                                 wheel_cache=tmp_path / "empty-cache")
    said = []
    outcome = execute(offline, build_plan(offline), say=said.append)
    assert outcome["smoke"] == "ran"
    assert any("vllm-1.0-py3-none-any.whl from the wheelhouse" in line for line in said)
    assert "vllm" not in fake_stack.order()
    stack = json.loads((offline.venv / "stack.json").read_text())
    assert stack["packages"]["torch"] == "9.9.9" and stack["packages"]["vllm"] == "1.0"


def test_wheelhouse_installs_torch_into_the_build_env_before_the_fork_wheels(fake_stack, tmp_path):
    ctx = fake_stack.context()
    target = wheelhouse.Target(tmp_path / "wh", None, "3.11")
    cmds = wheelhouse.plan(ctx, target)
    torch = next(i for i, c in enumerate(cmds) if c[-1] == "torch==9.9.9" and "install" in c)
    forks = [i for i, c in enumerate(cmds) if "--no-build-isolation" in c and c[-1].startswith(str(ctx.root))]
    assert len(forks) == 3 and torch < min(forks)
    vllm = next(cmds[i] for i in forks if cmds[i][-1].endswith("/vllm"))
    assert vllm[vllm.index("--wheel-dir") + 1] == str(next(s for s in build_plan(ctx) if s.name == "vllm").wheel.folder)


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
    assert built == [str(ctx.root / "third_party/verl")], "compiled forks (megatron, the cpu vllm) are built there"


def test_cuda_wheelhouse_builds_transformer_engine_torch_before_the_requirements(tmp_path):
    from tests.install.test_plan import real_context

    cmds = wheelhouse.plan(real_context("cuda"), wheelhouse.Target(tmp_path, None, "3.11"))
    torch = next(i for i, c in enumerate(cmds) if c[-1] == "torch==2.8.0" and "install" in c)
    te = next(i for i, c in enumerate(cmds) if c[-1] == "transformer_engine_torch==2.3.0")
    reqs = next(i for i, c in enumerate(cmds) if "-r" in c)
    assert torch < te < reqs and "--no-build-isolation" in cmds[te]
    assert cmds[reqs][cmds[reqs].index("--find-links") + 1] == str(tmp_path), "the built TE wheel, not its sdist"
