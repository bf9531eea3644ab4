"""`python -m tools.install`: build the whole stack into one environment (nox -s install calls it)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from tools.forks.manifest import PROFILES, ManifestError, find_root, load
from tools.install import plan as plan_mod
from tools.install import system, wheels
from tools.install import wheelhouse as wheelhouse_mod
from tools.install.run import InstallError, cann_home, execute

DESCRIPTION = """\
Install the stack in order into one virtual environment: preflight, forks (sync + apply), torch,
Megatron, MindSpeed, MindSpeed-LLM, vLLM, vLLM-Ascend, verl, then the pinned requirements; an import
smoke test; <venv>/stack.json with every fork's commit and series and every package version.

Each step is skipped when its inputs (fork pin, series, profile, requirements, the steps before it)
have not changed, so a rerun is a no-op and a failed run resumes at the failed step.

  python -m tools.install --device cpu
  python -m tools.install --device npu --dry-run
  python -m tools.install wheelhouse --device npu --dest wheels/ --platform manylinux_2_28_aarch64
  python -m tools.install --device npu --wheelhouse wheels/      # no network at all

The cpu profile compiles vLLM's CPU kernels from the patched fork (about 5 minutes on 2 cores). The
build includes numa.h: when the C compiler cannot find it, a `system` step installs libnuma-dev with
apt-get if the install runs as root, else the preflight stops with the command to run. The wheel
is kept in a cache outside the venv, keyed by the vLLM pin, its series digest, torch, Python and
the build flags, so another venv or a fresh clone on the same machine installs it in seconds (and
needs no numa.h): --wheel-cache DIR, else $RL_RECIPE_WHEEL_CACHE, else ~/.cache/rl-recipe/wheels.
Deleting that folder only costs a rebuild.

Exit codes: 0 ok, 2 a step failed (the message names it and its log).
"""


def detect_device(env: dict[str, str] | None = None) -> tuple[str, str]:
    """(profile, why): npu when torch_npu or a CANN toolkit is present, cuda with nvidia-smi, else cpu."""
    env = dict(os.environ if env is None else env)
    if importlib.util.find_spec("torch_npu") is not None:
        return "npu", "torch_npu is importable"
    home = cann_home(env)
    if home:
        return "npu", f"CANN toolkit at {home}"
    if shutil.which("nvidia-smi"):
        return "cuda", "nvidia-smi found"
    return "cpu", "no torch_npu, CANN toolkit or nvidia-smi found"


def pip_index_options(env: dict[str, str] | None = None) -> tuple[str, ...]:
    """pip's own index settings (config files and PIP_* variables) as uv flags, so both see one source."""
    env = dict(os.environ if env is None else env)
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    config: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        config[key.split(".", 1)[-1]] = value.strip().strip("'\"")
    for key in ("index-url", "extra-index-url", "find-links", "no-index"):
        env_value = env.get("PIP_" + key.upper().replace("-", "_"))
        if env_value:
            config[key] = env_value
    options: list[str] = []
    if config.get("no-index", "").lower() in ("1", "true", "yes"):
        options.append("--no-index")
    if config.get("index-url"):
        options += ["--index-url", config["index-url"]]
    extras = config.get("extra-index-url", "").split()
    for url in extras:
        options += ["--extra-index-url", url]
    for link in config.get("find-links", "").split():
        options += ["--find-links", link]
    if extras:
        options += ["--index-strategy", "unsafe-best-match"]  # pip's rule: best version over all indexes
    return tuple(options)


LOCK_HEADER = """\
# Exact versions of the {device} profile's requirements (requirements/{device}.in), taken from an
# installed environment that passed the tests (pip freeze --exclude-editable), without torch,
# which the torch step pins. Regenerate after changing {device}.in: nox -s lock -- --device {device}
"""


def write_lock(ctx: plan_mod.Context) -> Path:
    """requirements/<device>.lock from what is installed in the environment (forks and torch left out;
    a fork installed from its built wheel, like the cpu profile's vLLM, is not editable, hence by name)."""
    proc = subprocess.run([ctx.venv_python, "-m", "pip", "freeze", "--exclude-editable"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise InstallError(f"lock: cannot read {ctx.venv}: {proc.stderr.strip()[-300:]}; install first")
    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
    left_out = {norm(n) for n in ("torch", "torch-npu")} | {norm(f.distribution) for f in ctx.manifest.forks.values()}
    pins = sorted((line for line in proc.stdout.splitlines()
                   if "==" in line and norm(line.split("==")[0].split(" @ ")[0].strip()) not in left_out),
                  key=str.lower)
    path = ctx.root / "requirements" / f"{ctx.device}.lock"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(LOCK_HEADER.format(device=ctx.device) + "\n".join(pins) + "\n")
    os.replace(tmp, path)
    return path


def _jobs(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of jobs, 1 or more")
    return int(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.install", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", default="install", choices=("install", "wheelhouse", "lock"),
                   help="install (default); wheelhouse: fill --dest for offline installs; lock: write"
                        " requirements/<device>.lock from the installed environment")
    p.add_argument("--device", choices=PROFILES, help="device profile (default: detected, and printed)")
    p.add_argument("--venv", type=Path, default=Path(".venv"), help="target environment (default: .venv)")
    p.add_argument("--python", default="python3.11", help="interpreter to make the environment from")
    p.add_argument("--installer", choices=("auto", "uv", "pip"), default="auto",
                   help="uv when it is on PATH (auto), else pip; torch always goes through pip")
    p.add_argument("--arch", default=platform.machine(), help="target CPU architecture (for the npu torch)")
    p.add_argument("--wheelhouse", type=Path, help="install: every package from this folder, no network")
    p.add_argument("--dest", type=Path, help="wheelhouse: folder to fill")
    p.add_argument("--platform", help="wheelhouse: target platform tag, e.g. manylinux_2_28_aarch64")
    p.add_argument("--python-version", default=None, help="wheelhouse: target Python (default: the stack's)")
    p.add_argument("--wheel-cache", type=Path,
                   help="where built fork wheels are kept across venvs and clones (default: $RL_RECIPE_WHEEL_CACHE,"
                        " else ~/.cache/rl-recipe/wheels)")
    p.add_argument("--jobs", type=_jobs, default=os.cpu_count() or 1,
                   help="parallel compile jobs of the kernel builds, their MAX_JOBS (default: every core, here"
                        " %(default)s); fewer leaves cores and memory to other work. The wheel is the same")
    p.add_argument("--force", action="store_true", help="run every step even when its stamp is current")
    p.add_argument("--dry-run", action="store_true", help="print the plan with commands and environment")
    p.add_argument("--root", type=Path, help="repository root (default: found above the current directory)")
    return p


def context(args) -> plan_mod.Context:
    root = (args.root or find_root(Path.cwd())).resolve()
    manifest = load(root)
    if args.device:
        device, why = args.device, "--device"
    else:
        device, why = detect_device()
    print(f"device profile: {device} ({why})")
    installer = args.installer if args.installer != "auto" else ("uv" if shutil.which("uv") else "pip")
    venv = args.venv if args.venv.is_absolute() else root / args.venv
    return plan_mod.Context(
        root=root,
        manifest=manifest,
        device=device,
        venv=venv,
        installer=installer,
        arch=args.arch,
        python=args.python,
        wheelhouse=args.wheelhouse.resolve() if args.wheelhouse else None,
        index_options=pip_index_options() if installer == "uv" and not args.dry_run else (),
        cann_present=cann_home(dict(os.environ)) is not None,
        wheel_cache=args.wheel_cache.expanduser().resolve() if args.wheel_cache else wheels.default_cache(),
        jobs=args.jobs,
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        ctx = context(args)
        if args.command == "wheelhouse":
            if not args.dest:
                raise InstallError("wheelhouse needs --dest DIR (the folder to fill)")
            wh = wheelhouse_mod.Target(args.dest.resolve(), args.platform,
                                       args.python_version or ctx.manifest.stack[ctx.device].get("python", "3.11"))
            commands = wheelhouse_mod.plan(replace(ctx, wheelhouse=None), wh)
            if args.dry_run:
                print("\n".join(f"$ {shlex.join(c)}" for c in commands))
                return 0
            wheelhouse_mod.build(replace(ctx, wheelhouse=None), wh, commands)
            return 0
        if args.command == "lock":
            print(f"wrote {write_lock(ctx)}")
            return 0
        # headers a build lacks: the system step apt-gets them where it may (root, apt-get), else the
        # preflight stops with the command to run
        ctx = replace(ctx, apt_packages=system.apt_packages(plan_mod.wheel_builds(ctx), ctx.wheelhouse))
        steps = plan_mod.build_plan(ctx)
        if args.dry_run:
            print(plan_mod.render(ctx, steps), end="")
            return 0
        execute(ctx, steps, force=args.force)
        print(f"installed: {ctx.venv} (stack.json there)")
        return 0
    except (InstallError, ManifestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
