"""What the fork builds need from the operating system, and how it gets there.

The cpu profile compiles vLLM's CPU kernels, which include numa.h. The C compiler is asked whether it
finds each header (as `.ci/run` did: CPATH and the compiler's own paths count). A missing one is
installed by the install's `system` step when this is a Debian-like host and the install runs as
root (CI, containers); otherwise the preflight stops, before any slow work, with the one command to
run. A build whose wheel the cache or the wheelhouse already has needs no header at all.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Header:
    """A C header a build includes, and the package that has it per package manager."""

    name: str  # "numa.h"; "" for the C compiler itself
    apt: str  # Debian, Ubuntu
    dnf: str  # RHEL, Fedora, openEuler (yum too)

    def what(self) -> str:
        return self.name or "a C compiler (cc)"


COMPILER = Header("", apt="build-essential", dnf="gcc")
NUMA = Header("numa.h", apt="libnuma-dev", dnf="numactl-devel")
APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}


def apt_commands(packages: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """What the system step runs (the same lines .ci/run ran before the install did it)."""
    return (("apt-get", "update", "-qq"),
            ("apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages))


def is_root() -> bool:
    return os.geteuid() == 0


def _which(name: str, env: dict[str, str]) -> str | None:
    return shutil.which(name, path=env.get("PATH"))


def compiler(env: dict[str, str]) -> str | None:
    return env.get("CC") or _which("cc", env) or _which("gcc", env)


def missing(headers: tuple[Header, ...], env: dict[str, str] | None = None) -> list[Header]:
    """The headers the C compiler cannot find; with no compiler, the compiler and every header."""
    env = dict(os.environ if env is None else env)
    if not headers:
        return []
    cc = compiler(env)
    if not cc:
        return [COMPILER, *headers]
    lacking = []
    for header in headers:
        proc = subprocess.run([cc, "-E", "-x", "c", "-", "-o", os.devnull], input=f"#include <{header.name}>\n",
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            lacking.append(header)
    return lacking


def can_apt(env: dict[str, str] | None = None) -> bool:
    """Whether the install may bring packages itself: root, with apt-get on PATH."""
    env = dict(os.environ if env is None else env)
    return is_root() and _which("apt-get", env) is not None


def fix_command(lacking: list[Header], env: dict[str, str] | None = None) -> str:
    """The one command that brings what is missing, for this host's package manager."""
    env = dict(os.environ if env is None else env)
    sudo = "" if is_root() else "sudo "
    for manager in ("apt-get", "dnf", "yum"):
        if _which(manager, env):
            packages = " ".join(h.apt if manager == "apt-get" else h.dnf for h in lacking)
            return f"{sudo}{manager} install -y {packages}"
    return (f"{sudo}apt-get install -y {' '.join(h.apt for h in lacking)} (Debian, Ubuntu) or"
            f" {sudo}dnf install -y {' '.join(h.dnf for h in lacking)} (RHEL, Fedora, openEuler)")


def headers_to_build(builds, wheelhouse: Path | None) -> tuple[Header, ...]:
    """The headers of the wheel builds (plan.wheel_builds) that will really run: a wheel that the cache
    (or the wheelhouse) has is installed, not built."""
    from tools.install import wheels

    needed: list[Header] = []
    for build in builds:
        if wheels.cached(build) or (wheelhouse and wheels.wheelhouse_wheel(wheelhouse, build)):
            continue
        needed += [h for h in build.headers if h not in needed]
    return tuple(needed)


def apt_packages(builds, wheelhouse: Path | None, env: dict[str, str] | None = None) -> tuple[str, ...]:
    """The Debian packages the install's system step brings: those of the missing headers, when the
    install may use apt-get; () otherwise (then the preflight names the command)."""
    env = dict(os.environ if env is None else env)
    lacking = missing(headers_to_build(builds, wheelhouse), env)
    return tuple(h.apt for h in lacking) if lacking and can_apt(env) else ()
