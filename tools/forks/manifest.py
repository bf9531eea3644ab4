"""`third_party/forks.toml`: the single source of truth for the pinned forks and machine stacks.

Read with the standard library (the fork tool runs before anything is installed). The few writes
(`rebase` moves a pin, `publish` records a fork remote) edit single keys in place so that comments
and layout of the hand-written file survive.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = Path("third_party/forks.toml")
PROFILES = ("npu", "cuda", "cpu")
_SHA = re.compile(r"^[0-9a-f]{40}$")
RELEASE_TAGS = "v{version}"
PYPI_KEYS = ("requirement", "file", "sha256", "note", "lacks")  # of forks.<name>.pypi (PyPISource)


class ManifestError(ValueError):
    """forks.toml is malformed; the message names the fork, the field and the fix."""


@dataclass(frozen=True)
class PyPISource:
    """A distribution on a package index whose files equal the fork's tree at the pin."""

    requirement: str  # "name==version", what users would pip install
    file: str  # exact file name on the index
    sha256: str  # of that file; verified after download
    note: str = ""  # prose: how the distribution's files differ from the tree at the pin
    # Trees (directories or files, relative to the fork's root) that the tree at the pin has and the
    # distribution lacks. `sync` names them when it lays the distribution out, `check` fails a patch that
    # touches or imports them, and tests/forks/test_real_sources.py holds them to the real sdist-to-tag difference.
    lacks: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.requirement.split("==")[0]

    @property
    def version(self) -> str:
        return self.requirement.split("==")[1]


@dataclass(frozen=True)
class Fork:
    name: str
    path: str
    url: str
    ref: str
    commit: str
    patches: str
    distribution: str
    profiles: tuple[str, ...]
    # Profiles under which `tools.forks test` runs the series' tests: `profiles`, plus any where the stack
    # does not install the fork and the tests import it from its source tree (an NPU-only fork on cpu).
    test_profiles: tuple[str, ...]
    pypi: PyPISource | None = None
    published_url: str | None = None
    published_commit: str | None = None
    release_tags: str = RELEASE_TAGS  # upstream's release tag names, {version} standing for the version
    release: str | None = None  # the release the pin follows, where `ref` is not a release tag

    @property
    def branch(self) -> str:
        """The branch inside the fork that carries the series as commits."""
        return f"recipe/{self.name}"

    @property
    def gitlink(self) -> str:
        """The commit the superproject's gitlink must point at."""
        return self.published_commit or self.commit

    @property
    def submodule_url(self) -> str:
        return self.published_url or self.url


@dataclass(frozen=True)
class Manifest:
    root: Path
    forks: dict[str, Fork]
    stack: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return self.root / MANIFEST

    def select(self, names: list[str] | None = None, profile: str | None = None, *,
               tests: bool = False) -> list[Fork]:
        """Forks by name (all when empty), optionally only those a device profile needs, or with `tests`
        those whose series' tests run under it."""
        unknown = [n for n in names or [] if n not in self.forks]
        if unknown:
            raise ManifestError(
                f"unknown fork {', '.join(unknown)}; forks.toml has: {', '.join(self.forks)}"
            )
        chosen = [self.forks[n] for n in names] if names else list(self.forks.values())
        if profile:
            if profile not in PROFILES:
                raise ManifestError(f"unknown profile {profile!r}; use one of {', '.join(PROFILES)}")
            chosen = [f for f in chosen if profile in (f.test_profiles if tests else f.profiles)]
        return chosen


def find_root(start: Path) -> Path:
    """The nearest directory at or above `start` that holds third_party/forks.toml."""
    for candidate in [start, *start.parents]:
        if (candidate / MANIFEST).is_file():
            return candidate
    raise ManifestError(
        f"no {MANIFEST} at or above {start}; run from the repository or pass --root"
    )


def load(root: Path) -> Manifest:
    path = root / MANIFEST
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{path} not found; pass --root to the repository root") from None
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: not valid TOML: {exc}") from None
    forks = {name: _fork(name, table) for name, table in data.get("forks", {}).items()}
    if not forks:
        raise ManifestError(f"{path}: no [forks.<name>] tables")
    stack = {p: {k: str(v) for k, v in t.items()} for p, t in data.get("stack", {}).items()}
    return Manifest(root=root, forks=forks, stack=stack)


def _fork(name: str, t: dict) -> Fork:
    def need(key: str) -> str:
        if key not in t or not isinstance(t[key], str) or not t[key]:
            raise ManifestError(f"forks.{name}.{key}: missing or not a string; add `{key} = \"...\"`")
        return t[key]

    commit = need("commit")
    if not _SHA.match(commit):
        raise ManifestError(f"forks.{name}.commit: {commit!r} is not a 40-hex commit id")
    profiles = tuple(t.get("profiles", ()))
    bad = [p for p in profiles if p not in PROFILES]
    if bad or not profiles:
        raise ManifestError(
            f"forks.{name}.profiles: {list(profiles)} must be a non-empty subset of {list(PROFILES)}"
        )
    test_profiles = t.get("test_profiles", list(profiles))
    if not isinstance(test_profiles, list) or not set(profiles) <= set(test_profiles) <= set(PROFILES):
        raise ManifestError(
            f"forks.{name}.test_profiles: {test_profiles!r} must list every profile of `profiles`"
            f" ({list(profiles)}), plus those of {list(PROFILES)} whose tests run from the source tree"
        )
    release_tags = t.get("release_tags", RELEASE_TAGS)
    if not isinstance(release_tags, str) or release_tags.count("{version}") != 1:
        raise ManifestError(f"forks.{name}.release_tags: {release_tags!r} must hold `{{version}}` once, where the"
                            " tag names the version (e.g. \"core_v{version}\" for core_v0.13.1)")
    release = t.get("release")
    if release is not None and not isinstance(release, str):
        raise ManifestError(f"forks.{name}.release: {release!r} is not a string; quote the version, e.g."
                            " release = \"2.1.0\"")
    pypi = None
    if "pypi" in t:
        p = t["pypi"]
        missing = [k for k in ("requirement", "file", "sha256") if k not in p]
        if missing or "==" not in p.get("requirement", ""):
            raise ManifestError(
                f"forks.{name}.pypi: needs requirement = \"name==version\", file and sha256"
                f" (missing: {', '.join(missing) or 'an exact == pin'})"
            )
        unknown = [k for k in p if k not in PYPI_KEYS]
        if unknown:
            raise ManifestError(f"forks.{name}.pypi: unknown key(s) {', '.join(unknown)}; the known ones are"
                                f" {', '.join(PYPI_KEYS)} (a typo?)")
        pypi = PyPISource(p["requirement"], p["file"], p["sha256"], p.get("note", ""),
                          lacks_paths(f"forks.{name}.pypi.lacks", p.get("lacks", [])))
    return Fork(
        name=name,
        path=need("path"),
        url=need("url"),
        ref=need("ref"),
        commit=commit,
        patches=need("patches"),
        distribution=need("distribution"),
        profiles=profiles,
        test_profiles=tuple(test_profiles),
        pypi=pypi,
        published_url=t.get("published_url"),
        published_commit=t.get("published_commit"),
        release_tags=release_tags,
        release=release,
    )


def lacks_paths(where: str, value: object) -> tuple[str, ...]:
    """A `lacks` list (forks.<name>.pypi.lacks, or port.toml's pypi.lacks, named by `where` in the error): distinct
    plain relative paths inside the fork, none under another."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ManifestError(f"{where}: {value!r} must be a list of paths relative to the fork's root, e.g."
                            ' lacks = ["pkg/sub/tree"]')
    for path in value:
        parts = path.split("/")
        if not path or path.startswith("/") or path.endswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ManifestError(f"{where}: {path!r} is not a plain relative path inside the fork; write it as"
                                ' "pkg/sub/tree" (no leading or trailing /, no . or .. parts)')
    twice = sorted({v for v in value if value.count(v) > 1})
    if twice:
        raise ManifestError(f"{where}: {', '.join(twice)} listed twice; keep one")
    nested = sorted(v for v in value for w in value if v != w and v.startswith(w + "/"))
    if nested:
        raise ManifestError(f"{where}: {', '.join(nested)} lies under another entry; keep the outer one")
    return tuple(value)


def lacked(fork: Fork, path: str) -> str | None:
    """The entry of forks.<fork>.pypi.lacks that `path` (relative to the fork's root) lies under, if any."""
    if fork.pypi is None:
        return None
    return next((t for t in fork.pypi.lacks if path == t or path.startswith(t + "/")), None)


def set_keys(path: Path, fork: str, values: dict[str, str | dict[str, str | list[str]]]) -> None:
    """Set keys of the `[forks.<fork>]` table in place, keeping every other byte: strings, or inline tables of
    strings and lists of strings (`pypi`)."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    header = f"[forks.{fork}]"
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == header)
    except StopIteration:
        raise ManifestError(f"{path}: no {header} table to update") from None
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("[")), len(lines)
    )
    remaining = dict(values)
    for i in range(start + 1, end):
        key = lines[i].split("=", 1)[0].strip()
        if key in remaining and "=" in lines[i]:
            lines[i] = f"{key} = {_toml_value(remaining.pop(key))}\n"
    last = max((i for i in range(start, end) if lines[i].strip()), default=start)
    lines[last + 1 : last + 1] = [f"{k} = {_toml_value(v)}\n" for k, v in remaining.items()]
    path.write_text("".join(lines), encoding="utf-8")


def _toml_value(value: str | list[str] | dict[str, str | list[str]]) -> str:
    """A TOML string (JSON's escapes are TOML's), an array of them, or an inline table of those."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(json.dumps(v) for v in value) + "]"
    return json.dumps(value)
