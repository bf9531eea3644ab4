"""The wheel cache: forks whose build compiles kernels are built into a wheel once per key and kept
outside every environment, so a fresh clone or a new venv on the same machine installs in seconds.

A key digests everything that decides the wheel's bytes (fork pin, series digest, torch version,
Python, architecture, the build's flags); MAX_JOBS and PATH change how fast it builds, not what, and
stay out. `<cache>/<name>-<key>/` holds exactly one finished wheel: it is built in a temporary folder
beside it and renamed into place, so an interrupted build leaves nothing that looks finished.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tools.install import system

CACHE_ENV = "RL_RECIPE_WHEEL_CACHE"


def cache_base(env: dict[str, str] | None = None) -> Path:
    """$XDG_CACHE_HOME/rl-recipe, else ~/.cache/rl-recipe: where the project keeps what it makes across clones."""
    env = dict(os.environ if env is None else env)
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "rl-recipe"


def default_cache(env: dict[str, str] | None = None) -> Path:
    """$RL_RECIPE_WHEEL_CACHE, else $XDG_CACHE_HOME/rl-recipe/wheels, else ~/.cache/rl-recipe/wheels."""
    env = dict(os.environ if env is None else env)
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV]).expanduser().resolve()
    return cache_base(env) / "wheels"


@dataclass(frozen=True)
class WheelBuild:
    """One fork tree built into one wheel, found again by its key."""

    name: str  # distribution name, what the install step asks the cache folder for
    source: Path  # the patched fork tree
    key_parts: tuple[str, ...]  # what decides the wheel's content
    flags: dict[str, str] = field(default_factory=dict)  # build environment that is part of the key
    cache_root: Path = field(default_factory=default_cache)
    headers: tuple[system.Header, ...] = ()  # C headers the build includes
    duration: str = ""  # what a first build costs, said before it starts

    @property
    def key(self) -> str:
        h = hashlib.sha256()
        for part in (self.name, *self.key_parts, *(f"{k}={v}" for k, v in sorted(self.flags.items()))):
            h.update(part.encode() + b"\0")
        return h.hexdigest()[:20]

    @property
    def folder(self) -> Path:
        return self.cache_root / f"{self.name}-{self.key}"


class WheelError(RuntimeError):
    """A wheel could not be built; the message names the cause and the fix."""


def cached(build: WheelBuild) -> Path | None:
    """The finished wheel for this key, or None."""
    wheels = sorted(build.folder.glob("*.whl")) if build.folder.is_dir() else []
    return wheels[0] if len(wheels) == 1 else None


def seed(build: WheelBuild, wheel: Path) -> Path:
    """Put an already built wheel (a wheelhouse's) into the cache under this key, atomically."""
    with _staged(build) as tmp:
        shutil.copy2(wheel, tmp / wheel.name)
    return _found(build)


def wheelhouse_wheel(wheelhouse: Path, build: WheelBuild) -> Path | None:
    """The wheel a wheelhouse built under this key (wheelhouse.json records it), if it is there."""
    record = wheelhouse / "wheelhouse.json"
    if not record.is_file():
        return None
    name = json.loads(record.read_text()).get("built", {}).get(build.key)
    return wheelhouse / name if name and (wheelhouse / name).is_file() else None


def build_wheel(build: WheelBuild, command: tuple[str, ...], env: dict[str, str], log: Path | None) -> Path:
    """Run `command` (a `pip wheel ... --wheel-dir <build.folder> SRC`) into a temporary folder, then
    rename that folder to the key's. Raises WheelError with the log's tail when the build fails."""
    lacking = system.missing(build.headers, env)
    if lacking:
        raise WheelError(f"building {build.name} needs {', '.join(h.what() for h in lacking)}, which the C compiler"
                         f" cannot find: run `{system.fix_command(lacking, env)}`, then rerun")
    with _staged(build) as tmp:
        args = tuple(str(tmp) if part == str(build.folder) else part for part in command)
        proc = subprocess.run(args, env=env, capture_output=True, text=True)
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("a", encoding="utf-8") as handle:
                handle.write(f"$ {' '.join(args)}\n{proc.stdout}{proc.stderr}\n")
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
            raise WheelError(f"building {build.name} failed (exit {proc.returncode}); log: {log or 'none'}\n{tail}")
        wheels = list(tmp.glob("*.whl"))
        if len(wheels) != 1:
            raise WheelError(f"building {build.name} left {len(wheels)} wheels in {tmp}, expected one")
    return _found(build)


@contextlib.contextmanager
def _staged(build: WheelBuild):
    """A temporary folder beside the key's, renamed to it when the block succeeds and removed either way."""
    build.cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=build.cache_root, prefix=f".{build.folder.name}."))
    try:
        yield tmp
        _publish(tmp, build.folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _found(build: WheelBuild) -> Path:
    found = cached(build)
    assert found is not None
    return found


def _publish(tmp: Path, folder: Path) -> None:
    """Rename a finished temporary folder to its key's; a folder already there (another run finished
    first, or a stale partial one) is replaced."""
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
