"""A port: a fork's series carried to a new upstream base patch by patch, over as many sessions as it takes.

It lives beside the running series, in `third_party/patches/ports/<fork>-<to label>/`, so that it is
committed like any other file and survives the machine it was begun on:

    port.toml       where from and to, one [[patch]] per patch of the old series, in its order (and the patches
                    only the new base needs, verdict added, after the one they follow), the new pin's [pypi]
    <name>.patch    each patch carried so far (verdict ported, reworked or added), as `export` writes it
    series          those patches in order

port.toml:

    fork = "verl"
    from_ref = "v0.4.0"
    from = "<40-hex commit>"
    to_ref = "v0.6.1"
    to = "<40-hex commit>"
    upstream = "<40-hex commit>"               # a port onto a PyPI release only: the commit of its tag

    [[patch]]
    name = "run-the-megatron-workers-on-cpu"   # the old file's name without .patch
    verdict = "reworked"                       # pending | ported | reworked | dropped | obsolete
    why = "..."                                # required for reworked, dropped and obsolete

    [[session]]                                # written by `rebase`: one per sitting
    started = "2026-12-04T22:30:00Z"
    elapsed = 1820                             # seconds
    patches = 7                                # patches that got through in it

ported: its diff's changed lines are the old ones (context may have moved). reworked: they differ; the why
says what and why. dropped: upstream has its equivalent; the why names it (file, function, PR or commit).
obsolete: nothing needs it any more; the why says what went away.

A port onto a PyPI release (`rebase --onto NAME==VERSION --upstream-commit SHA`, for a fork without upstream's
git history) has `to` = the release's PyPI-derived commit, which the replay runs on, and `upstream` = the commit
of the release's tag, which the finish pins; its [pypi] names the release's sdist.

This module reads, checks and writes the directory; what goes in it is `tools.forks.rebase`'s business.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from tools.forks import manifest as manifest_mod
from tools.forks import series as series_mod
from tools.forks.series import Series

PORTS = Path("third_party/patches/ports")
PORT_FILE = "port.toml"
PENDING, PORTED, REWORKED, DROPPED, OBSOLETE = "pending", "ported", "reworked", "dropped", "obsolete"
ADDED = "added"  # new on the new base, with no patch of the old series behind it
VERDICTS = (PENDING, PORTED, REWORKED, DROPPED, OBSOLETE, ADDED)
CARRIED = (PORTED, REWORKED, ADDED)  # a patch file in the port
SKIPPED = (DROPPED, OBSOLETE)
NEEDS_WHY = (REWORKED, DROPPED, OBSOLETE, ADDED)
PLACEHOLDER = "TODO: say what changed and why (rebase --continue --why, or write it here)"
_SHA = re.compile(r"^[0-9a-f]{40}$")
_TOP = ("fork", "from_ref", "from", "to_ref", "to")
# to_note: what `to` is where it is no upstream commit (a PyPI-derived tree); upstream: then, the commit the
# finish pins (the release tag's), which no tree here holds
_OPTIONAL_TOP = ("to_note", "upstream")
_PATCH_KEYS = ("name", "verdict", "why")
_SESSION_KEYS = ("started", "elapsed", "patches")
_PYPI_KEYS = ("requirement", "file", "sha256", "note", "lacks")  # forks.toml's `pypi` for the new pin (PyPISource)


class PortError(ValueError):
    """port.toml is malformed; the message names the file, the field and the fix."""


@dataclass
class Entry:
    name: str  # the old series' file name without .patch
    verdict: str = PENDING
    why: str = ""

    @property
    def file(self) -> str:
        return f"{self.name}.patch"

    @property
    def unexplained(self) -> bool:
        """A verdict that needs a why and has only the placeholder (or a TODO) so far."""
        return self.verdict in NEEDS_WHY and (not self.why.strip() or self.why.strip().upper().startswith("TODO"))


@dataclass
class Session:
    started: str  # ISO 8601, UTC
    elapsed: int = 0  # seconds
    patches: int = 0


@dataclass
class Port:
    dir: Path
    fork: str
    from_ref: str
    from_: str
    to_ref: str
    to: str
    entries: list[Entry] = field(default_factory=list)
    sessions: list[Session] = field(default_factory=list)
    to_note: str = ""
    pypi: dict[str, str | list[str]] = field(default_factory=dict)  # the new pin's PyPI source; the finish writes it
    upstream: str = ""  # a port onto a PyPI release: the upstream commit of its tag, what the finish pins

    def entry(self, name: str) -> Entry:
        """The entry named `name` (with or without .patch); PortError naming the choices otherwise."""
        stem = name.removesuffix(".patch")
        for entry in self.entries:
            if entry.name == stem:
                return entry
        near = [e.name for e in self.entries if stem[:12] in e.name][:5]
        raise PortError(f"{self.dir / PORT_FILE}: no [[patch]] named {stem!r}"
                        + (f"; did you mean {', '.join(near)}?" if near else "; `rebase --status` lists them"))

    def count(self, verdict: str) -> int:
        return sum(e.verdict == verdict for e in self.entries)

    def carried(self) -> list[Entry]:
        return [e for e in self.entries if e.verdict in CARRIED]

    def tally(self) -> tuple[int, int, int, int]:
        """(kept, dropped, changed, added): old patches carried, old patches dropped or obsolete, those reworked,
        and the new base's own patches."""
        added = self.count(ADDED)
        return len(self.carried()) - added, len(self.entries) - len(self.carried()), self.count(REWORKED), added

    def pending(self) -> list[Entry]:
        return [e for e in self.entries if e.verdict == PENDING]

    @property
    def elapsed(self) -> int:
        return sum(s.elapsed for s in self.sessions)


def ports_dir(root: Path) -> Path:
    return root / PORTS


def dir_for(root: Path, fork: str, to_label: str) -> Path:
    return ports_dir(root) / f"{fork}-{to_label}"


def all_dirs(root: Path) -> list[Path]:
    """Every port directory (with or without a readable port.toml), sorted."""
    top = ports_dir(root)
    return sorted(p for p in top.iterdir() if p.is_dir()) if top.is_dir() else []


# ---------------------------------------------------------------- read


def load(directory: Path) -> Port:
    """Read and check port.toml; PortError names the field and the fix."""
    path = directory / PORT_FILE
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PortError(f"{path}: missing; a port directory needs it (`rebase <fork> --onto REF` writes one)"
                        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise PortError(f"{path}: not valid TOML: {exc}") from None
    _unknown(path, "", data, (*_TOP, *_OPTIONAL_TOP, "patch", "session", "pypi"))
    top = {key: _string(path, key, data.get(key)) for key in _TOP}
    for key in ("from", "to"):
        if not _SHA.match(top[key]):
            raise PortError(f"{path}: {key} = {top[key]!r} is not a 40-hex commit id; write the full id"
                            f" (`git rev-parse {top[key + '_ref']}` in the fork)")
    entries = [_entry(path, i, t) for i, t in enumerate(_tables(path, data, "patch"))]
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        if entry.name in seen:
            raise PortError(f"{path}: patch[{i}].name {entry.name!r} appears twice; keep one [[patch]] per patch")
        seen.add(entry.name)
    sessions = [_session(path, i, t) for i, t in enumerate(_tables(path, data, "session"))]
    to_note = _string(path, "to_note", data["to_note"]) if "to_note" in data else ""
    return Port(directory, top["fork"], top["from_ref"], top["from"], top["to_ref"], top["to"], entries, sessions,
                to_note, _pypi(path, data.get("pypi")), _upstream(path, data))


def _upstream(path: Path, data: dict) -> str:
    if "upstream" not in data:
        return ""
    value = _string(path, "upstream", data["upstream"])
    if not _SHA.match(value):
        raise PortError(f"{path}: upstream = {value!r} is not a 40-hex commit id; write the full id of the"
                        f" release's tag {data.get('to_ref', '')} (its release page shows it)")
    return value


def _pypi(path: Path, table) -> dict[str, str | list[str]]:
    """The optional [pypi] table: the distribution equal to the tree at `to`, as forks.toml's `pypi` names it."""
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise PortError(f"{path}: pypi must be a table ([pypi] with {', '.join(_PYPI_KEYS)})")
    _unknown(path, "pypi.", table, _PYPI_KEYS)
    values = {key: _string(path, f"pypi.{key}", table.get(key)) for key in _PYPI_KEYS[:3]}
    if "==" not in values["requirement"] or not re.fullmatch(r"[0-9a-f]{64}", values["sha256"]):
        raise PortError(f"{path}: pypi needs requirement = \"name==version\" and the file's 64-hex sha256;"
                        f" got {values['requirement']!r}, {values['sha256']!r}")
    if "note" in table:
        values["note"] = _string(path, "pypi.note", table["note"])
    if "lacks" in table:
        try:
            values["lacks"] = list(manifest_mod.lacks_paths(f"{path}: pypi.lacks", table["lacks"]))
        except manifest_mod.ManifestError as exc:
            raise PortError(str(exc)) from None
    return values


def _unknown(path: Path, where: str, table: dict, known: tuple[str, ...]) -> None:
    extra = [k for k in table if k not in known]
    if extra:
        raise PortError(f"{path}: {where}{', '.join(extra)}: unknown key(s); the known ones are"
                        f" {', '.join(known)} (a typo? delete or rename it)")


def _string(path: Path, key: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise PortError(f"{path}: {key}: missing or not a string; add `{key} = \"...\"` at the top, before"
                        " the first [[patch]]")
    return value


def _tables(path: Path, data: dict, key: str) -> list[dict]:
    tables = data.get(key, [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise PortError(f"{path}: {key}: must be [[{key}]] tables (an array of tables), one per {key}")
    return tables


def _entry(path: Path, i: int, t: dict) -> Entry:
    where = f"patch[{i}]"
    _unknown(path, f"{where}: ", t, _PATCH_KEYS)
    name = t.get("name")
    if not isinstance(name, str) or not name or "/" in name or name.endswith(".patch"):
        raise PortError(f"{path}: {where}.name: {name!r} must be the old patch's file name without .patch"
                        " (no directory)")
    where = f"{where} ({name})"
    verdict = t.get("verdict")
    if verdict not in VERDICTS:
        raise PortError(f"{path}: {where}.verdict: {verdict!r} is not one of {', '.join(VERDICTS)}")
    why = t.get("why", "")
    if not isinstance(why, str):
        raise PortError(f"{path}: {where}.why: must be a string; quote it")
    if verdict in NEEDS_WHY and not why.strip():
        hint = ("name upstream's equivalent (file:function, PR or commit)" if verdict == DROPPED else
                "say what changed and why" if verdict == REWORKED else "say what went away upstream")
        raise PortError(f"{path}: {where}.why: required for verdict {verdict}; {hint}")
    return Entry(name, verdict, why)


def _session(path: Path, i: int, t: dict) -> Session:
    where = f"session[{i}]"
    _unknown(path, f"{where}: ", t, _SESSION_KEYS)
    started = t.get("started")
    if not isinstance(started, str) or not started:
        raise PortError(f"{path}: {where}.started: missing or not a string; write an ISO time such as"
                        " \"2026-12-04T22:30:00Z\"")
    numbers = {k: t.get(k, 0) for k in ("elapsed", "patches")}
    for key, value in numbers.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PortError(f"{path}: {where}.{key}: {value!r} must be a whole number >= 0")
    return Session(started, numbers["elapsed"], numbers["patches"])


# ---------------------------------------------------------------- write


def save(port: Port) -> None:
    """Write port.toml (temp file + rename). Comments of a hand-written file do not survive."""
    lines = [
        f"# The {port.fork} series ported from {port.from_ref} to {port.to_ref}: third_party/patches/PORTING.md",
        *(f"{key} = {_quote(value)}" for key, value in zip(_TOP, _top_values(port), strict=True)),
        *([f"to_note = {_quote(port.to_note)}"] if port.to_note else []),
        *([f"upstream = {_quote(port.upstream)}"] if port.upstream else []),
    ]
    if port.pypi:
        lines += ["", "[pypi]", *(f"{key} = {_value(value)}" for key, value in port.pypi.items())]
    for entry in port.entries:
        lines += ["", "[[patch]]", f"name = {_quote(entry.name)}", f"verdict = {_quote(entry.verdict)}"]
        lines += [f"why = {_quote(entry.why)}"] if entry.why else []
    for s in port.sessions:
        lines += ["", "[[session]]", f"started = {_quote(s.started)}", f"elapsed = {s.elapsed}",
                  f"patches = {s.patches}"]
    series_mod.replace_text(port.dir / PORT_FILE, "\n".join(lines) + "\n")


def _top_values(port: Port) -> tuple[str, ...]:
    return port.fork, port.from_ref, port.from_, port.to_ref, port.to


def _value(value: str | list[str]) -> str:
    """A TOML string, or an array of them."""
    return "[" + ", ".join(map(_quote, value)) + "]" if isinstance(value, list) else _quote(value)


def _quote(text: str) -> str:
    """A TOML basic string: quote, backslash and control characters escaped."""
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    out = "".join(escapes.get(c, f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in text)
    return f'"{out}"'


def write_patch(port: Port, entry: Entry, text: str) -> None:
    series_mod.replace_text(port.dir / entry.file, text)


def write_series(port: Port, old: series_mod.Layout) -> None:
    """`series` for the carried patches, under the old series' topic headers."""
    names = [e.file for e in port.carried()]
    series_mod.replace_text(port.dir / series_mod.SERIES, series_mod.format_layout(series_mod.arrange(old, names)))


def remove_patch(port: Port, entry: Entry) -> None:
    (port.dir / entry.file).unlink(missing_ok=True)


# ---------------------------------------------------------------- lint


def problems(port: Port, cwd: Path) -> list[str]:
    """What keeps the directory from being a port its tools and reviewers can trust; empty when none."""
    found = [f"{port.dir / PORT_FILE}: {e.name}: verdict {e.verdict} has no why yet; write it (why = \"...\")"
             for e in port.entries if e.unexplained]
    carried = [e.file for e in port.carried()]
    found += [f"{port.dir / name}: missing; verdict {port.entry(name).verdict} needs the ported patch (set the"
              " verdict to pending to port it again)" for name in carried if not (port.dir / name).is_file()]
    series = Series(port.dir)
    strays = [n for n in series.files_on_disk() if n not in carried]
    found += [f"{port.dir / name}: no [[patch]] with verdict ported, reworked or added names it; delete the file"
              " or fix the verdict" for name in strays]
    if series.names() != carried:
        found.append(f"{series.series_file}: lists {series.names() or 'nothing'}, but the ported, reworked and"
                     f" added patches are {carried or 'none'} in this order; list exactly those")
    present = [series.dir / n for n in carried if (series.dir / n).is_file()]
    return found + series_mod.lint_patches(present, cwd)
