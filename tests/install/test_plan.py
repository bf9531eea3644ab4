"""The install plan per profile: golden dry-run output, order, environment, device detection."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.forks import manifest as manifest_mod
from tools.forks import sources
from tools.install import cli
from tools.install import plan as plan_mod
from tools.install.plan import Context, build_plan, render

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
ARCH = {"npu": "aarch64", "cuda": "x86_64", "cpu": "x86_64"}
WHEEL_CACHE = Path("/wheel-cache")


def real_context(device: str, **kw) -> Context:
    return Context(root=ROOT, manifest=manifest_mod.load(ROOT), device=device, venv=ROOT / ".venv",
                   installer=kw.pop("installer", "uv"), arch=kw.pop("arch", ARCH[device]),
                   wheel_cache=kw.pop("wheel_cache", WHEEL_CACHE), jobs=kw.pop("jobs", 2), **kw)


def rendered(device: str, **kw) -> str:
    """The dry run with what varies by machine or series written as placeholders: the repository, the
    download cache and the wheel key (a digest of the vllm series, which changes with every patch)."""
    ctx = real_context(device, **kw)
    steps = build_plan(ctx)
    text = render(ctx, steps).replace(str(ROOT), "<root>").replace(str(sources.cache_dir()), "<dists>")
    for step in steps:
        if step.wheel:
            text = text.replace(step.wheel.key, "<key>")
    return text


@pytest.mark.parametrize("name, device, kw", [
    ("npu", "npu", {}), ("cuda", "cuda", {}), ("cpu", "cpu", {}),
    # as root with apt-get on a host whose C compiler lacks numa.h (what the CLI decides, tests/install/test_system.py)
    ("cpu-apt-numa", "cpu", {"apt_packages": ("libnuma-dev",)}),
])
def test_dry_run_matches_golden(name, device, kw):
    text = rendered(device, **kw)
    golden = GOLDEN / f"{name}.txt"
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
    assert [c[-1] for c in steps["torch"].commands] == ["torch==2.7.1", "torch_npu==2.7.1"]


def test_npu_on_x86_takes_the_cpu_build_of_torch():
    steps = {s.name: s for s in build_plan(real_context("npu", arch="x86_64"))}
    first = steps["torch"].commands[0]
    assert "torch==2.7.1+cpu" in first and "https://download.pytorch.org/whl/cpu" in first


def _steps(device: str, **kw) -> dict:
    return {s.name: s for s in build_plan(real_context(device, **kw))}


def _vllm_version() -> str:
    """The release the vllm fork is pinned at (its ref in forks.toml), which its builds tell setuptools-scm."""
    return manifest_mod.load(ROOT).forks["vllm"].ref.removeprefix("v")


def test_cpu_builds_vllm_cpu_kernels_into_a_cached_wheel():
    vllm = _steps("cpu")["vllm"]
    assert vllm.kind == "wheel" and vllm.wheel is not None
    assert {k: vllm.env[k] for k in ("VLLM_TARGET_DEVICE", "VLLM_CPU_DISABLE_AVX512", "SETUPTOOLS_SCM_PRETEND_VERSION",
                                     "MAX_JOBS")} == {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_DISABLE_AVX512": "true",
                                                      "SETUPTOOLS_SCM_PRETEND_VERSION": _vllm_version(),
                                                      "MAX_JOBS": "2"}
    assert vllm.env["PATH"].startswith(str(ROOT / ".venv/bin") + ":"), "CMake >= 3.26 from the venv comes first"
    build, install = vllm.commands
    assert build[-7:-1] == ("pip", "wheel", "--no-build-isolation", "--no-deps", "--wheel-dir", str(vllm.wheel.folder))
    assert build[-1] == str(ROOT / "third_party/vllm")
    assert vllm.wheel.folder.parent == WHEEL_CACHE
    assert "-e" not in install and install[-1] == "vllm" and "--no-index" in install
    assert install[install.index("--find-links") + 1] == str(vllm.wheel.folder)
    assert "--reinstall-package" in install, "a rebuilt wheel of the same version must replace the installed one"
    assert [(h.name, h.apt) for h in vllm.wheel.headers] == [("numa.h", "libnuma-dev")]
    assert "--force-reinstall" in _steps("cpu", installer="pip")["vllm"].commands[1]


def test_the_wheel_key_follows_what_decides_the_wheel_and_nothing_else(tmp_path):
    key = _steps("cpu")["vllm"].wheel.key
    assert _steps("cpu", jobs=16, wheel_cache=tmp_path)["vllm"].wheel.key == key, "MAX_JOBS and the cache: no"
    assert _steps("cpu", arch="aarch64")["vllm"].wheel.key != key
    other_torch = manifest_mod.load(ROOT)
    other_torch.stack["cpu"] = {**other_torch.stack["cpu"], "torch": "2.14.0"}
    ctx = Context(root=ROOT, manifest=other_torch, device="cpu", venv=ROOT / ".venv", installer="uv",
                  arch="x86_64", wheel_cache=WHEEL_CACHE)
    assert next(s for s in build_plan(ctx) if s.name == "vllm").wheel.key != key
    vllm = manifest_mod.load(ROOT).forks["vllm"]
    flags = plan_mod.vllm_cpu_wheel(real_context("cpu"), vllm)
    assert flags.key == key
    from dataclasses import replace

    assert replace(flags, flags={**flags.flags, "VLLM_CPU_DISABLE_AVX512": "false"}).key != key
    assert replace(flags, key_parts=(vllm.commit, "another series digest", *flags.key_parts[2:])).key != key


def test_jobs_sets_max_jobs_of_the_kernel_builds_and_refuses_zero(capsys):
    ctx = cli.context(cli.parser().parse_args(["--root", str(ROOT), "--device", "cpu", "--jobs", "1"]))
    vllm = next(s for s in build_plan(ctx) if s.name == "vllm")
    assert vllm.env["MAX_JOBS"] == "1"
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--jobs", "0"])
    assert "argument --jobs: '0': a whole number of jobs, 1 or more" in capsys.readouterr().err


def test_npu_keeps_vllm_editable_without_kernels():
    vllm = _steps("npu")["vllm"]
    assert vllm.kind == "shell" and "-e" in vllm.commands[0]
    assert vllm.env == {"SETUPTOOLS_SCM_PRETEND_VERSION": _vllm_version(), "VLLM_TARGET_DEVICE": "empty"}


def test_cuda_takes_vllm_kernels_from_the_pypi_wheel_of_the_pin():
    order = _order("cuda")
    assert order.index("vllm-kernels") == order.index("vllm") - 1
    steps = _steps("cuda")
    fetch, vllm = steps["vllm-kernels"], steps["vllm"]
    assert fetch.kind == "fetch" and fetch.fetch.file.endswith("-cp38-abi3-manylinux1_x86_64.whl")
    assert len(fetch.fetch.sha256) == 64
    assert fetch.fetch.version == manifest_mod.load(ROOT).forks["vllm"].pypi.version, "kernels of another release"
    assert vllm.env["VLLM_USE_PRECOMPILED"] == "1"
    assert vllm.env["VLLM_PRECOMPILED_WHEEL_LOCATION"] == str(sources.cache_dir() / fetch.fetch.file)
    assert "PyPI" in fetch.title and "wheelhouse" in _steps("cuda", wheelhouse=Path("/wh"))["vllm-kernels"].title


def test_cuda_builds_transformer_engine_torch_against_the_installed_torch():
    order = _order("cuda")
    assert order.index("torch") < order.index("transformer-engine") < order.index("requirements")
    te = _steps("cuda")["transformer-engine"]
    pinned = plan_mod.requirement_pin(real_context("cuda"), "transformer-engine")
    assert pinned == "2.3.0", "the newest TE Megatron-core 0.12 names (requirements/cuda.in says why, with torch 2.8)"
    assert te.commands[0][-1] == f"transformer_engine_torch=={pinned}"
    assert "--no-build-isolation" in te.commands[0] and "--no-deps" in te.commands[0]
    assert "transformer-engine" not in _order("cpu") and "transformer-engine" not in _order("npu")


def test_requirement_pin_reads_included_files(tmp_path):
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements/common.in").write_text("Transformer_Engine [pytorch] == 9.1  # why\n")
    (tmp_path / "requirements/cuda.in").write_text("-r common.in\ntransformer-engine-cu12==1.0\n")
    ctx = Context(root=tmp_path, manifest=manifest_mod.load(ROOT), device="cuda", venv=tmp_path / "v",
                  installer="uv", arch="x86_64")
    assert plan_mod.requirement_pin(ctx, "transformer-engine") == "9.1"
    assert plan_mod.requirement_pin(ctx, "transformer-engine-cu12") == "1.0"
    assert plan_mod.requirement_pin(ctx, "numba") is None


def test_cpu_and_cuda_leave_out_the_ascend_forks():
    for device in ("cpu", "cuda"):
        order = _order(device)
        assert not {"mindspeed", "mindspeed-llm", "vllm-ascend"} & set(order)
        assert order.index("megatron") < order.index("vllm") < order.index("verl")
    cpu = {s.name: s for s in build_plan(real_context("cpu"))}
    assert cpu["torch"].commands[0][-1] == "torch==2.13.0"
    assert "-c" in cpu["requirements"].commands[0], "the cpu lock constrains the requirements"


def test_wheelhouse_makes_every_install_offline(tmp_path):
    for device, arch in (("npu", "aarch64"), ("npu", "x86_64"), ("cuda", "x86_64")):
        steps = [s for s in build_plan(real_context(device, arch=arch, wheelhouse=tmp_path)) if s.name != "venv"]
        for cmd in (cmd for step in steps for cmd in step.commands):
            assert "--no-index" in cmd and str(tmp_path) in cmd, cmd
            assert "https://download.pytorch.org/whl/cpu" not in cmd
    # cpu: the vllm wheel comes from the wheel cache (or the wheelhouse, which seeds it), no index either
    for step in build_plan(real_context("cpu", wheelhouse=tmp_path)):
        for cmd in step.commands[1:] if step.kind == "wheel" else step.commands if step.name != "venv" else ():
            assert "--no-index" in cmd, cmd


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
