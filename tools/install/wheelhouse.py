"""A wheelhouse: everything `install` needs for one profile and platform, in one folder.

For air-gapped clusters: fill it where the network is, copy it with the repository, then
`python -m tools.install --device npu --wheelhouse DIR` installs with no network at all. It holds
the wheels of every requirement, the pinned fork distributions (so `tools.forks sync` works from it)
and wheels built from the patched forks (to install the stack without this repository).

The fork wheels are built in a throwaway environment that has the build tools and the profile's
torch (vLLM's and Transformer Engine's setup.py import torch). The cpu profile's vLLM wheel is the
CPU-kernel build, taken from the wheel cache (built there first when missing); wheelhouse.json
records its key, so `install --wheelhouse` on another machine installs that wheel instead of
compiling. For cuda the wheelhouse also holds the PyPI vLLM wheel whose kernels the vllm step uses.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from tools.forks import sources
from tools.install import plan as plan_mod
from tools.install import wheels
from tools.install.plan import (
    PYTORCH_CPU_INDEX,
    Context,
    Step,
    build_plan,
    requirement_args,
    torch_requirements,
    venv_command,
)
from tools.install.run import InstallError, fetch, sync_and_apply


@dataclass(frozen=True)
class Target:
    dest: Path
    platform: str | None  # None: this machine's platform (sdists are built into wheels here)
    python_version: str

    def cross(self) -> bool:
        return self.platform is not None and platform.machine() not in self.platform


def _requirements(ctx: Context) -> list[str]:
    """What the install plan takes from an index: build tools, torch, the profile's requirements."""
    return [*ctx.build_tools, *torch_requirements(ctx), *requirement_args(ctx)]


def build_env(target: Target) -> Path:
    """A throwaway environment whose pip fills the wheelhouse and builds the fork wheels."""
    return target.dest / ".build-env"


def plan(ctx: Context, target: Target) -> list[tuple[str, ...]]:
    """The commands that fill the wheelhouse (what --dry-run prints)."""
    env_python = str(build_env(target) / "bin" / "python")
    pip = (env_python, "-m", "pip")
    dest = str(target.dest)
    reqs = _requirements(ctx)
    extra = ("--extra-index-url", PYTORCH_CPU_INDEX) if any("+cpu" in r for r in reqs) else ()
    cmds: list[tuple[str, ...]] = [venv_command(ctx, build_env(target))]
    if ctx.build_tools:  # the fork builds below run without isolation, in the build environment
        cmds.append((*pip, "install", *ctx.build_tools))
    # The profile's torch for this machine (the fork builds import it), whatever the target platform.
    host_torch = torch_requirements(replace(ctx, arch=platform.machine()))
    cmds.append((*pip, "install", *(("--extra-index-url", PYTORCH_CPU_INDEX) if any("+cpu" in r for r in host_torch)
                                    else ()), *host_torch))
    steps = {s.name: s for s in build_plan(ctx)}
    te = steps.get("transformer-engine")
    if te and not target.cross():  # an sdist that compiles against torch: built here, then found by the next one
        cmds.append((*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", dest, te.commands[0][-1]))
    if target.cross():
        cmds.append((*pip, "download", "--dest", dest, "--only-binary=:all:", "--platform", target.platform,
                     "--python-version", target.python_version, "--implementation", "cp", *extra, *reqs))
    else:
        cmds.append((*pip, "wheel", "--wheel-dir", dest, "--find-links", dest, *extra, *reqs))
    for fork in ctx.manifest.select(profile=ctx.device):
        step = steps.get(fork.name)
        if target.cross() and (fork.name in ("megatron", "vllm-ascend") or (step and step.wheel)):
            continue  # compiled parts: build those wheels on the target platform
        if step and step.wheel:  # built once into the wheel cache, by the build environment's python
            cmds.append(plan_mod.wheel_command(env_python, step.wheel))
            continue
        cmds.append((*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", dest,
                     str(ctx.root / fork.path)))
    return cmds


def build(ctx: Context, target: Target, commands: list[tuple[str, ...]]) -> Path:
    target.dest.mkdir(parents=True, exist_ok=True)
    sync_and_apply(ctx, print, "forks")  # the fork wheels are built from the patched trees
    steps = build_plan(ctx)
    for step in steps:  # files the fork builds read (cuda: the vLLM wheel with the kernels), kept in DEST too
        if step.kind == "fetch":
            shutil.copy(fetch(ctx, step, print, step.name), target.dest / step.fetch.file)
    bin_dir = build_env(target) / "bin"
    env_by_fork = {str(ctx.root / f.path): _fork_env(steps, f.name, bin_dir)
                   for f in ctx.manifest.select(profile=ctx.device)}
    cached = {str(s.wheel.folder): s for s in steps if s.wheel}
    built: dict[str, str] = {}
    # The build environment comes first on PATH, as if activated: Megatron's setup.py runs
    # `python3 -m pybind11`, vLLM's build needs CMake >= 3.26 (uv does this for the install steps).
    activated = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    for cmd in commands:
        env = {**activated, **env_by_fork.get(cmd[-1], {})}
        folder = cmd[cmd.index("--wheel-dir") + 1] if "--wheel-dir" in cmd else None
        if folder in cached:
            wheel = _cached_wheel(cached[folder], cmd, env, target)
            shutil.copy(wheel, target.dest / wheel.name)
            built[cached[folder].wheel.key] = wheel.name
            continue
        print(f"$ {' '.join(cmd)}")
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0:
            raise InstallError(f"wheelhouse: `{' '.join(cmd[:6])} ...` failed (exit {proc.returncode}); see above")
    shutil.rmtree(build_env(target))
    find_links = [Path(p) for p in os.environ.get("PIP_FIND_LINKS", "").split()]
    for fork in ctx.manifest.select(profile=ctx.device):
        if fork.pypi:  # the pinned distribution, so `tools.forks sync --find-links DEST` works offline
            index = os.environ.get("PIP_INDEX_URL") or sources.DEFAULT_INDEX
            location = sources.find_distribution(fork, [index], find_links)
            shutil.copy(sources.download(fork, location), target.dest / fork.pypi.file)
    return write_manifest(ctx, target, built)


def _cached_wheel(step: Step, cmd: tuple[str, ...], env: dict[str, str], target: Target) -> Path:
    build = step.wheel
    assert build is not None
    wheel = wheels.cached(build)
    if wheel:
        print(f"{step.name}: {wheel.name} from the wheel cache ({build.folder}), not built")
        return wheel
    print(f"{step.name}: building {build.name}'s wheel from {build.source} ({build.duration or 'minutes'});"
          f" then cached in {build.folder}\n$ {' '.join(cmd)}")
    try:
        return wheels.build_wheel(build, cmd, env, target.dest / ".build-logs" / f"{step.name}.log")
    except wheels.WheelError as exc:
        raise InstallError(f"wheelhouse: {exc}") from None


def _fork_env(steps: list[Step], name: str, bin_dir: Path) -> dict[str, str]:
    """A fork's build environment from its install step; PATH leads to the build environment's tools."""
    step = next((s for s in steps if s.name == name), None)
    env = dict(step.env) if step else {}
    if "PATH" in env:
        env["PATH"] = f"{bin_dir}:{os.environ.get('PATH', '')}"
    return env


def write_manifest(ctx: Context, target: Target, built: dict[str, str] | None = None) -> Path:
    files = {}
    for path in sorted(target.dest.iterdir()):
        if path.is_file() and path.name != "wheelhouse.json":
            files[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    record = {"profile": ctx.device, "platform": target.platform or "host", "python": target.python_version,
              "files": files, "built": built or {}}
    out = target.dest / "wheelhouse.json"
    out.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return out
