"""The install plan: an ordered list of steps per device profile, built by pure functions.

Nothing here runs anything; `tools.install.run` executes a plan, and `--dry-run` prints it. The
order is the one the stack needs: torch before everything built against it, Megatron before
MindSpeed before MindSpeed-LLM, vLLM before vLLM-Ascend, verl last of the forks, then the pinned
requirements that meet in one place (requirements/<profile>.in + .lock).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tools.forks.manifest import Fork, Manifest, PyPISource
from tools.install import system
from tools.install.wheels import WheelBuild, default_cache

# The builds run without isolation (the build must see the installed torch, and pip must not fetch
# a CUDA torch for vLLM's build-system table); these are the tools those builds import.
BUILD_TOOLS = ("setuptools>=77.0.3,<80", "setuptools-scm>=8", "wheel", "packaging>=24.2", "pybind11",
               "jinja2", "ninja", "cmake>=3.26")
# SoC version of the Atlas A3, the target vLLM-Ascend's Ascend C kernels are compiled for (its CMake passes
# SOC_VERSION to CANN's ascendc). vLLM-Ascend 0.11.0 defaults to the A2's ASCEND910B1 ("available for A2 and
# A3") and its Dockerfile.a3 sets none; from 0.12.0rc1 its Dockerfile.a3 sets this value and its setup.py
# reads the same name from npu-smi on an A3 (chip name + NPU name).
A3_SOC_VERSION = "ascend910_9391"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# What a venv of each profile takes at its peak, its builds' scratch included (a cpu venv holds 3.4 GiB);
# what the venv already holds counts towards it, so a rerun with nothing to do needs no more
MIN_FREE_GIB = {"npu": 30, "cuda": 30, "cpu": 10}
# vLLM's CPU kernels, built from the patched fork (cpu profile). The AVX512 path fetches oneDNN from
# GitHub at configure time; the AVX2 path fetches nothing, so it builds where only PyPI is reachable.
# CMake >= 3.26 comes from the build-tools step (Debian 12 has 3.25), hence the venv's bin on PATH.
VLLM_CPU_FLAGS = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_DISABLE_AVX512": "true"}
VLLM_CPU_HEADERS = (system.NUMA,)
VLLM_CPU_BUILD_TIME = "5 to 8 minutes on 2 cores"
# vLLM's CUDA kernels for the cuda profile: the PyPI wheel of the release the fork is pinned at (built
# for torch 2.8.0, the profile's torch). VLLM_USE_PRECOMPILED=1 alone downloads them from
# wheels.vllm.ai by the fork's merge base with upstream main, a host clusters often cannot reach.
VLLM_CUDA_KERNELS = PyPISource(
    requirement="vllm==0.11.0", file="vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl",
    sha256="3861c75ff2b12e24f6d179ff5c084d791b42ded8675d76c8706697c79f68cd62",
    note="only its compiled kernels are used; the Python code is our fork's")


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    kind: str = "shell"  # shell | preflight | system | forks | wheel | fetch | smoke
    commands: tuple[tuple[str, ...], ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    inputs: tuple[str, ...] = ()  # what else decides whether the step must run again
    note: str = ""
    wheel: WheelBuild | None = None  # kind "wheel": commands are (build into the cache, install from it)
    fetch: PyPISource | None = None  # kind "fetch": a sha256-pinned file brought into the download cache

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
    wheel_cache: Path = field(default_factory=default_cache)  # built fork wheels, shared by every venv
    jobs: int = field(default_factory=lambda: os.cpu_count() or 1)  # MAX_JOBS of the kernel builds
    # Debian packages of headers the builds need and the compiler lacks, for the system step; the CLI
    # fills it when the install runs as root with apt-get (tools.install.system decides)
    apt_packages: tuple[str, ...] = ()
    disk_gib: float | None = None  # the venv's size at its peak; None: MIN_FREE_GIB of the device

    @property
    def disk_need_gib(self) -> float:
        return MIN_FREE_GIB[self.device] if self.disk_gib is None else self.disk_gib

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
        title=f"{fork.name} ({fork.distribution}) at {fork.ref}, editable from {fork.path}",
        commands=(_install(ctx, "--no-deps", "-e", str(ctx.root / fork.path)),),
        env=env or {},
        inputs=fork_inputs(ctx, fork),
        note=note,
    )


def _version(fork: Fork) -> str:
    """The release version of a fork's pin, for builds that ask setuptools-scm (v0.9.1 -> 0.9.1)."""
    return fork.pypi.version if fork.pypi else fork.ref.lstrip("v")


def cann_line(version: str) -> str | None:
    """The release line of a CANN version, major.minor: 8.3 for 8.3.RC1, 8.3.RC2 and 8.3.0; None for no version.
    torch_npu and vLLM-Ascend are built for a line (vLLM-Ascend 0.11.0: "CANN >= 8.3.rc1", tested on
    8.3.RC2), so the preflight takes any release of the stack's line and refuses another line."""
    match = re.match(r"([0-9]+)\.([0-9]+)(?:\.|$)", version.strip())
    return f"{match[1]}.{match[2]}" if match else None


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
        want = stack.get("cann", "")
        checks.append(f"CANN {cann_line(want)} ({want}, or another {cann_line(want)} release) with its"
                      " set_env.sh sourced (ASCEND_TOOLKIT_HOME set)")
    checks.append(f"{ctx.disk_need_gib:g} GiB for {ctx.venv}, free or held by it")
    if "vllm" in forks and ctx.device == "cpu":
        checks.append(", ".join(h.name for h in VLLM_CPU_HEADERS) + " for vLLM's CPU kernels, unless cached")
    sources = [f"{f.name} {f.ref} (git, else {f.pypi.requirement})" if f.pypi else f"{f.name} {f.ref} (git only)"
               for f in forks.values()]
    steps = [
        Step("preflight", "Python, device toolkit and disk", kind="preflight", note="checks " + "; ".join(checks)),
        *system_steps(ctx),
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
        steps += vllm_steps(ctx, forks["vllm"])
    if "vllm-ascend" in forks:
        env = {
            "SETUPTOOLS_SCM_PRETEND_VERSION": _version(forks["vllm-ascend"]),
            "COMPILE_CUSTOM_KERNELS": "1" if ctx.cann_present or ctx.device == "npu" else "0",
            "SOC_VERSION": A3_SOC_VERSION,
        }
        steps.append(_editable(ctx, forks["vllm-ascend"], env))
    if "verl" in forks:
        steps.append(_editable(ctx, forks["verl"]))
    te = transformer_engine_step(ctx)
    if te:
        steps.append(te)
    req = requirement_args(ctx)
    files = [Path(a) for a in req if not a.startswith("-")]
    steps.append(Step("requirements", "pinned requirements (" + " + ".join(f.name for f in files) + ")",
                      commands=(_install(ctx, *req, build=False),),
                      inputs=tuple(_digest(p) for f in files for p in requirement_files(f))))
    steps.append(Step("smoke", "import every installed fork; write stack.json", kind="smoke",
                      inputs=tuple(s.stamp() for s in steps if s.kind != "system")))  # it comes and goes
    return steps


def vllm_steps(ctx: Context, fork: Fork) -> list[Step]:
    """npu: Python only (vLLM-Ascend brings the kernels); cuda: upstream's kernels from the PyPI wheel
    of the pinned release; cpu: the CPU kernels compiled from the patched tree, once per wheel key."""
    env = {"SETUPTOOLS_SCM_PRETEND_VERSION": _version(fork)}
    if ctx.device == "npu":
        env["VLLM_TARGET_DEVICE"] = "empty"  # never compile vLLM's CPU or CUDA kernels here
        return [_editable(ctx, fork, env)]
    if ctx.device == "cuda":
        kernels = cuda_kernels_path()
        env.update({"VLLM_USE_PRECOMPILED": "1", "VLLM_PRECOMPILED_WHEEL_LOCATION": str(kernels)})
        fetch = Step("vllm-kernels", f"{VLLM_CUDA_KERNELS.file} ({VLLM_CUDA_KERNELS.requirement} from"
                     f" {'the wheelhouse' if ctx.wheelhouse else 'PyPI'}, sha256-checked)", kind="fetch",
                     fetch=VLLM_CUDA_KERNELS, inputs=(VLLM_CUDA_KERNELS.sha256,),
                     note=f"into {kernels}; our series touches Python only, so the vllm step takes the"
                          " compiled kernels from this wheel instead of wheels.vllm.ai")
        return [fetch, _editable(ctx, fork, env)]
    build = vllm_cpu_wheel(ctx, fork)
    cmd_env = {**build.flags, **env, "MAX_JOBS": str(ctx.jobs), "PATH": f"{ctx.venv / 'bin'}:$PATH"}
    install = ("uv", "pip", "install", "--python", ctx.venv_python) if ctx.installer == "uv" else \
        (ctx.venv_python, "-m", "pip", "install")
    reinstall = ("--reinstall-package", build.name) if ctx.installer == "uv" else ("--force-reinstall",)
    return [Step(
        name=fork.name, kind="wheel", wheel=build, env=cmd_env, inputs=(*fork_inputs(ctx, fork), build.key),
        title=f"{fork.name} ({fork.distribution}) with its CPU kernels: a wheel built from {fork.path},"
              " cached by pin, series and torch",
        commands=(wheel_command(ctx.venv_python, build),
                  (*install, "--no-index", "--find-links", str(build.folder), "--no-deps", *reinstall, build.name)),
        note=f"the wheel cache {ctx.wheel_cache} has it after the first build ({VLLM_CPU_BUILD_TIME}), so"
             f" another venv or clone installs it in seconds; the build needs "
             + ", ".join(f"{h.name} ({h.apt})" for h in build.headers))]


def system_steps(ctx: Context) -> list[Step]:
    """apt-get the packages of missing headers (only when ctx.apt_packages says the install may)."""
    if not ctx.apt_packages:
        return []
    return [Step("system", "Debian packages the builds need: " + ", ".join(ctx.apt_packages), kind="system",
                 commands=system.apt_commands(ctx.apt_packages), env=dict(system.APT_ENV),
                 note="the C compiler lacks their headers and this install runs as root with apt-get;"
                      " runs while it lacks them, never stamped")]


def wheel_builds(ctx: Context) -> list[WheelBuild]:
    """The fork wheels the profile compiles (cpu: vLLM with its CPU kernels), as the wheel steps build them."""
    forks = {f.name: f for f in ctx.manifest.select(profile=ctx.device)}
    return [vllm_cpu_wheel(ctx, forks["vllm"])] if ctx.device == "cpu" and "vllm" in forks else []


def vllm_cpu_wheel(ctx: Context, fork: Fork) -> WheelBuild:
    """What the cpu profile's vLLM wheel is made of, and so its cache key."""
    stack = ctx.manifest.stack.get(ctx.device, {})
    flags = {**VLLM_CPU_FLAGS, "SETUPTOOLS_SCM_PRETEND_VERSION": _version(fork)}
    return WheelBuild(name=fork.distribution, source=ctx.root / fork.path, flags=flags, cache_root=ctx.wheel_cache,
                      key_parts=(*fork_inputs(ctx, fork), f"torch {stack['torch']}",
                                 f"python {stack.get('python', '3.11')}", ctx.arch),
                      headers=VLLM_CPU_HEADERS, duration=VLLM_CPU_BUILD_TIME)


def wheel_command(python: str, build: WheelBuild) -> tuple[str, ...]:
    """Build a fork's wheel into its cache folder (the runner builds into a temporary folder and renames)."""
    return (python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--wheel-dir", str(build.folder),
            str(build.source))


def cuda_kernels_path() -> Path:
    from tools.forks import sources

    return sources.cache_dir() / VLLM_CUDA_KERNELS.file


def requirement_pin(ctx: Context, name: str) -> str | None:
    """The version a profile's requirement files pin `name` at (`name[extras]==V`), or None."""
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731  (PEP 503 names)
    pattern = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*==\s*([^\s;#]+)")
    for path in requirement_files(ctx.root / "requirements" / f"{ctx.device}.in"):
        for line in path.read_text().splitlines() if path.is_file() else []:
            match = pattern.match(line)
            if match and norm(match.group(1)) == norm(name):
                return match.group(3)
    return None


def transformer_engine_step(ctx: Context) -> Step | None:
    """Transformer Engine's torch extension, where the profile's requirements ask for TE: PyPI has it only
    as an sdist that compiles against the installed torch (and the CUDA toolkit), so it is built here
    without isolation; the requirements step then finds it installed and takes the rest as wheels."""
    version = requirement_pin(ctx, "transformer-engine")
    if version is None:
        return None
    return Step("transformer-engine", f"transformer_engine_torch=={version}, built against the installed torch",
                commands=(_install(ctx, "--no-deps", f"transformer_engine_torch=={version}"),),
                env={"NVTE_FRAMEWORK": "pytorch", "MAX_JOBS": str(ctx.jobs)},
                note=f"transformer-engine[pytorch]=={version} in requirements/{ctx.device}.in; its other parts"
                     " (transformer-engine, transformer-engine-cu12) are wheels")


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
        if step.fetch:
            lines.append(f"    fetch {step.fetch.file} sha256={step.fetch.sha256}")
        for cmd in step.commands:
            lines.append(f"    $ {shlex.join(cmd)}")
        if step.note:
            lines.append(f"    note: {step.note}")
    return "\n".join(lines) + "\n"
