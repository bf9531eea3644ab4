"""The install plan per profile: golden dry-run output, order, environment, device detection."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.forks import manifest as manifest_mod
from tools.install import cli
from tools.install.plan import Context, build_plan, render

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
ARCH = {"npu": "aarch64", "cuda": "x86_64", "cpu": "x86_64"}


def real_context(device: str, **kw) -> Context:
    return Context(root=ROOT, manifest=manifest_mod.load(ROOT), device=device, venv=ROOT / ".venv",
                   installer=kw.pop("installer", "uv"), arch=kw.pop("arch", ARCH[device]), **kw)


def rendered(device: str, **kw) -> str:
    ctx = real_context(device, **kw)
    return render(ctx, build_plan(ctx)).replace(str(ROOT), "<root>")


@pytest.mark.parametrize("device", ["npu", "cuda", "cpu"])
def test_dry_run_matches_golden(device):
    text = rendered(device)
    golden = GOLDEN / f"{device}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"plan changed: UPDATE_GOLDEN=1 pytest {__file__} to accept"


def _order(device: str) -> list[str]:
    return [s.name for s in build_plan(real_context(device))]


def test_npu_order_and_environment():
    order = _order("npu")
    assert order[:5] == ["preflight", "forks", "venv", "build-tools", "torch"]
    assert order.index("megatron") < order.index("mindspeed") < order.index("mindspeed-llm")
    assert order.index("vllm") < order.index("vllm-ascend")
    assert order[-3:] == ["verl", "requirements", "smoke"]
    steps = {s.name: s for s in build_plan(real_context("npu"))}
    assert steps["vllm"].env["VLLM_TARGET_DEVICE"] == "empty"
    assert steps["vllm-ascend"].env["COMPILE_CUSTOM_KERNELS"] == "1"
    assert steps["vllm-ascend"].env["SOC_VERSION"] == "ascend910_9391"
    assert [c[-1] for c in steps["torch"].commands] == ["torch==2.5.1", "torch_npu==2.5.1.post1"]


def test_npu_on_x86_takes_the_cpu_build_of_torch():
    steps = {s.name: s for s in build_plan(real_context("npu", arch="x86_64"))}
    first = steps["torch"].commands[0]
    assert "torch==2.5.1+cpu" in first and "https://download.pytorch.org/whl/cpu" in first


def test_cpu_and_cuda_leave_out_the_ascend_forks():
    for device in ("cpu", "cuda"):
        order = _order(device)
        assert not {"mindspeed", "mindspeed-llm", "vllm-ascend"} & set(order)
        assert order.index("megatron") < order.index("vllm") < order.index("verl")
    cpu = {s.name: s for s in build_plan(real_context("cpu"))}
    assert cpu["torch"].commands[0][-1] == "torch==2.13.0"
    assert "-c" in cpu["requirements"].commands[0], "the cpu lock constrains the requirements"


def test_wheelhouse_makes_every_install_offline(tmp_path):
    for arch in ("aarch64", "x86_64"):
        steps = [s for s in build_plan(real_context("npu", arch=arch, wheelhouse=tmp_path)) if s.name != "venv"]
        for cmd in (cmd for step in steps for cmd in step.commands):
            assert "--no-index" in cmd and str(tmp_path) in cmd, cmd
            assert "https://download.pytorch.org/whl/cpu" not in cmd


def test_pip_installer_uses_the_venv_pip():
    steps = build_plan(real_context("cpu", installer="pip"))
    verl = next(s for s in steps if s.name == "verl")
    assert verl.commands[0][:4] == (str(ROOT / ".venv/bin/python"), "-m", "pip", "install")


@pytest.mark.parametrize("env, which, expected", [
    ({"ASCEND_TOOLKIT_HOME": "{cann}"}, None, "npu"),
    ({}, "/usr/bin/nvidia-smi", "cuda"),
    ({}, None, "cpu"),
])
def test_detect_device(tmp_path, monkeypatch, env, which, expected):
    env = {k: v.format(cann=tmp_path) for k, v in env.items()}
    monkeypatch.setattr(cli.shutil, "which", lambda name: which if name == "nvidia-smi" else None)
    monkeypatch.setattr(cli, "cann_home", lambda e: Path(e["ASCEND_TOOLKIT_HOME"]) if e.get("ASCEND_TOOLKIT_HOME")
                        else None)
    device, why = cli.detect_device(env)
    assert device == expected and why


def test_pip_index_options_translate_pip_settings(monkeypatch):
    env = {"PIP_INDEX_URL": "https://mirror.example/simple", "PIP_EXTRA_INDEX_URL": "https://a/simple https://b/simple",
           "PIP_FIND_LINKS": "/opt/wheels"}
    opts = cli.pip_index_options(env)
    assert opts[opts.index("--index-url") + 1] == "https://mirror.example/simple"
    assert [opts[i + 1] for i, o in enumerate(opts) if o == "--extra-index-url"] == ["https://a/simple",
                                                                                    "https://b/simple"]
    assert "/opt/wheels" in opts and "unsafe-best-match" in opts
