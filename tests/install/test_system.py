"""The headers the builds need (numa.h for vLLM's CPU kernels): asked of a fake C compiler on PATH,
brought by a fake apt-get as root, else named by the preflight with the one command to run.

No test here runs the real apt-get: the fake one shadows it on PATH, and `system.is_root` is set."""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tools.install import cli, system
from tools.install.plan import build_plan, wheel_builds
from tools.install.run import execute

FAKE_CC = """#!/bin/sh
# finds every header but numa.h, which it finds once the fake apt-get has "installed" libnuma-dev
# (shell builtins only: some tests leave nothing else on PATH)
while IFS= read -r line; do
  case "$line" in *numa.h*) [ -e "{marker}" ] || exit 1;; esac
done
exit 0
"""
FAKE_MANAGER = """#!/bin/sh
echo "DEBIAN_FRONTEND=$DEBIAN_FRONTEND $*" >> "{log}"
case "$*" in *install*libnuma-dev*) : > "{marker}";; esac
"""


class Host:
    """A bin folder with a fake `cc` and, optionally, a fake package manager."""

    def __init__(self, tmp_path: Path):
        self.bin = tmp_path / "fake-bin"
        self.bin.mkdir()
        self.marker = tmp_path / "libnuma-dev-installed"
        self.log = tmp_path / "package-manager.log"
        self.add("cc", FAKE_CC)

    def add(self, name: str, script: str = FAKE_MANAGER) -> None:
        path = self.bin / name
        path.write_text(script.format(marker=self.marker, log=self.log))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)

    def env(self, only: bool = False) -> dict[str, str]:
        """PATH with the fake tools first (or only them: no real apt-get, dnf or yum)."""
        return {"PATH": str(self.bin) if only else f"{self.bin}{os.pathsep}{os.environ['PATH']}"}

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def host(tmp_path, monkeypatch) -> Host:
    host = Host(tmp_path)
    host.add("apt-get")
    monkeypatch.setenv("PATH", host.env()["PATH"])
    monkeypatch.delenv("CC", raising=False)
    return host


def as_root(monkeypatch, root: bool) -> None:
    monkeypatch.setattr(system, "is_root", lambda: root)


def test_the_compiler_is_asked():
    assert system.missing((system.Header("stdio.h", "libc6-dev", "glibc-devel"),)) == []
    nothing = system.Header("rl_recipe_no_such_header.h", "x", "y")
    assert system.missing((nothing,)) == [nothing]


def test_the_fake_compiler_lacks_numa_until_apt_brings_it(host, tmp_path):
    assert system.missing((system.NUMA,)) == [system.NUMA]
    host.marker.touch()
    assert system.missing((system.NUMA,)) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert system.missing((system.NUMA,), {"PATH": str(empty)}) == [system.COMPILER, system.NUMA], \
        "no compiler: the compiler and every header"


@pytest.mark.parametrize("root, managers, found, expected", [
    (True, ["apt-get"], False, ("libnuma-dev",)),
    (False, ["apt-get"], False, ()),  # not root: the preflight names the command
    (True, [], False, ()),  # no apt-get: likewise
    (True, ["dnf"], False, ()),  # apt-get only
    (True, ["apt-get"], True, ()),  # numa.h found: nothing to install
])
def test_apt_packages_only_as_root_with_apt_get(tmp_path, monkeypatch, fake_stack, root, managers, found, expected):
    host = Host(tmp_path)
    for name in managers:
        host.add(name)
    if found:
        host.marker.touch()
    as_root(monkeypatch, root)
    monkeypatch.delenv("CC", raising=False)
    builds = wheel_builds(fake_stack.context())
    assert system.apt_packages(builds, None, host.env(only=True)) == expected


@pytest.mark.parametrize("root, managers, expected", [
    (False, ["apt-get"], "sudo apt-get install -y libnuma-dev"),
    (True, ["apt-get"], "apt-get install -y libnuma-dev"),
    (False, ["yum"], "sudo yum install -y numactl-devel"),
    (False, ["dnf", "yum"], "sudo dnf install -y numactl-devel"),
    (False, [], "sudo apt-get install -y libnuma-dev (Debian, Ubuntu) or sudo dnf install -y numactl-devel"
                " (RHEL, Fedora, openEuler)"),
])
def test_the_fix_is_one_command_for_this_host(tmp_path, monkeypatch, root, managers, expected):
    host = Host(tmp_path)
    for name in managers:
        host.add(name)
    as_root(monkeypatch, root)
    assert system.fix_command([system.NUMA], host.env(only=True)) == expected


def test_a_cached_wheel_needs_no_header(fake_stack):
    builds = wheel_builds(fake_stack.context())
    assert [b.key for b in builds] == [s.wheel.key for s in build_plan(fake_stack.context()) if s.wheel]
    assert system.headers_to_build(builds, None) == (system.NUMA,)
    builds[0].folder.mkdir(parents=True)
    (builds[0].folder / "vllm-1.0-py3-none-any.whl").write_bytes(b"")
    assert system.headers_to_build(builds, None) == ()


def _dry_run(fake_stack, capsys) -> str:
    assert cli.main(["--root", str(fake_stack.root), "--device", "cpu", "--python", sys.executable,
                     "--dry-run"]) == 0
    return capsys.readouterr().out


def test_the_dry_run_shows_the_system_step_as_root_and_runs_nothing(fake_stack, host, monkeypatch, capsys):
    as_root(monkeypatch, True)
    out = _dry_run(fake_stack, capsys)
    assert "[2/11] system: Debian packages the builds need: libnuma-dev" in out
    assert "    env DEBIAN_FRONTEND=noninteractive\n    $ apt-get update -qq\n" \
           "    $ apt-get install -y -qq --no-install-recommends libnuma-dev\n" in out
    assert host.calls() == [], "a dry run installs nothing"
    as_root(monkeypatch, False)
    assert "system" not in _dry_run(fake_stack, capsys), "not root: no step; the preflight names the command"
    as_root(monkeypatch, True)
    host.marker.touch()
    assert "system" not in _dry_run(fake_stack, capsys), "numa.h found: no step"


def test_as_root_the_install_apt_gets_libnuma_dev_then_builds(fake_stack, host, monkeypatch):
    as_root(monkeypatch, True)

    def install():  # what the CLI does: decide, plan, run
        ctx = fake_stack.context()
        ctx = replace(ctx, apt_packages=system.apt_packages(wheel_builds(ctx), None))
        return execute(ctx, build_plan(ctx), say=lambda *a: None)

    outcome = install()
    assert host.calls() == ["DEBIAN_FRONTEND=noninteractive update -qq",
                            "DEBIAN_FRONTEND=noninteractive install -y -qq --no-install-recommends libnuma-dev"]
    assert outcome["system"] == "ran" and outcome["vllm"] == "ran" and "vllm" in fake_stack.order()
    fake_stack.log.unlink()
    outcome = install()
    assert "system" not in outcome and len(host.calls()) == 2, "numa.h is there now: no apt-get"
    assert all(v == "skipped" for k, v in outcome.items() if k not in ("preflight", "forks")), \
        "the system step is not part of the stamps: its absence now reinstalls nothing"


def test_not_root_stops_before_any_slow_work_with_one_line(fake_stack, host, monkeypatch, capsys):
    as_root(monkeypatch, False)
    venv = fake_stack.root / ".venv"
    code = cli.main(["--root", str(fake_stack.root), "--device", "cpu", "--python", sys.executable])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: preflight failed: numa.h: the C compiler cannot find it")
    assert "fix: run `sudo apt-get install -y libnuma-dev`, then rerun" in err
    assert host.calls() == [] and not venv.exists() and fake_stack.order() == []
    assert not (fake_stack.root / "third_party/vllm/setup.py").exists(), "the forks were not even synced"


def test_with_the_wheel_cached_no_header_is_needed(fake_stack, host, monkeypatch):
    host.marker.touch()
    ctx = fake_stack.context()
    execute(ctx, build_plan(ctx), say=lambda *a: None)  # builds the wheel into the cache
    host.marker.unlink()
    as_root(monkeypatch, False)
    other = fake_stack.context(venv=fake_stack.root / ".venv2")
    outcome = execute(other, build_plan(other), say=lambda *a: None)
    assert outcome["vllm"] == "ran" and host.calls() == [], "installed from the cache, numa.h or not"


def test_the_build_itself_still_refuses_without_the_header(fake_stack, host, monkeypatch):
    """A plan run without its preflight (as the wheelhouse builds do) fails at the build, with the command."""
    from tools.install import wheels

    as_root(monkeypatch, False)
    build = wheel_builds(fake_stack.context())[0]
    with pytest.raises(wheels.WheelError, match=r"needs numa.h, which the C compiler cannot find: run "
                                                r"`sudo apt-get install -y libnuma-dev`, then rerun"):
        wheels.build_wheel(build, ("false",), dict(os.environ), None)
