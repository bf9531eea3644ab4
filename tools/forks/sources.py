"""Bring a fork's upstream tree at its pin: from git (submodule, mirrors honoured) or from PyPI.

A PyPI-derived tree becomes a git repository of its own whose single commit holds the distribution's
files, is tagged with the upstream ref and says in its message (and in `recipe.source`) that it is
not the upstream commit. The commit is made with a fixed identity and date, so the same file gives
the same commit id everywhere.
"""

from __future__ import annotations

import hashlib
import html.parser
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from dataclasses import replace
from email.parser import Parser
from pathlib import Path

from tools.forks import git
from tools.forks.manifest import Fork, PyPISource
from tools.install.wheels import cache_base

DEFAULT_INDEX = "https://pypi.org/simple"
PYPI_IDENTITY = {
    "GIT_AUTHOR_NAME": "PyPI distribution",
    "GIT_AUTHOR_EMAIL": "pypi@rl-recipe.invalid",
    "GIT_AUTHOR_DATE": "1980-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "PyPI distribution",
    "GIT_COMMITTER_EMAIL": "pypi@rl-recipe.invalid",
    "GIT_COMMITTER_DATE": "1980-01-01T00:00:00+0000",
}
SOURCE_TRAILER = "Recipe-Source: pypi"
# Local mirrors (url.<dir>.insteadOf) are plain paths; git refuses the file transport for
# submodules unless told otherwise.
ALLOW_LOCAL = ("protocol.file.allow=always",)


class SourceError(RuntimeError):
    """The upstream tree could not be had; the message names the fork, what was tried and the fix."""


def cache_dir() -> Path:
    """The downloaded distributions, `dists` in the project's cache beside the wheel cache (wheels.cache_base)."""
    return cache_base() / "dists"


# Build outputs of an editable install (egg-info, compiled extensions, CMake trees). Listed in the
# fork's own .git/info/exclude, so that installing a fork never counts as local work in it.
BUILD_OUTPUTS = ("*.egg-info/", "build/", "dist/", "__pycache__/", "*.so", ".deps/")


def exclude_build_outputs(path: Path) -> None:
    exclude = Path(git.out(path, "rev-parse", "--path-format=absolute", "--git-path", "info/exclude"))
    have = exclude.read_text().splitlines() if exclude.is_file() else []
    missing = [p for p in BUILD_OUTPUTS if p not in have]
    if missing:
        exclude.parent.mkdir(parents=True, exist_ok=True)
        exclude.write_text("\n".join([*have, "# tools.forks: build outputs of editable installs", *missing]) + "\n")



# ---------------------------------------------------------------- git


def sync_git(root: Path, fork: Fork) -> None:
    """Check out the pinned commit through the submodule (or a plain clone outside a superproject)."""
    path = root / fork.path
    if is_gitlink(root, fork.path):
        cmd = ("submodule", "update", "--init", "--checkout", "--", fork.path)
        proc = git.run(root, *cmd, config=ALLOW_LOCAL, check=False)
    elif git.is_repo_root(path):  # a clone outside a superproject whose pin moved
        proc = git.run(path, "fetch", "--quiet", "--tags", fork.url, config=ALLOW_LOCAL, check=False)
        if proc.returncode == 0:
            proc = git.run(path, "checkout", "--quiet", "--detach", fork.commit, check=False)
    else:
        path.mkdir(parents=True, exist_ok=True)
        proc = git.run(path.parent, "clone", "--no-checkout", fork.url, path.name,
                       config=ALLOW_LOCAL, check=False)
        if proc.returncode == 0:
            proc = git.run(path, "checkout", "--detach", fork.commit, check=False)
    if proc.returncode != 0 or git.resolve(path, fork.commit) is None:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        cause = next((line for line in said if line.startswith(("fatal:", "error:"))), said[-1] if said else "")
        raise SourceError(
            f"{fork.name}: git could not fetch {fork.commit[:12]} ({fork.ref}) from {fork.url}:"
            f" {cause or 'the commit is not there'}\n"
            f"  fix: give git a mirror, e.g. `git config --global url.<mirror>.insteadOf {fork.url}`,"
            " or use --source pypi where the fork has a PyPI source"
        )
    _record_git(path, fork)


def checkout_pin(root: Path, fork: Fork) -> None:
    """Detach a git checkout that already holds the pin at it, as `git submodule update` does."""
    path = root / fork.path
    git.run(path, "checkout", "--quiet", "--detach", fork.commit)
    _record_git(path, fork)


def _record_git(path: Path, fork: Fork) -> None:
    git.set_config(path, "recipe.source", "git")
    git.set_config(path, "recipe.base", fork.commit)


def is_gitlink(root: Path, rel: str) -> bool:
    if not git.is_repo_root(root):
        return False
    entry = git.out(root, "ls-files", "--stage", "--", rel)
    return entry.startswith("160000 ")


# ---------------------------------------------------------------- PyPI


class _Links(html.parser.HTMLParser):
    """Anchors of a PEP 503 simple-index page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: dict[str, str] = {}

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                name = urllib.parse.unquote(href.split("#")[0].rsplit("/", 1)[-1])
                self.links[name] = href


def _normalize(name: str) -> str:
    return "-".join(name.lower().replace("_", "-").replace(".", "-").split("-"))


def find_distribution(fork: Fork, index_urls: list[str], find_links: list[Path]) -> str:
    """URL or local path of the pinned file: find-links folders first, then each index."""
    pin = fork.pypi
    assert pin is not None
    for folder in find_links:
        candidate = folder / pin.file
        if candidate.is_file():
            return str(candidate)
    tried = []
    for index in index_urls:
        page, files = _listing(index, pin.name)
        tried.append(page)
        if pin.file in files:
            return files[pin.file]
    raise SourceError(
        f"{fork.name}: {pin.file} ({pin.requirement}) not found; tried"
        f" {', '.join(map(str, find_links)) or 'no find-links folder'} and {', '.join(tried)}\n"
        "  fix: pass --index-url for a reachable index or --find-links DIR holding that file"
    )


def _listing(index: str, project: str) -> tuple[str, dict[str, str]]:
    """(page, file name -> URL) of a project on a PEP 503/691 simple index; no files when unreachable.

    A URL carries the index's sha256 as a `#sha256=` fragment where the index gives one.
    """
    page = f"{index.rstrip('/')}/{_normalize(project)}/"
    try:
        request = urllib.request.Request(
            page, headers={"Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"}
        )
        with urllib.request.urlopen(request, timeout=60) as resp:
            body = resp.read().decode("utf-8")
            kind = resp.headers.get("Content-Type", "")
    except (OSError, ValueError):
        return page, {}
    if "json" in kind:
        links = {}
        for f in json.loads(body).get("files", []):
            sha = f.get("hashes", {}).get("sha256")
            links[f["filename"]] = f["url"] + (f"#sha256={sha}" if sha else "")
    else:
        parser = _Links()
        parser.feed(body)
        links = parser.links
    return page, {name: urllib.parse.urljoin(page, href) for name, href in links.items()}


def find_release(fork: Fork, requirement: str, index_urls: list[str],
                 find_links: list[Path]) -> tuple[PyPISource, str]:
    """The sdist of `requirement` (a release of the fork's distribution) and where it is: find-links folders
    first, then each index. Its sha256 is the index's; a find-links file is taken as it is."""
    assert fork.pypi is not None
    version = _release_version(fork, requirement)

    def release(file_name: str) -> PyPISource | None:
        same = _sdist_version(fork, file_name) == version
        return PyPISource(f"{fork.pypi.name}=={version}", file_name, "") if same else None

    for folder in find_links:
        for path in sorted(folder.iterdir()) if folder.is_dir() else []:
            if (pin := release(path.name)) and path.is_file():
                return replace(pin, sha256=_sha256(path)), str(path)
    tried = []
    for index in index_urls:
        page, files = _listing(index, fork.pypi.name)
        tried.append(page)
        for file_name, url in files.items():
            if pin := release(file_name):
                fragment = urllib.parse.urldefrag(url).fragment
                if not fragment.startswith("sha256="):
                    raise SourceError(f"{fork.name}: {page} gives no sha256 for {file_name}; download it yourself"
                                      " and pass --find-links DIR holding it")
                return replace(pin, sha256=fragment.removeprefix("sha256=")), url
    raise SourceError(
        f"{fork.name}: no sdist of {requirement} found; tried"
        f" {', '.join(map(str, find_links)) or 'no find-links folder'} and {', '.join(tried)}\n"
        "  fix: check the version, or pass --index-url for a reachable index or --find-links DIR holding its sdist"
    )


def releases(fork: Fork, index_urls: list[str], find_links: list[Path]) -> tuple[set[str], list[str]]:
    """The versions of the fork's distribution that have an sdist (what `find_release` can lay out), in the
    find-links folders and on each index, and the places looked in."""
    assert fork.pypi is not None
    names = [p.name for folder in find_links if folder.is_dir() for p in folder.iterdir() if p.is_file()]
    tried = [str(folder) for folder in find_links]
    for index in index_urls:
        page, files = _listing(index, fork.pypi.name)
        names += files
        tried.append(page)
    versions = {_sdist_version(fork, name) for name in names} - {None}
    return {str(v) for v in versions}, tried


def _sdist_version(fork: Fork, file_name: str):
    """The version of an sdist of the fork's distribution named `file_name`; None for any other file."""
    from packaging.utils import InvalidSdistFilename, canonicalize_name, parse_sdist_filename

    assert fork.pypi is not None
    try:
        name, version = parse_sdist_filename(file_name)
    except InvalidSdistFilename:
        return None
    return version if canonicalize_name(name) == canonicalize_name(fork.pypi.name) else None


def _release_version(fork: Fork, requirement: str):
    """The version of `name==version`, where name is the fork's distribution on the index."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    assert fork.pypi is not None
    try:
        req = Requirement(requirement)
        specs = list(req.specifier)
    except InvalidRequirement:
        req, specs = None, []
    if (req is None or len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version
            or canonicalize_name(req.name) != canonicalize_name(fork.pypi.name)):
        raise SourceError(f"{fork.name}: {requirement!r} is not a release of {fork.pypi.name} (the distribution"
                          f" forks.{fork.name}.pypi names); write it as {fork.pypi.name}==<version>")
    return Version(specs[0].version)


def download(fork: Fork, location: str, progress: bool = True) -> Path:
    """The pinned file in the download cache, fetched if needed and checked against its sha256."""
    pin = fork.pypi
    assert pin is not None
    cached = cache_dir() / pin.file
    if cached.is_file() and _sha256(cached) == pin.sha256:
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cached.parent, prefix=f".{pin.file}.")
    try:
        with os.fdopen(fd, "wb") as dst:
            if os.path.exists(location):
                with open(location, "rb") as src:
                    shutil.copyfileobj(src, dst)
            else:
                with urllib.request.urlopen(location, timeout=300) as resp:
                    _copy_with_progress(resp, dst, pin.file, int(resp.headers.get("Content-Length") or 0),
                                        progress)
        digest = _sha256(Path(tmp))
        if digest != pin.sha256:
            raise SourceError(
                f"{fork.name}: {pin.file} from {location} has sha256 {digest}, not the {pin.sha256} of"
                f" {pin.requirement}; the index serves a different file, refusing it"
            )
        os.replace(tmp, cached)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return cached


def _copy_with_progress(src, dst, label: str, total: int, progress: bool) -> None:
    done = 0
    while chunk := src.read(1 << 20):
        dst.write(chunk)
        done += len(chunk)
        if progress and total and sys.stderr.isatty():
            print(f"\r  {label}: {done / 2**20:.1f}/{total / 2**20:.1f} MiB", end="", file=sys.stderr)
    if progress and total and sys.stderr.isatty():
        print(file=sys.stderr)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def unpack(fork: Fork, archive: Path, dest: Path) -> None:
    """Lay the distribution's files into `dest` with the upstream repository's layout."""
    pin = fork.pypi
    assert pin is not None
    if archive.name.endswith(".whl"):
        with zipfile.ZipFile(archive) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            version = Parser().parsestr(zf.read(meta).decode()).get("Version")
            for info in zf.infolist():
                if ".dist-info/" not in info.filename:
                    zf.extract(info, dest)
    else:
        with tarfile.open(archive) as tf:
            members = tf.getmembers()
            top = members[0].name.split("/")[0]
            pkg_info = tf.extractfile(f"{top}/PKG-INFO")
            version = Parser().parsestr(pkg_info.read().decode()).get("Version") if pkg_info else None
            for m in members:
                parts = m.name.split("/", 1)
                if len(parts) == 2 and parts[1] and (m.isfile() or m.isdir()):
                    m.name = parts[1]
                    tf.extract(m, dest, filter="data")
    if version != pin.version:
        raise SourceError(
            f"{fork.name}: {archive.name} says version {version!r}, not the {pin.version} of {pin.requirement}"
        )


def sync_pypi(root: Path, fork: Fork, index_urls: list[str], find_links: list[Path]) -> None:
    """Replace an empty fork path by a git repository holding the pinned distribution's files."""
    if fork.pypi is None:
        raise SourceError(f"{fork.name}: git-only (forks.toml has no PyPI source for it)")
    path = root / fork.path
    archive = download(fork, find_distribution(fork, index_urls, find_links))
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.sync-"))
    try:
        unpack(fork, archive, staging)
        _commit_tree(staging, fork, archive)
        if path.exists():
            path.rmdir()  # only an empty placeholder; callers refuse anything else
        os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _commit_tree(repo: Path, fork: Fork, archive: Path) -> None:
    pin = fork.pypi
    assert pin is not None
    git.run(repo, "init", "--quiet", f"--initial-branch=pypi/{fork.ref}")
    for key, value in (("core.autocrlf", "false"), ("core.fileMode", "true")):
        git.set_config(repo, key, value)
    # Generated files the distribution carries (egg-info, setuptools-scm's _version.py) are ignored by
    # upstream's own .gitignore, where the distribution has one, and by the build-output patterns:
    # they are not upstream sources and an editable install rewrites them.
    exclude_build_outputs(repo)
    git.run(repo, "add", "--all", ".")
    git.run(repo, "commit", "--quiet", "--no-verify", "-F", "-", input=_message(fork, pinned=True),
            env=PYPI_IDENTITY, config=git.NO_SIGNING)
    git.run(repo, "tag", fork.ref, config=git.NO_SIGNING)
    git.set_config(repo, "recipe.source", "pypi")
    git.set_config(repo, "recipe.base", git.out(repo, "rev-parse", "HEAD"))
    git.set_config(repo, "recipe.upstream-commit", fork.commit)


def _message(fork: Fork, pinned: bool) -> str:
    """What a PyPI-derived commit says it is; `pinned`: fork.pypi is the pin's file, standing in for fork.commit."""
    pin = fork.pypi
    assert pin is not None
    instead = f"Not upstream commit {fork.commit} ({fork.ref})" if pinned else "Not an upstream commit"
    return (
        f"PyPI-derived tree of {pin.requirement} ({pin.file})\n\n"
        f"{instead}: the files of the {pin.file} distribution"
        f" (sha256 {pin.sha256}), laid out as in the upstream repository.\n"
        + (f"\n{pin.note}\n" if pin.note else "")
        + (f"\n{lacks_sentence(fork)}\n" if pin.lacks and pinned else "")
        + f"\n{SOURCE_TRAILER}\n" + (f"Upstream-Commit: {fork.commit}\n" if pinned else "")
    )


def lacks_sentence(fork: Fork) -> str:
    """What the pin's distribution lacks compared with the upstream tree (forks.<name>.pypi.lacks); empty if nothing."""
    pin = fork.pypi
    if pin is None or not pin.lacks:
        return ""
    return f"{pin.file} lacks, compared with {fork.ref}: {', '.join(pin.lacks)}"


def commit_distribution(repo: Path, fork: Fork, archive: Path, parent: str | None, pinned: bool) -> str:
    """Commit fork.pypi's distribution, laid out as `sync` does, on `parent` in `repo`; returns the commit.

    Built in a scratch index from a scratch folder: the repository's own index, work tree and refs stay as
    they are. The pin's distribution (`pinned`) as a root commit gives the very commit `sync` makes.
    """
    exclude_build_outputs(repo)
    with tempfile.TemporaryDirectory() as tmp:
        files = Path(tmp, "files")
        unpack(fork, archive, files)
        env = {"GIT_DIR": str(git.git_dir(repo)), "GIT_WORK_TREE": str(files),
               "GIT_INDEX_FILE": str(Path(tmp, "index"))}
        git.run(files, "add", "--all", ".", env=env)
        tree = git.out(files, "write-tree", env=env)
    parents = ("-p", parent) if parent else ()
    return git.out(repo, "commit-tree", tree, *parents, "-F", "-", input=_message(fork, pinned), env=PYPI_IDENTITY,
                   config=git.NO_SIGNING)
