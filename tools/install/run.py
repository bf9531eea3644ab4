"""Execute an install plan: preflight, forks, then each step unless its stamp says it is done.

A step's stamp chains the stamps of the install steps before it, so a changed torch reinstalls
everything built on it, and a changed vLLM series reinstalls vLLM and what follows, not Megatron.
Each step logs to <venv>/.install/logs/<step>.log; a failed step is named with its log, and the next
run resumes there (the steps before it are stamped).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tools.forks import ops, sources
from tools.install import system, wheels
from tools.install.plan import Context, Step, cann_line, wheel_builds

# Where a toolkit states its version, in order: the install info (`version=8.3.RC2`, in <arch>-linux/ under
# latest/), then version.cfg (`toolkit_running_version=[7.3.0.1.231:8.0.RC2]`: the build number before the
# colon, the CANN version after it).
CANN_VERSION_FILES = ("*/ascend_toolkit_install.info", "ascend_toolkit_install.info", "version.cfg")
CANN_VERSION_LINE = re.compile(r"^\s*(?:version|toolkit_running_version|runtime_running_version)\s*=\s*\[?"
                               r"(?:[0-9.]+:)?([0-9]+\.[0-9]+\.[A-Za-z0-9.]+)", re.MULTILINE)
DEFAULT_CANN = Path("/usr/local/Ascend/ascend-toolkit/latest")


class InstallError(RuntimeError):
    """A step failed; the message names the step, the cause and the fix (and the log, if any)."""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


# ---------------------------------------------------------------- preflight


def cann_home(env: dict[str, str]) -> Path | None:
    for key in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        if env.get(key) and Path(env[key]).is_dir():
            return Path(env[key])
    return DEFAULT_CANN if DEFAULT_CANN.is_dir() else None


def cann_version(home: Path) -> str | None:
    """The toolkit's CANN version (8.3.RC2 and the like) from the first of CANN_VERSION_FILES that states it."""
    for pattern in CANN_VERSION_FILES:
        for path in sorted(home.glob(pattern)):
            match = CANN_VERSION_LINE.search(path.read_text(errors="replace"))
            if match:
                return match.group(1)
    return None


def preflight(ctx: Context, env: dict[str, str] | None = None) -> list[Check]:
    env = dict(os.environ if env is None else env)
    stack = ctx.manifest.stack.get(ctx.device, {})
    checks = [_python_check(ctx.python, stack.get("python", "3.11"))]
    if ctx.device == "npu":
        checks.append(_cann_check(env, stack.get("cann", "")))
    checks.append(_disk_check(ctx.venv, ctx.disk_need_gib))
    checks += _header_checks(ctx, env)
    if ctx.wheelhouse and not ctx.wheelhouse.is_dir():
        checks.append(Check("wheelhouse", False, f"{ctx.wheelhouse} does not exist",
                            "build it with `nox -s wheelhouse -- --device ... --dest DIR` where the network is"))
    return checks


def _python_check(python: str, want: str) -> Check:
    exe = shutil.which(python) or (python if Path(python).is_file() else None)
    if not exe:
        return Check("python", False, f"{python} not found", f"install Python {want} or pass --python PATH")
    got = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True).stdout.strip()
    if got != want:
        return Check("python", False, f"{exe} is Python {got}, the stack needs {want}",
                     f"pass --python pointing at a Python {want}")
    return Check("python", True, f"{exe} (Python {got})")


def _cann_check(env: dict[str, str], want: str) -> Check:
    home = cann_home(env)
    if home is None:
        return Check("CANN", False, "no CANN toolkit (ASCEND_TOOLKIT_HOME unset, none at " f"{DEFAULT_CANN})",
                     f"install CANN {want}, then `source /usr/local/Ascend/ascend-toolkit/set_env.sh`")
    if not env.get("ASCEND_TOOLKIT_HOME"):
        return Check("CANN", False, f"toolkit at {home}, but its environment is not set",
                     f"`source {home.parent / 'set_env.sh'}` in this shell, then rerun")
    got = cann_version(home)
    line = cann_line(want)
    if got is None or cann_line(got) != line:
        return Check("CANN", False, f"toolkit at {home} is {got or 'of unknown version'}, the stack needs CANN {line}"
                     f" ({want}, or another {line} release)",
                     f"install CANN {want} (or point ASCEND_TOOLKIT_HOME at a CANN {line}) and source its set_env.sh")
    return Check("CANN", True, f"{home} ({got}, of the {line} line the stack needs)")


def _header_checks(ctx: Context, env: dict[str, str]) -> list[Check]:
    """One check per header a wheel build to run includes: found, brought by the system step, or missing
    with the one command that brings it."""
    headers = system.headers_to_build(wheel_builds(ctx), ctx.wheelhouse)
    lacking = system.missing(headers, env)
    checks = []
    for header in dict.fromkeys((*headers, *lacking)):  # a missing compiler comes too
        if header not in lacking:
            checks.append(Check(header.what(), True, "found by the C compiler"))
        elif header.apt in ctx.apt_packages:
            checks.append(Check(header.what(), True, f"missing; the system step installs {header.apt}"))
        else:
            checks.append(Check(header.what(), False, "the C compiler cannot find it (the vLLM CPU kernel build"
                                " needs it)", f"run `{system.fix_command([header], env)}`, then rerun"))
    return checks


def _disk_check(venv: Path, need_gib: float) -> Check:
    """Free space plus what the venv holds (a reinstall overwrites it in place) against the profile's need."""
    where = next(p for p in [venv, *venv.parents] if p.exists())
    free = shutil.disk_usage(where).free / 2**30
    held = _size_gib(venv)
    found = f"{free:.1f} GiB free at {where}" + (f" and {held:.1f} GiB in {venv}" if held else "")
    if free + held < need_gib:
        return Check("disk", False, f"{found}, the profile needs {need_gib:g} GiB",
                     "free disk space or pass --venv on a larger disk")
    return Check("disk", True, found)


def _size_gib(folder: Path) -> float:
    if not folder.is_dir():
        return 0.0
    return sum(f.lstat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink()) / 2**30


# ---------------------------------------------------------------- steps


def _stamp_dir(ctx: Context) -> Path:
    return ctx.venv / ".install" / "stamps"


def _log_dir(ctx: Context) -> Path:
    return ctx.venv / ".install" / "logs"


def _done(ctx: Context, step: Step, stamp: str) -> bool:
    path = _stamp_dir(ctx) / step.name
    return path.is_file() and path.read_text() == stamp


def _mark(ctx: Context, step: Step, stamp: str) -> None:
    path = _stamp_dir(ctx) / step.name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(stamp)
    os.replace(tmp, path)


def execute(ctx: Context, steps: list[Step], force: bool = False, say=print) -> dict:
    """Run the plan; returns what each step did ({name: 'ran' | 'skipped'})."""
    outcome: dict[str, str] = {}
    chain = hashlib.sha256()
    for i, step in enumerate(steps, 1):
        if step.kind not in ("preflight", "system", "forks"):  # always run when planned; not in the chain
            chain.update(step.stamp().encode())
        stamp = chain.hexdigest()
        label = f"[{i}/{len(steps)}] {step.name}"
        if step.kind == "preflight":
            _run_preflight(ctx, say, label)
        elif step.kind == "system":  # planned only while a header is missing, so it always runs
            _run_shell(ctx, step, say, label)
        elif step.kind == "forks":
            sync_and_apply(ctx, say, label)
        elif step.kind == "fetch":  # always: the file must be in the cache for the steps that read it
            fetch(ctx, step, say, label)
        elif not force and _done(ctx, step, stamp):
            say(f"{label}: up to date")
            outcome[step.name] = "skipped"
            continue
        elif step.kind == "smoke":
            smoke(ctx, say, label)
        elif step.kind == "wheel":
            _run_wheel(ctx, step, say, label)
        else:
            _run_shell(ctx, step, say, label)
        if step.kind not in ("preflight", "system", "forks", "fetch"):
            _mark(ctx, step, stamp)
        outcome[step.name] = "ran"
    return outcome


def _run_preflight(ctx: Context, say, label: str) -> None:
    checks = preflight(ctx)
    bad = [f"{c.name}: {c.detail}; fix: {c.fix}" for c in checks if not c.ok]
    say(f"{label}: " + "; ".join(f"{c.name} {'ok' if c.ok else 'FAILED'}: {c.detail}" for c in checks))
    if len(bad) == 1:  # one line, the command in it
        raise InstallError(f"preflight failed: {bad[0]}")
    if bad:
        raise InstallError("preflight failed:\n" + "\n".join(f"  {line}" for line in bad))


def sync_and_apply(ctx: Context, say, label: str) -> None:
    """Every fork of the profile at its pin with its series applied (the wheelhouse needs it too)."""
    find_links = [ctx.wheelhouse] if ctx.wheelhouse else []
    indexes = [os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple"]
    reports = []
    for fork in ctx.manifest.select(profile=ctx.device):
        try:
            synced = ops.sync(ctx.root, fork, "auto", False, indexes, find_links)
            applied = ops.apply(ctx.root, fork)
        except ops.ForkError as exc:
            raise InstallError(f"forks: {exc}") from None
        reports.append(f"{fork.name} {synced}, {applied}")
    say(f"{label}: " + "; ".join(reports))


def step_env(step: Step) -> dict[str, str]:
    """The process environment of a step: os.environ plus the step's, `$PATH` in a value expanded."""
    path = os.environ.get("PATH", "")
    return {**os.environ, **{k: v.replace("$PATH", path) for k, v in step.env.items()}}


def fetch(ctx: Context, step: Step, say, label: str) -> Path:
    """A sha256-pinned file from the wheelhouse or the index into the download cache (tools.forks's)."""
    pin = step.fetch
    assert pin is not None
    holder = next(f for f in ctx.manifest.forks.values() if f.distribution == pin.name)
    fork = replace(holder, pypi=pin)
    indexes = [os.environ.get("PIP_INDEX_URL") or sources.DEFAULT_INDEX]
    try:
        cached = sources.cache_dir() / pin.file
        if not (cached.is_file() and sources._sha256(cached) == pin.sha256):
            say(f"{label}: downloading {pin.file}")
        path = sources.download(fork, sources.find_distribution(fork, indexes, [ctx.wheelhouse] if ctx.wheelhouse
                                                                 else []))
    except sources.SourceError as exc:
        raise InstallError(f"step {step.name}: {exc}") from None
    say(f"{label}: {path} (sha256 ok)")
    return path


def _run_wheel(ctx: Context, step: Step, say, label: str) -> None:
    """Install a fork from its cached wheel; build the wheel first when the cache (or the wheelhouse) lacks it."""
    build = step.wheel
    assert build is not None
    build_cmd, install_cmd = step.commands
    env = step_env(step)
    started = time.monotonic()
    wheel = wheels.cached(build)
    if wheel is None and ctx.wheelhouse:
        wheel = wheels.wheelhouse_wheel(ctx.wheelhouse, build)
        if wheel:
            say(f"{label}: {wheel.name} from the wheelhouse (key {build.key})")
            wheel = wheels.seed(build, wheel)
    if wheel is not None:
        say(f"{label}: {wheel.name} from the wheel cache ({build.folder}), not built")
    else:
        say(f"{label}: building {build.name}'s wheel from {build.source} ({build.duration or 'minutes'};"
            f" once per key, then cached in {build.folder})")
        log = _log_dir(ctx) / f"{step.name}.log" if ctx.venv.is_dir() else None
        try:
            wheel = wheels.build_wheel(build, build_cmd, env, log)
        except wheels.WheelError as exc:
            raise InstallError(f"step {step.name} failed: {exc}\n  fix the cause and rerun: finished steps are skipped,"
                               " this one runs again") from None
        say(f"{label}: built {wheel.name} in {time.monotonic() - started:.0f} s")
    _run_commands(ctx, step, (install_cmd,), env)
    say(f"{label}: done in {time.monotonic() - started:.1f} s")


def _run_shell(ctx: Context, step: Step, say, label: str) -> None:
    say(f"{label}: {step.title}")
    started = time.monotonic()
    _run_commands(ctx, step, step.commands, step_env(step))
    say(f"{label}: done in {time.monotonic() - started:.1f} s")


def _run_commands(ctx: Context, step: Step, commands, env: dict[str, str]) -> None:
    for cmd in commands:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        log = _append_log(ctx, step, cmd, proc)
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
            raise InstallError(f"step {step.name} failed (exit {proc.returncode}); log: {log or 'none'}\n{tail}\n"
                               "  fix the cause and rerun: finished steps are skipped, this one runs again")


def _append_log(ctx: Context, step: Step, cmd: tuple[str, ...], proc) -> Path | None:
    """Append a command's output to the step's log; None while the environment does not exist."""
    if not ctx.venv.is_dir():
        return None
    log = _log_dir(ctx) / f"{step.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a", encoding="utf-8") as handle:
        handle.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    return log


# ---------------------------------------------------------------- smoke and stack.json

SMOKE = r"""
import importlib, importlib.metadata as md, json, re, sys
modules, dists = sys.argv[1].split(","), sys.argv[2].split(",")
failed = {}
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
packages = {norm(d.metadata["Name"]): d.version for d in md.distributions()}
print(json.dumps({"failed": failed, "packages": packages,
                  "python": sys.version.split()[0], "wanted": {d: packages.get(norm(d)) for d in dists}}))
"""
IMPORTS = {"verl": "verl", "vllm": "vllm", "vllm-ascend": "vllm_ascend", "megatron": "megatron.core",
           "mindspeed": "mindspeed", "mindspeed-llm": "mindspeed_llm"}


def smoke(ctx: Context, say, label: str) -> dict:
    forks = ctx.manifest.select(profile=ctx.device)
    modules = [IMPORTS.get(f.name, f.name.replace("-", "_")) for f in forks]
    dists = [f.distribution for f in forks] + ["torch", "torch_npu", "transformers"]
    env = {**os.environ}
    if ctx.device != "npu":
        env["VLLM_PLUGINS"] = "none"  # never let a platform plugin import torch_npu off an NPU host
    proc = subprocess.run([ctx.venv_python, "-c", SMOKE, ",".join(modules), ",".join(dists)],
                          capture_output=True, text=True, env=env, cwd=ctx.venv)
    if proc.returncode != 0:
        raise InstallError(f"smoke: the environment's Python failed: {proc.stderr.strip()[-800:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["failed"]:
        raise InstallError("smoke: imports failed:\n" + "\n".join(f"  {m}: {e}" for m, e in result["failed"].items()))
    stack = stack_record(ctx, result)
    path = ctx.venv / "stack.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stack, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    width = max(len(d) for d in result["wanted"])
    say(f"{label}: imports ok; {path}")
    for dist, version in result["wanted"].items():
        if version:
            say(f"    {dist.ljust(width)}  {version}")
    return stack


def stack_record(ctx: Context, smoke_result: dict) -> dict:
    forks = {}
    for fork in ctx.manifest.select(profile=ctx.device):
        st = ops.state(ctx.root, fork)
        forks[fork.name] = {
            "path": fork.path,
            "ref": fork.ref,
            "commit": fork.commit,
            "source": st.source,
            "base": st.base,
            "branch": fork.branch,
            "branch_tip": st.tip,
            "series": st.series.names(),
            "series_sha256": st.series.digest(),
            "distribution": fork.distribution,
            "version": smoke_result["packages"].get(re.sub(r"[-_.]+", "-", fork.distribution).lower()),
        }
    return {
        "profile": ctx.device,
        "arch": ctx.arch,
        "python": smoke_result["python"],
        "stack": ctx.manifest.stack.get(ctx.device, {}),
        "forks": forks,
        "packages": dict(sorted(smoke_result["packages"].items())),
        "installer": ctx.installer,
        "created_by": f"{Path(sys.argv[0]).name} (tools.install)",
    }
