"""The install plan: an ordered list of steps per device profile, built by pure functions.

Nothing here runs anything; `tools.install.run` executes a plan, and `--dry-run` prints it. The
order is the one the stack needs: torch before everything built against it, Megatron before
MindSpeed before MindSpeed-LLM, vLLM before vLLM-Ascend, verl last of the forks, then the pinned
requirements that meet in one place (requirements/<profile>.in + .lock).
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tools.forks.manifest import Fork, Manifest

# The builds run without isolation (the build must see the installed torch, and pip must not fetch
# a CUDA torch for vLLM's build-system table); these are the tools those builds import.
BUILD_TOOLS = ("setuptools>=77.0.3,<80", "setuptools-scm>=8", "wheel", "packaging>=24.2", "pybind11",
               "jinja2", "ninja", "cmake>=3.26")
# Socket version string of the Atlas A3 (vLLM-Ascend's custom kernels are built for it); upstream's
# Dockerfile.a3 uses the same value. The default in vLLM-Ascend 0.9.1 is the A2's ASCEND910B1.
A3_SOC_VERSION = "ascend910_9391"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
MIN_FREE_GIB = {"npu": 30, "cuda": 30, "cpu": 10}


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    kind: str = "shell"  # shell | preflight | forks | smoke
    commands: tuple[tuple[str, ...], ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()  # what else decides whether the step must run again
    note: str = ""

    def stamp(self) -> str:
        h = hashlib.sha256()
        for part in (self.name, self.kind, repr(self.commands), repr(sorted(self.env.items())), *self.inputs):
            h.update(part.encode() + b"\0")
        return h.hexdigest()


@dataclass(frozen=True)
class Context:
    """Everything a plan depends on; tests build one by hand."""

    root: Path
    manifest: Manifest
    device: str  # npu | cuda | cpu
    venv: Path
    installer: str  # uv | pip
    arch: str  # x86_64 | aarch64
    python: str = "python3.11"  # interpreter the venv is made from
    wheelhouse: Path | None = None
    index_options: tuple[str, ...] = ()  # pip's find-links / index settings, passed on to uv
    cann_present: bool = False
    build_tools: tuple[str, ...] = BUILD_TOOLS

    @property
    def venv_python(self) -> str:
        return str(self.venv / "bin" / "python")


def fork_inputs(ctx: Context, fork: Fork) -> tuple[str, ...]:
    """Stamp inputs of a fork step: the pin and the series on disk (apply makes the branch from
    exactly these, so they are known before the forks step runs)."""
    from tools.forks.series import Series

    return (fork.commit, Series(ctx.root / fork.patches).digest())


def _install(ctx: Context, *args: str, build: bool = True) -> tuple[str, ...]:
    """An install command into the target venv, with the chosen installer and package source."""
    if ctx.installer == "uv":
        cmd = ("uv", "pip", "install", "--python", ctx.venv_python)
    else:
        cmd = (ctx.venv_python, "-m", "pip", "install")
    if ctx.wheelhouse:
        cmd += ("--no-index", "--find-links", str(ctx.wheelhouse))
    elif ctx.installer == "uv":
        cmd += ctx.index_options
    if build:
        cmd += ("--no-build-isolation",)
    return cmd + args


def _editable(ctx: Context, fork: Fork, env: dict[str, str] | None = None, note: str = "") -> Step:
    return Step(
        name=fork.name,
        title=f"{fork.name} ({fork.distribution}), editable from {fork.path}",
        commands=(_install(ctx, "--no-deps", "-e", str(ctx.root / fork.path)),),
        env=env or {},
        inputs=fork_inputs(ctx, fork),
        note=note,
    )


def _version(fork: Fork) -> str:
    """The release version of a fork's pin, for builds that ask setuptools-scm (v0.9.1 -> 0.9.1)."""
    return fork.pypi.version if fork.pypi else fork.ref.lstrip("v")


def torch_requirements(ctx: Context) -> list[str]:
    stack = ctx.manifest.stack.get(ctx.device, {})
    torch = stack["torch"]
    if ctx.device != "npu":
        return [f"torch=={torch}"]
    # torch_npu requires torch's CPU build, which PyPI carries only for aarch64 (A3 hosts are aarch64).
    return [f"torch=={torch}+cpu" if ctx.arch == "x86_64" else f"torch=={torch}", f"torch_npu=={stack['torch_npu']}"]


def requirement_args(ctx: Context) -> list[str]:
    """-r <profile>.in, plus -c <profile>.lock when the profile has a lock."""
    base = ctx.root / "requirements" / ctx.device
    lock = base.with_suffix(".lock")
    return ["-r", str(base.with_suffix(".in"))] + (["-c", str(lock)] if lock.is_file() else [])


def torch_step(ctx: Context) -> Step:
    # torch is installed with pip, which knows this machine's own indexes and wheel folders.
    pip = (ctx.venv_python, "-m", "pip", "install")
    if ctx.wheelhouse:
        pip += ("--no-index", "--find-links", str(ctx.wheelhouse))
    specs = torch_requirements(ctx)
    cmds = tuple((*pip, spec, *(("--index-url", PYTORCH_CPU_INDEX) if "+cpu" in spec and not ctx.wheelhouse else ()))
                 for spec in specs)
    notes = {
        "npu": "apex: not installed. MindSpeed registers its own fused optimizer, LayerNorm and"
               " multi_tensor_apply under apex's names (features_manager/megatron_basic).",
        "cpu": "the CPU build of torch (a plain `torch` would pull a CUDA build of several GB)",
    }
    return Step("torch", " + ".join(specs), commands=cmds, note=notes.get(ctx.device, ""))


def venv_command(ctx: Context, path: Path) -> tuple[str, ...]:
    """A fresh environment with pip, setuptools and wheel (what builds without isolation need)."""
    if ctx.installer == "uv":
        return ("uv", "venv", "--seed", "--clear", "--python", ctx.python, str(path))
    return (ctx.python, "-m", "venv", "--clear", str(path))


def build_plan(ctx: Context) -> list[Step]:
    forks = {f.name: f for f in ctx.manifest.select(profile=ctx.device)}
    stack = ctx.manifest.stack.get(ctx.device, {})
    checks = [f"Python {stack.get('python', '3.11')} ({ctx.python})"]
    if ctx.device == "npu":
        checks.append(f"CANN {stack.get('cann')} with its set_env.sh sourced (ASCEND_TOOLKIT_HOME set)")
    checks.append(f"{MIN_FREE_GIB[ctx.device]} GiB free for {ctx.venv}")
    sources = [f"{f.name} (git, else {f.pypi.requirement})" if f.pypi else f"{f.name} (git only)"
               for f in forks.values()]
    steps = [
        Step("preflight", "Python, device toolkit and disk", kind="preflight", note="checks " + "; ".join(checks)),
        Step("forks", f"forks for {ctx.device}: sync (git, else PyPI) and apply the series",
             kind="forks", inputs=tuple(x for f in forks.values() for x in fork_inputs(ctx, f)),
             note=f"as `python -m tools.forks sync --profile {ctx.device}` then `apply`: " + ", ".join(sources)),
        Step("venv", f"virtual environment {ctx.venv}", commands=(venv_command(ctx, ctx.venv),),
             inputs=(ctx.python,)),
        Step("build-tools", "what the fork builds import (no build isolation)",
             commands=(_install(ctx, *ctx.build_tools, build=False),) if ctx.build_tools else ()),
        torch_step(ctx),
    ]
    if "megatron" in forks:
        steps.append(_editable(ctx, forks["megatron"]))
    if "mindspeed" in forks:
        steps.append(_editable(ctx, forks["mindspeed"]))
    if "mindspeed-llm" in forks:
        steps.append(_editable(ctx, forks["mindspeed-llm"]))
    if "vllm" in forks:
        env = {"SETUPTOOLS_SCM_PRETEND_VERSION": _version(forks["vllm"])}
        if ctx.device in ("npu", "cpu"):
            env["VLLM_TARGET_DEVICE"] = "empty"  # never compile vLLM's CPU or CUDA kernels here
        else:
            env["VLLM_USE_PRECOMPILED"] = "1"  # our series touches Python only: reuse upstream kernels
        steps.append(_editable(ctx, forks["vllm"], env))
    if "vllm-ascend" in forks:
        env = {
            "SETUPTOOLS_SCM_PRETEND_VERSION": _version(forks["vllm-ascend"]),
            "COMPILE_CUSTOM_KERNELS": "1" if ctx.cann_present or ctx.device == "npu" else "0",
            "SOC_VERSION": A3_SOC_VERSION,
        }
        steps.append(_editable(ctx, forks["vllm-ascend"], env))
    if "verl" in forks:
        steps.append(_editable(ctx, forks["verl"]))
    req = requirement_args(ctx)
    files = [Path(a) for a in req if not a.startswith("-")]
    steps.append(Step("requirements", "pinned requirements (" + " + ".join(f.name for f in files) + ")",
                      commands=(_install(ctx, *req, build=False),),
                      inputs=tuple(_digest(p) for f in files for p in requirement_files(f))))
    steps.append(Step("smoke", "import every installed fork; write stack.json", kind="smoke",
                      inputs=tuple(s.stamp() for s in steps)))
    return steps


def requirement_files(path: Path) -> list[Path]:
    """A requirements file and every file it includes with -r or -c, recursively."""
    found = [path]
    if path.is_file():
        for line in path.read_text().splitlines():
            parts = line.split("#", 1)[0].split()
            if len(parts) == 2 and parts[0] in ("-r", "-c", "--requirement", "--constraint"):
                found += requirement_files(path.parent / parts[1])
    return found


def _digest(path: Path) -> str:
    if not path.is_file():
        return f"missing:{path}"
    return hashlib.sha256(path.read_bytes()).hexdigest()


def render(ctx: Context, steps: list[Step]) -> str:
    """The plan as text: what --dry-run prints and the golden files hold."""
    lines = [f"plan for {ctx.device} (arch {ctx.arch}, installer {ctx.installer}) into {ctx.venv}"]
    if ctx.wheelhouse:
        lines.append(f"offline: every package from {ctx.wheelhouse}")
    for i, step in enumerate(steps, 1):
        lines.append(f"[{i}/{len(steps)}] {step.name}: {step.title}")
        for key, value in sorted(step.env.items()):
            lines.append(f"    env {key}={value}")
        for cmd in step.commands:
            lines.append(f"    $ {shlex.join(cmd)}")
        if step.note:
            lines.append(f"    note: {step.note}")
    return "\n".join(lines) + "\n"
