"""`upgrade-report`: each fork's series tried on upstream's next releases, as one table.

Targets follow one rule (RULE). Their names come from the fork's git tags where its history is here (a git
tree at the pin), else from the sdists of its PyPI distribution, else from the tags at its url (a git-only
fork not synced: enough to show the releases of a fork without patches). Tag names map to versions through
the fork's `release_tags` (forks.toml), the pin's version is its `ref` read the same way, or `release`.

Each target is a rehearsal (`rebase --dry-run`, tools.forks.rehearsal) of the whole series. Results go to
third_party/patches/upgrade.json; UPGRADE.md is rendered from that file and the forks' notes files alone, so
the same files give the same bytes and `--render-only` needs neither network nor sources.

A fork's notes file (NOTES, beside its series: third_party/patches/<fork>/upgrade-notes.toml; optional) holds the
project's own judgement, which no replay can give: a runbook printed above the fork's per-patch table, and one
more column of that table with a text per patch (for verl: what blocks each patch at the next releases). With a
notes file, every patch of the rehearsed series needs its text, and every text a patch: the render fails naming
the patches that break this.
"""

from __future__ import annotations

import json
import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tools.forks import git, ops, rehearsal, sources
from tools.forks.manifest import Fork, Manifest
from tools.forks.series import Series

if TYPE_CHECKING:
    from packaging.version import Version

JSON_PATH = Path("third_party/patches/upgrade.json")
NOTES = "upgrade-notes.toml"  # in a fork's patches folder: the runbook and the judgement column (optional)
NOTES_SCHEMA = 1
REPORT_PATH = Path("third_party/patches/UPGRADE.md")
SCHEMA = 1
DEFAULT_MINORS = 3
RULE = ("releases newer than the pin: the next patch release of the pin's minor series, and the newest release"
        " of each of the next {minors} minor series; finals only, unless a series has only pre-releases")
ASKED = "asked (--targets)"
REHEARSED, NOTHING, UNREACHABLE = "rehearsed", "nothing to carry", "unreachable"
NEEDING = "needs a left-out patch"
RESULTS = (rehearsal.CLEAN, rehearsal.MERGED, rehearsal.CONFLICT, rehearsal.UPSTREAM)
SHORT = {rehearsal.CLEAN: "clean", rehearsal.MERGED: "3-way", rehearsal.CONFLICT: "**conflict**",
         rehearsal.UPSTREAM: "upstream"}


# ---------------------------------------------------------------- which releases


@dataclass(frozen=True)
class Target:
    name: str  # what the rehearsal takes: a tag or commit, or NAME==VERSION
    version: str  # "" for a commit named by --targets
    picked: str  # why it is a target: the rule's reason, or ASKED


def _version(text: str) -> Version | None:
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text)
    except InvalidVersion:
        return None


def tag_version(pattern: str, tag: str) -> Version | None:
    """The version a tag names under `pattern` ("core_v{version}"), None for a tag of another form."""
    prefix, _, suffix = pattern.partition("{version}")
    if len(tag) <= len(prefix) + len(suffix) or not (tag.startswith(prefix) and tag.endswith(suffix)):
        return None
    return _version(tag[len(prefix):len(tag) - len(suffix)])


def pin_version(fork: Fork) -> Version:
    found = _version(fork.release) if fork.release else tag_version(fork.release_tags, fork.ref)
    if found is None:
        key = "release" if fork.release else "ref"
        raise ops.ForkError(f"{fork.name}: forks.{fork.name}.{key} {getattr(fork, key)!r} names no version"
                            f" (release tags read as {fork.release_tags!r}); set release = \"X.Y.Z\" in"
                            f" [forks.{fork.name}]: the release the pin is or follows")
    return found


def pick(pin: Version, releases: dict[str, Version], minors: int = DEFAULT_MINORS) -> list[Target]:
    """RULE, over `releases` (name -> version): the next patch release, then the next `minors` minor series."""
    series: dict[tuple[int, int], list[tuple[Version, str]]] = {}
    for version, name in sorted((v, n) for n, v in releases.items() if v > pin):
        series.setdefault((version.major, version.minor), []).append((version, name))
    chosen = []
    patches: dict[int, list[tuple[Version, str]]] = {}
    for version, name in series.pop((pin.major, pin.minor), []):
        patches.setdefault(version.micro, []).append((version, name))
    if patches:
        chosen.append(_newest(patches[min(patches)], f"next patch of {pin.major}.{pin.minor}"))
    for major, minor in sorted(series)[:minors]:
        chosen.append(_newest(series[major, minor], f"newest of {major}.{minor}"))
    return chosen


def _newest(members: list[tuple[Version, str]], why: str) -> Target:
    """The newest final of a series, else (a series of pre-releases only) its newest pre-release."""
    finals = [m for m in members if not m[0].is_prerelease]
    version, name = max(finals or members)
    return Target(name, str(version), why if finals else f"{why}, pre-releases only")


@dataclass
class Plan:
    """One fork's targets, or why it has none."""

    fork: Fork
    minors: int
    pin: str = ""  # the pin's version
    origin: str = ""  # where the releases were found
    targets: list[Target] = field(default_factory=list)
    error: str = ""


def plan(root: Path, fork: Fork, minors: int, asked: tuple[list[str], bool] | None,
         index_urls: list[str], find_links: list[Path]) -> Plan:
    """The fork's targets by RULE; `asked` (refs, add) replaces them, or with `add` joins them."""
    result = Plan(fork, minors)
    try:
        pin = pin_version(fork)
        result.pin = str(pin)
        if asked and not asked[1]:
            result.origin, result.targets = "--targets", [_asked(fork, ref) for ref in asked[0]]
            return result
        result.origin, found = _releases(root, fork, index_urls, find_links)
    except (ops.ForkError, git.GitError) as exc:
        result.error = str(exc)
        return result
    result.targets = pick(pin, found, minors)
    if asked:
        have = {t.name for t in result.targets}
        result.targets = sorted(result.targets + [_asked(fork, ref) for ref in asked[0] if ref not in have],
                                key=_oldest_first)
    return result


def _oldest_first(target: Target) -> tuple:
    """Targets by version; a commit (no version) last."""
    version = _version(target.version)
    return (0, version, target.name) if version else (1, target.name)


def _asked(fork: Fork, ref: str) -> Target:
    version = ref.partition("==")[2] if "==" in ref else tag_version(fork.release_tags, ref)
    return Target(ref, str(version or ""), ASKED)


def _releases(root: Path, fork: Fork, index_urls: list[str], find_links: list[Path]) -> tuple[str, dict]:
    """(where, name -> version) of the fork's releases: its git tags, else its PyPI sdists, else the url's tags."""
    st = ops.state(root, fork)
    if st.source == "git" and st.base:
        return f"git tags of {fork.path}", _tagged(fork, git.tags(st.path))
    if fork.pypi:
        versions, tried = sources.releases(fork, index_urls, find_links)
        if not versions:
            raise ops.ForkError(f"{fork.name}: no sdist of {fork.pypi.name} in {', '.join(tried)}; pass --index-url"
                                " for a reachable index or --find-links DIR holding its sdists")
        return "PyPI sdists", {f"{fork.pypi.name}=={v}": _version(v) for v in versions}
    try:
        tags = git.remote_tags(root, fork.url, config=sources.ALLOW_LOCAL)
    except git.GitError as exc:
        raise ops.ForkError(f"{fork.name}: no git tree here, no PyPI source, and the tags at {fork.url} cannot be"
                            f" listed ({exc.stderr.splitlines()[-1] if exc.stderr else exc}); run"
                            f" `python -m tools.forks sync {fork.name}` or give git a mirror") from None
    return f"git tags at {fork.url}", _tagged(fork, tags)


def _tagged(fork: Fork, tags: list[str]) -> dict[str, Version]:
    versions = {tag: tag_version(fork.release_tags, tag) for tag in tags}
    return {tag: v for tag, v in versions.items() if v is not None}


# ---------------------------------------------------------------- trying them


def try_target(root: Path, fork: Fork, target: Target, index_urls: list[str], find_links: list[Path],
               today: str) -> dict:
    """One target's entry of upgrade.json: its rehearsal, or why there is none."""
    entry = {"target": target.name, "version": target.version, "picked": target.picked, "date": today}
    listed = f"PyPI {target.name}" if "==" in target.name else f"git {target.name}"
    if not Series(root / fork.patches).names():
        tree = root / fork.path
        commit = git.resolve(tree, target.name) if "==" not in target.name and git.is_repo_root(tree) else None
        source = f"{listed} @ {commit[:12]}" if commit else listed
        return {**entry, "source": source, "status": NOTHING, "why": "0 patches: nothing to carry"}
    try:
        r = rehearsal.rehearse(root, fork, target.name, index_urls, find_links)
    except (ops.ForkError, git.GitError) as exc:
        why = str(exc).splitlines()[0].removeprefix(f"{fork.name}: ")
        return {**entry, "source": listed, "status": UNREACHABLE, "why": why}
    source = f"PyPI sdist {r.new.pypi.file}" if r.new.pypi else f"git {target.name} @ {r.new.commit[:12]}"
    counts = {result: r.count(result) for result in RESULTS}
    counts[NEEDING] = sum(bool(o.needs) for o in r.outcomes)
    patches = [{"patch": o.patch, "result": o.result, "needs": o.needs, "detail": o.detail(hunks=False)}
               for o in r.outcomes]
    return {**entry, "source": source, "status": REHEARSED, "counts": counts, "patches": patches}


Track = Callable[[list, Callable[[object], str]], Iterable]


def run(root: Path, plans: list[Plan], index_urls: list[str], find_links: list[Path], today: str,
        track: Track = lambda jobs, label: jobs, clock: Callable[[], float] = time.monotonic) -> dict[str, dict]:
    """Try every planned target (through `track`, a progress display); returns upgrade.json's fork entries,
    each target's with `seconds`, the wall time its replay took (fetching the sdist or tag included)."""
    jobs = [(p, t) for p in plans for t in p.targets]
    tried: dict[str, list[dict]] = {p.fork.name: [] for p in plans}
    for p, target in track(jobs, lambda job: f"{job[0].fork.name} {job[1].name}"):
        started = clock()
        entry = try_target(root, p.fork, target, index_urls, find_links, today)
        tried[p.fork.name].append({**entry, "seconds": round(clock() - started)})
    return {p.fork.name: _fork_entry(root, p, tried[p.fork.name]) for p in plans}


def _fork_entry(root: Path, p: Plan, targets: list[dict]) -> dict:
    pin = {"ref": p.fork.ref, "commit": p.fork.commit, "version": p.pin}
    return {"pin": pin, "patches": len(Series(root / p.fork.patches).names()), "rule": RULE.format(minors=p.minors),
            "targets_from": p.origin, "error": p.error, "targets": targets}


# ---------------------------------------------------------------- the files


def load(root: Path) -> dict:
    path = root / JSON_PATH
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ops.ForkError(f"{JSON_PATH} not found; run `python -m tools.forks upgrade-report` first") from None
    except json.JSONDecodeError as exc:
        raise ops.ForkError(f"{JSON_PATH}: not JSON ({exc}); run `python -m tools.forks upgrade-report`") from None
    if doc.get("schema") != SCHEMA or not isinstance(doc.get("forks"), dict):
        raise ops.ForkError(f"{JSON_PATH}: schema {doc.get('schema')!r}, not {SCHEMA}; run"
                            " `python -m tools.forks upgrade-report` to write it again")
    return doc


def write(manifest: Manifest, entries: dict[str, dict]) -> dict:
    """Merge the forks just run into upgrade.json (others keep their rows), then render UPGRADE.md."""
    root = manifest.root
    earlier = load(root)["forks"] if (root / JSON_PATH).is_file() else {}
    merged = {**earlier, **entries}
    doc = {"schema": SCHEMA, "forks": {name: merged[name] for name in manifest.forks if name in merged}}
    rehearsal.replace_file(root / JSON_PATH, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    try:
        text = render(doc, load_notes(manifest))
    except ops.ForkError as exc:  # the replays are kept: only the render needs doing again
        raise ops.ForkError(f"{exc}\n{JSON_PATH} is written, {REPORT_PATH} is not: fix that, then run"
                            " `python -m tools.forks upgrade-report --render-only`") from None
    rehearsal.replace_file(root / REPORT_PATH, text)
    return doc


def render_only(manifest: Manifest) -> dict:
    doc = load(manifest.root)
    rehearsal.replace_file(manifest.root / REPORT_PATH, render(doc, load_notes(manifest)))
    return doc


@dataclass(frozen=True)
class Notes:
    """A fork's notes file: the project's judgement per patch, and the runbook above its table."""

    path: str  # as named in errors, relative to the repository root
    column: str  # the judgement column's header
    texts: dict[str, str]  # patch name (no .patch) -> its cell
    runbook: str = ""  # Markdown, printed above the fork's per-patch table


def load_notes(manifest: Manifest) -> dict[str, Notes]:
    """The notes files of the manifest's forks that have one (NOTES in their patches folder), by fork name."""
    found = {}
    for name, fork in manifest.forks.items():
        path = Path(fork.patches) / NOTES
        if (manifest.root / path).is_file():
            found[name] = read_notes(manifest.root / path, str(path))
    return found


def read_notes(path: Path, shown: str) -> Notes:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ops.ForkError(f"{shown}: not TOML ({exc})") from None
    if data.get("schema") != NOTES_SCHEMA:
        raise ops.ForkError(f"{shown}: schema {data.get('schema')!r}, not {NOTES_SCHEMA}")
    unknown = sorted(set(data) - {"schema", "column", "runbook", "patches"})
    column, runbook, patches = data.get("column"), data.get("runbook", ""), data.get("patches", {})
    if unknown or not isinstance(column, str) or not column.strip() or not isinstance(runbook, str) \
            or not isinstance(patches, dict):
        raise ops.ForkError(f"{shown}: write schema = {NOTES_SCHEMA}, column = \"<header>\", optionally runbook ="
                            " \"\"\"<Markdown>\"\"\", and a [patches.<name>] table per patch"
                            + (f" (unknown keys: {', '.join(unknown)})" if unknown else ""))
    texts = {}
    for name, entry in patches.items():
        text = entry.get("blocks") if isinstance(entry, dict) else None
        if not isinstance(text, str) or not text.strip() or not isinstance(entry.get("basis"), str):
            raise ops.ForkError(f"{shown}: [patches.{name}] needs blocks = \"<judgement>\" and basis ="
                                " \"<where it comes from>\"")
        texts[name.removesuffix(".patch")] = " ".join(text.split())  # one table cell
    return Notes(shown, column.strip(), texts, runbook.strip())


# ---------------------------------------------------------------- the report

COLUMNS = ("fork", "pin", "target", "picked as", "source", "clean", "3-way", "conflict", "upstream",
           "needs left-out", "conflicting patches", "took", "checked")


def rows(doc: dict) -> list[tuple[str, ...]]:
    """The table: one row per fork and target; a fork without targets gets one row saying why."""
    table = []
    for name, f in doc["forks"].items():
        pin = f["pin"]["ref"]
        if not f["targets"]:
            why = f["error"] or f"no release newer than {f['pin']['version']} in {f['targets_from']}"
            table.append((name, pin, "-", "-", "-", *["-"] * 5, f"no target: {why}", "-", "-"))
        for t in f["targets"]:
            if t["status"] == REHEARSED:
                counts = [str(t["counts"][key]) for key in (*RESULTS, NEEDING)]
                conflicts = ", ".join(_short(p["patch"]) for p in t["patches"] if p["result"] == rehearsal.CONFLICT)
                note = conflicts or "none"
            else:
                counts, note = ["-"] * 5, t["why"] if t["status"] == NOTHING else f"unreachable: {t['why']}"
            table.append((name, pin, t["target"], t["picked"], t["source"], *counts, note, took(t.get("seconds")),
                          t["date"]))
    return table


def took(seconds: int | None) -> str:
    """A target's wall time as the rebase report writes times ("20 min 33 s"); "-" where a run did not record it."""
    if seconds is None:
        return "-"
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"


def cheapest(doc: dict) -> list[tuple[str, ...]]:
    """Per fork, the target with the fewest conflicts (then fewest patches needing a left-out one, then fewest
    3-way merges; the newest of equals, so any target of a fork without patches is its newest):
    (fork, pin, target, conflicts, patches dropped as already upstream)."""
    found = []
    for name, f in doc["forks"].items():
        done = [t for t in f["targets"] if t["status"] in (REHEARSED, NOTHING)]
        if done:
            best = min(reversed(done), key=_cost)  # targets are oldest first: min keeps the first, the newest
            counts = best.get("counts", {})
            found.append((name, f["pin"]["ref"], best["target"], str(counts.get(rehearsal.CONFLICT, 0)),
                          f"{counts.get(rehearsal.UPSTREAM, 0)} of {f['patches']}"))
    return found


def _cost(target: dict) -> tuple[int, int, int]:
    counts = target.get("counts", {})  # none where there is nothing to carry
    return tuple(counts.get(key, 0) for key in (rehearsal.CONFLICT, NEEDING, rehearsal.MERGED))


def _short(patch: str) -> str:
    return patch.removesuffix(".patch")


def _table(header: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in body)]


def _matrix(name: str, f: dict, notes: Notes | None = None) -> list[str]:
    """Each patch (rows) on each rehearsed target (columns); a patch needing a left-out one names its number.
    With the fork's notes, their column last; every patch needs its text and every text a patch."""
    done = [t for t in f["targets"] if t["status"] == REHEARSED]
    names = [p["patch"] for p in done[0]["patches"]]
    number = {patch: str(i) for i, patch in enumerate(names, 1)}
    if notes:
        _check_notes(name, [_short(n) for n in names], notes)
    body = []
    for i, patch in enumerate(names):
        cells = []
        for t in done:
            p = t["patches"][i]
            needs = f" (needs {', '.join(number[n] for n in p['needs'])})" if p["needs"] else ""
            cells.append(SHORT[p["result"]] + needs)
        if notes:
            cells.append(notes.texts[_short(patch)])
        body.append((str(i + 1), _short(patch), *cells))
    return _table(("#", "patch", *(t["target"] for t in done), *([notes.column] if notes else [])), body)


def _check_notes(fork: str, patches: list[str], notes: Notes) -> None:
    missing = [p for p in patches if p not in notes.texts]
    stale = sorted(set(notes.texts) - set(patches))
    if missing or stale:
        parts = ([f"no judgement for {', '.join(missing)}"] if missing else []) \
            + ([f"judgements for patches not in the series: {', '.join(stale)}"] if stale else [])
        raise ops.ForkError(f"{notes.path}: {'; '.join(parts)}. Every patch of {fork}'s series (as upgrade.json"
                            f" recorded it) needs a [patches.<name>] entry there, and only those: add or rename the"
                            f" entries, or run `python -m tools.forks upgrade-report {fork}` again after the series"
                            " changed")


def render(doc: dict, notes: dict[str, Notes] | None = None) -> str:
    """UPGRADE.md from upgrade.json's document and the forks' notes (by fork name): the same input, the same bytes."""
    notes = notes or {}
    lines = [
        "# Upgrade report: our series on upstream's next releases",
        "",
        "Written by `nox -s upgrade-report` (`python -m tools.forks upgrade-report`) from `upgrade.json` and, for a"
        f" fork that has one, `<fork>/{NOTES}` (a runbook above its per-patch table and the project's judgement per"
        " patch, in the table's last column); `python -m tools.forks upgrade-report --render-only` writes it again"
        " from those files. Each target is `python -m tools.forks rebase <fork> --onto <target> --dry-run`: the"
        " whole series replayed in a scratch repository, nothing changed; \"took\" is its wall time. Patches are"
        " named by their file in third_party/patches/<fork>/, less `.patch`.",
        "",
        "## Cheapest move per fork",
        "",
        "Fewest conflicts, then fewest patches needing a left-out one, then fewest 3-way merges; the newest of"
        " equals. Dropped: our patches already upstream there.",
        "",
        *_table(("fork", "pin", "cheapest target", "conflicts", "dropped"), cheapest(doc)),
        "",
        "## Every target",
        "",
        *(f"Targets: {rule}." for rule in dict.fromkeys(f["rule"] for f in doc["forks"].values())),
        "Releases from: " + "; ".join(f"{name}: {f['targets_from'] or '-'}" for name, f in doc["forks"].items())
        + ".",
        "",
        *_table(COLUMNS, rows(doc)),
        "",
    ]
    for name, f in doc["forks"].items():
        if any(t["status"] == REHEARSED for t in f["targets"]):
            runbook = [notes[name].runbook, ""] if name in notes and notes[name].runbook else []
            lines += [f"## {name}: each patch per target", "", *runbook, *_matrix(name, f, notes.get(name)), ""]
    lines += [rehearsal.LEGEND, ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- --targets


def parse_targets(specs: list[str], forks: list[Fork]) -> dict[str, tuple[list[str], bool]]:
    """`FORK=REF,...` (replaces the rule's targets) or `FORK=+REF,...` (adds to them) -> name: (refs, add)."""
    names = [f.name for f in forks]
    asked: dict[str, tuple[list[str], bool]] = {}
    for spec in specs:
        name, _, refs = spec.partition("=")
        add = refs.startswith("+")
        refs_list = [r for r in refs.removeprefix("+").split(",") if r]
        if name not in names or not refs_list or name in asked:
            why = "given twice" if name in asked else f"FORK must be one of {', '.join(names)} and REF given"
            raise ops.ForkError(f"--targets {spec!r}: {why}; write FORK=REF[,REF...] to replace the rule's"
                                " targets or FORK=+REF[,REF...] to add to them (REF: tag, commit or NAME==VERSION)")
        asked[name] = (refs_list, add)
    return asked


def plans(root: Path, forks: list[Fork], minors: int, specs: list[str], index_urls: list[str],
          find_links: list[Path]) -> list[Plan]:
    if minors < 0:
        raise ops.ForkError(f"--minors {minors}: give 0 or more minor series to try")
    asked = parse_targets(specs, forks)
    return [plan(root, f, minors, asked.get(f.name), index_urls, find_links) for f in forks]

