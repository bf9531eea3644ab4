"""Fixtures: a synthetic upstream project with tags v1 and v2, a superproject pinning it, and a
three-patch series, all built here with real git (no network, nothing mocked).

Upstream v2 differs from v1 by: the exact change of our second patch (so it must be dropped as
already upstream), a change to the line our third patch edits (a conflict), and an unrelated edit.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tools.forks.cli import main

V1_FILES = {
    "app.py": "def main():\n    print('hello')\n    return 0\n",
    "util.py": "def helper():\n    retrun 1\n",
    "config.py": "batch = 8\nlr = 0.1\n",
    "README.md": "demo project\n",
}

PATCHES = [
    # (subject, files to write, body)
    ("Add a feature flag", {"app.py": "def main():\n    print('hello')\n    FLAG = True\n    return 0\n",
                            "feature.py": "ENABLED = True\n"},
     "The recipe needs to switch the feature on without an environment variable."),
    ("Fix typo in helper", {"util.py": "def helper():\n    return 1\n"},
     "The helper does not parse; every import of util fails."),
    ("Raise the default batch", {"config.py": "batch = 16\nlr = 0.1\n"},
     "Larger batches keep the devices busy at our scale."),
]


SENDABLE_TRAILERS = ("Reason: the synthetic recipe needs it\nUpstream-Status: Pending\n"
                     "Signed-off-by: Test User <test@example.invalid>")


def git(cwd: Path, *args: str, input: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, input=input)
    assert proc.returncode == 0 or not check, f"git {args} failed: {proc.stderr}"
    return proc.stdout.strip()


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def commit(repo: Path, files: dict[str, str], subject: str, body: str = "", date: str = "2025-01-01T00:00:00Z",
           trailers: str = SENDABLE_TRAILERS) -> str:
    write(repo, files)
    git(repo, "add", "-A")
    message = subject + (f"\n\n{body}" if body else "") + (f"\n\n{trailers}" if trailers else "") + "\n"
    subprocess.run(["git", "commit", "-q", "-F", "-"], cwd=repo, input=message, text=True, check=True,
                   env={**_env(), "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date})
    return git(repo, "rev-parse", "HEAD")


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


@dataclass
class Upstream:
    work: Path  # non-bare clone where tags were made
    bare: Path  # what forks.toml / the mirror points at
    v1: str
    v2: str


@dataclass
class Project:
    root: Path
    upstream: Upstream
    dist: Path  # folder with the sdist demo-1.0.tar.gz

    @property
    def fork(self) -> Path:
        return self.root / "third_party" / "demo"

    @property
    def patches(self) -> Path:
        return self.root / "third_party" / "patches" / "demo"

    def cli(self, *args: str) -> int:
        return main(["--root", str(self.root), *args])


@pytest.fixture(autouse=True)
def isolated_git(tmp_path_factory, monkeypatch):
    """No user or system git configuration leaks in; the download cache is per test."""
    return isolate_git(tmp_path_factory.mktemp("home"), monkeypatch)


def isolate_git(home: Path, monkeypatch) -> Path:
    """Git reads only a config of the tests' own (an identity, main as the first branch), none of the machine's."""
    gitconfig = home / "gitconfig"
    gitconfig.write_text("[user]\n\tname = Test User\n\temail = test@example.invalid\n"
                         "[init]\n\tdefaultBranch = main\n[protocol \"file\"]\n\tallow = always\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(gitconfig))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "cache"))
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    return gitconfig


@pytest.fixture
def upstream(tmp_path) -> Upstream:
    work = tmp_path / "upstream-work"
    work.mkdir()
    git(work, "init", "-q")
    v1 = commit(work, V1_FILES, "Initial import", date="2024-01-01T00:00:00Z", trailers="")
    git(work, "tag", "v1")
    # v2: our typo fix lands verbatim, the batch line changes differently, and one unrelated edit.
    subject, files, body = PATCHES[1]
    commit(work, files, subject, body, date="2024-02-01T00:00:00Z")
    commit(work, {"config.py": "batch = 32\nlr = 0.1\n"}, "Default batch 32", date="2024-02-02T00:00:00Z",
           trailers="")
    commit(work, {"README.md": "demo project, version 2\n"}, "Docs", date="2024-02-03T00:00:00Z", trailers="")
    v2 = git(work, "rev-parse", "HEAD")
    git(work, "tag", "v2")
    bare = tmp_path / "upstream.git"
    git(tmp_path, "clone", "-q", "--bare", str(work), str(bare))
    return Upstream(work, bare, v1, v2)


def make_sdist(dest: Path, version: str = "1.0", files: dict[str, str] | None = None) -> Path:
    """A source distribution of the v1 tree, the way setuptools lays one out."""
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"demo-{version}.tar.gz"
    content = {**(files or V1_FILES), "PKG-INFO": f"Metadata-Version: 2.1\nName: demo\nVersion: {version}\n"}
    # gzip's header holds a timestamp: fix it, so the same files always give the same bytes (and sha256).
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w") as tf:
        for name, text in sorted(content.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"demo-{version}/{name}")
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tf.addfile(info, io.BytesIO(data))
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


MANIFEST = """\
schema = 1

[stack.cpu]
python = "3.11"

[forks.demo]
path = "third_party/demo"
url = "{url}"
ref = "v1"
commit = "{commit}"
patches = "third_party/patches/demo"
distribution = "demo"
profiles = ["cpu"]
pypi = {{ requirement = "demo==1.0", file = "demo-1.0.tar.gz", sha256 = "{sha}" }}

[forks.gitonly]
path = "third_party/gitonly"
url = "{url}"
ref = "v1"
commit = "{commit}"
patches = "third_party/patches/gitonly"
distribution = "gitonly"
profiles = ["npu"]
"""


def make_project(tmp_path: Path, upstream: Upstream, url: str | None = None,
                 files: dict[str, str] | None = None) -> Project:
    """The superproject; its sdist demo-1.0 holds `files` (default V1_FILES), which should equal upstream's v1."""
    root = tmp_path / "project"
    dist = tmp_path / "dists"
    sdist = make_sdist(dist, files=files)
    (root / "third_party" / "patches" / "demo").mkdir(parents=True)
    url = url or str(upstream.bare)
    (root / "third_party" / "forks.toml").write_text(
        MANIFEST.format(url=url, commit=upstream.v1, sha=sha256(sdist)))
    git(root, "init", "-q")
    for name in ("demo", "gitonly"):
        git(root, "config", "-f", ".gitmodules", f"submodule.third_party/{name}.path", f"third_party/{name}")
        git(root, "config", "-f", ".gitmodules", f"submodule.third_party/{name}.url", url)
        git(root, "update-index", "--add", "--cacheinfo", f"160000,{upstream.v1},third_party/{name}")
    git(root, "add", ".gitmodules", "third_party/forks.toml")
    git(root, "commit", "-q", "-m", "superproject")
    return Project(root, upstream, dist)


@pytest.fixture
def project(tmp_path, upstream) -> Project:
    return make_project(tmp_path, upstream)


def commit_series(project: Project, patches: list[tuple[str, dict[str, str], str]] = PATCHES,
                  source: str = "git") -> list[str]:
    """Sync (from git, or the PyPI sdist), apply the empty series, commit the patches on the branch, export them."""
    assert project.cli("sync", "demo", "--source", source, "--find-links", str(project.dist)) == 0
    assert project.cli("apply", "demo") == 0
    for i, (subject, files, body) in enumerate(patches):
        commit(project.fork, files, subject, body, date=f"2025-03-{i + 1:02d}T00:00:00Z")
    assert project.cli("export", "demo") == 0
    return (project.patches / "series").read_text().split("\n")


@pytest.fixture
def with_series(project) -> Project:
    commit_series(project)
    return project


def bad_patch(subject: str, trailers: str, body: str = "Because the test says so.") -> str:
    """A mail-formatted patch with the given subject, body and trailer block (for lint tests)."""
    return (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "From: Test User <test@example.invalid>\n"
        "Date: Wed, 1 Jan 2025 00:00:00 +0000\n"
        f"Subject: {subject}\n\n"
        f"{body}\n\n"
        f"{trailers}\n"
        "---\n"
        "diff --git a/README.md b/README.md\n"
        "--- a/README.md\n"
        "+++ b/README.md\n"
        "@@ -1 +1 @@\n"
        "-demo project\n"
        "+demo project!\n"
    )
