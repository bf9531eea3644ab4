"""A fake stack: three tiny forks (verl, vllm, megatron-core) in real git repositories, a fake torch
and a fake dependency as wheels in a local folder. Their builds append their names to a log, so
tests see the order in which the installer built them; FAKE_FAIL=<fork> makes that build fail. The
cpu profile builds vllm into a wheel: the fake one goes to a wheel cache under the test's tmp_path."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.forks.conftest import commit, git, isolate_git
from tools.forks import manifest as manifest_mod
from tools.install.plan import Context

FAKE_FORKS = {  # fork name: (distribution, packages)
    "megatron": ("megatron-core", ["megatron", "megatron/core"]),
    "vllm": ("vllm", ["vllm"]),
    "verl": ("verl", ["verl"]),
}

SETUP = """\
import os
from setuptools import setup

if os.environ.get("FAKE_INSTALL_LOG"):
    with open(os.environ["FAKE_INSTALL_LOG"], "a") as log:
        log.write("{fork}\\n")
if os.environ.get("FAKE_FAIL") == "{fork}":
    raise SystemExit("fake build failure of {fork}")
setup(name="{dist}", version="1.0", packages={packages!r})
"""


def make_wheel(dest: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A minimal valid wheel (PEP 427), written by hand so tests need no index."""
    dest.mkdir(parents=True, exist_ok=True)
    dist_info = f"{name}-{version}.dist-info"
    content = {**files,
               f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
               f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in content.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist_info}/RECORD,,")
    wheel = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in content.items():
            zf.writestr(path, text)
        zf.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return wheel


@dataclass
class FakeStack:
    root: Path
    links: Path  # find-links folder: fake torch and fakedep
    log: Path
    wheel_cache: Path  # the cpu profile's vllm step builds its wheel here

    def context(self, **kw) -> Context:
        installer = kw.pop("installer", "uv" if shutil.which("uv") else "pip")
        return Context(root=self.root, manifest=manifest_mod.load(self.root), device="cpu",
                       venv=kw.pop("venv", self.root / ".venv"), installer=installer, arch="x86_64",
                       python=kw.pop("python", sys.executable), build_tools=(),
                       index_options=kw.pop("index_options", ("--no-index", "--find-links", str(self.links))),
                       wheel_cache=kw.pop("wheel_cache", self.wheel_cache), jobs=2,
                       disk_gib=kw.pop("disk_gib", 0.01), **kw)  # a fake venv takes a few MB

    def order(self) -> list[str]:
        names = self.log.read_text().split() if self.log.exists() else []
        return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


@pytest.fixture
def fake_stack(tmp_path, monkeypatch) -> FakeStack:
    isolate_git(tmp_path, monkeypatch)  # the fake upstreams' commits need an identity, not the machine's
    root = tmp_path / "project"
    (root / "third_party").mkdir(parents=True)
    git(root, "init", "-q")
    python = "{}.{}".format(*sys.version_info[:2])
    tables = [f'schema = 1\n\n[stack.cpu]\npython = "{python}"\ntorch = "9.9.9"\n']
    for fork, (dist, packages) in FAKE_FORKS.items():
        upstream = tmp_path / "upstreams" / fork
        upstream.mkdir(parents=True)
        git(upstream, "init", "-q")
        files = {"setup.py": SETUP.format(fork=fork, dist=dist, packages=[p.replace("/", ".") for p in packages])}
        files.update({f"{p}/__init__.py": f"NAME = {p!r}\n" for p in packages})
        files[".gitignore"] = "*.egg-info/\n"
        sha = commit(upstream, files, f"{fork} 1.0", trailers="")
        git(upstream, "tag", "v1.0")
        tables.append(f'[forks.{fork}]\npath = "third_party/{fork}"\nurl = "{upstream}"\nref = "v1.0"\n'
                      f'commit = "{sha}"\npatches = "third_party/patches/{fork}"\ndistribution = "{dist}"\n'
                      'profiles = ["cpu"]\n')
        git(root, "update-index", "--add", "--cacheinfo", f"160000,{sha},third_party/{fork}")
        git(root, "config", "-f", ".gitmodules", f"submodule.third_party/{fork}.path", f"third_party/{fork}")
        git(root, "config", "-f", ".gitmodules", f"submodule.third_party/{fork}.url", str(upstream))
    (root / "third_party/forks.toml").write_text("\n".join(tables))
    (root / "requirements").mkdir()
    (root / "requirements/cpu.in").write_text("fakedep==1.0\n")
    links = tmp_path / "links"
    make_wheel(links, "torch", "9.9.9", {"torch/__init__.py": "__version__ = '9.9.9'\n"})
    make_wheel(links, "fakedep", "1.0", {"fakedep/__init__.py": ""})
    log = tmp_path / "install-order.log"
    monkeypatch.setenv("FAKE_INSTALL_LOG", str(log))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # this machine's pip settings must not leak in
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.delenv("FAKE_FAIL", raising=False)
    monkeypatch.setenv("RL_RECIPE_WHEEL_CACHE", str(tmp_path / "wheel-cache"))  # never the user's cache
    return FakeStack(root, links, log, tmp_path / "wheel-cache")
