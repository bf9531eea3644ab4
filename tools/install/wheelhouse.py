"""A wheelhouse: everything `install` needs for one profile and platform, in one folder.

For air-gapped clusters: fill it where the network is, copy it with the repository, then
`python -m tools.install --device npu --wheelhouse DIR` installs with no network at all. It holds
the wheels of every requirement, the pinned fork distributions (so `tools.forks sync` works from it)
and wheels built from the patched forks (to install the stack without this repository).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tools.forks import sources
from tools.install.plan import (
    PYTORCH_CPU_INDEX,
    Context,
    build_plan,
    requirement_args,
    torch_requirements,
    venv_command,
)
from tools.install.run import InstallError, sync_and_apply


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
    if target.cross():
        cmds.append((*pip, "download", "--dest", dest, "--only-binary=:all:", "--platform", target.platform,
                     "--python-version", target.python_version, "--implementation", "cp", *extra, *reqs))
    else:
        cmds.append((*pip, "wheel", "--wheel-dir", dest, *extra, *reqs))
    for fork in ctx.manifest.select(profile=ctx.device):
        if target.cross() and fork.name in ("megatron", "vllm-ascend"):
            continue  # compiled parts: build those wheels on the target platform
        cmds.append((*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", dest,
                     str(ctx.root / fork.path)))
    return cmds


def build(ctx: Context, target: Target, commands: list[tuple[str, ...]]) -> Path:
    target.dest.mkdir(parents=True, exist_ok=True)
    sync_and_apply(ctx, print, "forks")  # the fork wheels are built from the patched trees
    env_by_fork = {str(ctx.root / f.path): _fork_env(ctx, f.name) for f in ctx.manifest.select(profile=ctx.device)}
    for cmd in commands:
        print(f"$ {' '.join(cmd)}")
        env = {**os.environ, **env_by_fork.get(cmd[-1], {})}
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
    return write_manifest(ctx, target)


def _fork_env(ctx: Context, name: str) -> dict[str, str]:
    step = next((s for s in build_plan(ctx) if s.name == name), None)
    return dict(step.env) if step else {}


def write_manifest(ctx: Context, target: Target) -> Path:
    files = {}
    for path in sorted(target.dest.iterdir()):
        if path.is_file() and path.name != "wheelhouse.json":
            files[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    record = {"profile": ctx.device, "platform": target.platform or "host", "python": target.python_version,
              "files": files}
    out = target.dest / "wheelhouse.json"
    out.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return out
