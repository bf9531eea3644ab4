"""Environment profiles (recipes/<recipe>/env/<name>.yaml) and the per-node facts their computed variables need.

A profile has `variables` (fixed values, each commented with why), `computed` (worked out on each node at run
time: jemalloc's path, the interface that reaches MASTER_ADDR) and `left_out` (variables that do nothing at our
versions, with the reason). Parsing and assembling are pure; `gather_facts` asks this machine.
"""

from __future__ import annotations

import glob
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from tools.launch.config import ConfigError

JEMALLOC_GLOBS = ("/usr/lib/*/libjemalloc.so*", "/usr/lib64/libjemalloc.so*", "/usr/lib/libjemalloc.so*",
                  "/usr/local/lib/libjemalloc.so*", "/usr/local/lib64/libjemalloc.so*", "/opt/*/lib/libjemalloc.so*")
COMPUTED = ("jemalloc", "route_to_master")


@dataclass(frozen=True)
class Profile:
    name: str
    variables: dict[str, str]
    computed: dict[str, str]
    left_out: dict[str, str]


@dataclass(frozen=True)
class NodeFacts:
    """What a node found out about itself; tests and the golden plan pass fixed ones."""

    master_addr: str
    ifname: str | None
    node_ip: str | None
    master_is_local: bool
    jemalloc: str | None


def load_profile(recipe_dir: Path, name: str) -> Profile:
    path = Path(recipe_dir) / "env" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (Path(recipe_dir) / "env").glob("*.yaml"))
        raise ConfigError(f"launch.env_profile: no profile {name!r} ({path}); known: {', '.join(known)}")
    data = OmegaConf.to_container(OmegaConf.load(path)) or {}
    computed = {str(k): str(v) for k, v in (data.get("computed") or {}).items()}
    bad = [k for k, v in computed.items() if v not in COMPUTED]
    if bad:
        raise ConfigError(f"{path}: computed.{bad[0]} must be one of {', '.join(COMPUTED)}")
    return Profile(name, {str(k): str(v) for k, v in (data.get("variables") or {}).items()}, computed,
                   {str(k): str(v) for k, v in (data.get("left_out") or {}).items()})


def parse_route(output: str) -> tuple[str | None, str | None, bool]:
    """`ip route get ADDR` -> (interface, source address, ADDR is this host)."""
    dev = re.search(r"\bdev\s+(\S+)", output)
    src = re.search(r"\bsrc\s+(\S+)", output)
    return (dev.group(1) if dev else None, src.group(1) if src else None, output.lstrip().startswith("local "))


def pick_jemalloc(ldconfig_output: str, globbed: list[str]) -> str | None:
    """The first libjemalloc.so.2 (else any libjemalloc.so*) that ldconfig or the usual lib dirs know."""
    found = re.findall(r"(libjemalloc\.so[.\d]*)\s.*=>\s*(\S+)", ldconfig_output)
    paths = [p for _, p in found] + sorted(globbed)
    for suffix in (".so.2", ".so"):
        for p in paths:
            if p.endswith(suffix):
                return p
    return paths[0] if paths else None


def gather_facts(master_addr: str) -> NodeFacts:
    route = ""
    if shutil.which("ip"):
        route = subprocess.run(["ip", "route", "get", master_addr], capture_output=True, text=True).stdout
    ifname, src, local = parse_route(route)
    if not route:  # no iproute2: a master address this host owns is still recognised
        local = master_addr in _own_addresses()
    ldconfig = ""
    if shutil.which("ldconfig"):
        ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    globbed = [p for g in JEMALLOC_GLOBS for p in glob.glob(g)]
    return NodeFacts(master_addr, ifname, src, local, pick_jemalloc(ldconfig, globbed))


def _own_addresses() -> set[str]:
    names = {socket.gethostname(), "localhost"}
    out = {"127.0.0.1"}
    for name in names:
        try:
            out |= {info[4][0] for info in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    return out


def node_env(profile: Profile, facts: NodeFacts) -> tuple[dict[str, str], list[str]]:
    """The environment of one node, and notes for what could not be computed."""
    env, notes = dict(profile.variables), []
    for var, how in profile.computed.items():
        if how == "jemalloc":
            if facts.jemalloc:
                env[var] = facts.jemalloc
            else:
                notes.append(f"{var}: jemalloc not found (ldconfig, {JEMALLOC_GLOBS[0]}, ...): not preloaded;"
                             " install libjemalloc2 for the host-side speed-up")
        elif facts.ifname:
            env[var] = facts.ifname
        else:
            notes.append(f"{var}: no route to MASTER_ADDR {facts.master_addr} found (`ip route get`): left unset")
    env["MASTER_ADDR"] = facts.master_addr
    return env, notes
