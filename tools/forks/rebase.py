"""`rebase`: carry a fork's series to a new upstream base, through a port directory that outlives the machine.

The port (`tools.forks.port`, third_party/patches/ports/<fork>-<to>/) is the record: each patch that gets
through is written there at once with its verdict, so `git add third_party/patches/ports && git commit` saves
the work at any point. `rebase --onto REF` with a port for REF replays the patches it carries, skips the
dropped and obsolete ones and goes on with the first pending patch of the old series.

The replay runs on a scratch branch (`recipe/<fork>-rebase`); `recipe/<fork>`, the series, the pin and the
gitlink change only once no patch is pending and every verdict has its why. A conflict stops the replay with
this machine's state in `<git dir>/recipe-rebase.json`: go on with `--continue [--why]`, skip the patch with
`--drop NAME --why` (or `--obsolete`), or undo with `--abort`. git rerere is on in the fork (its own config and
git dir), so a resolution made before an `--abort` is offered again on the next try.
`--dry-run` is `tools.forks.rehearsal`: the whole replay in a scratch repository.

`--onto NAME==VERSION --upstream-commit SHA` rebases a fork without upstream's git history (vLLM: PyPI sdists
only) onto a PyPI release. The new base is the release's sdist laid out on the pin's PyPI-derived commit (what
the dry run builds; the same files give the same id), the port's `upstream` keeps SHA (the commit of the
release's tag), and the finish pins SHA with the release's sdist as the fork's `pypi`, the branch moved onto
the root commit `sync` makes of that sdist.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from tools.forks import git, ops, sources
from tools.forks import manifest as manifest_mod
from tools.forks import port as port_mod
from tools.forks import series as series_mod
from tools.forks.manifest import Fork, PyPISource
from tools.forks.port import Entry, Port
from tools.forks.series import Series

STATE_FILE = "recipe-rebase.json"
CLEAN, MERGED, CONFLICT = "clean", "3-way", "conflict"
Say = Callable[[str], None]


class RebaseStopped(ops.ForkError):
    """The replay stopped (a conflict, or whys to write); the message says where and how to go on."""


@dataclass(frozen=True)
class Drop:
    """`--drop NAME --why TEXT [--obsolete]`."""

    name: str
    why: str
    verdict: str = port_mod.DROPPED


@dataclass(frozen=True)
class Onto:
    """Where a rebase goes, in the fork's repository."""

    ref: str  # the port's to_ref: the tag or commit named, or the release's tag
    commit: str  # the new base: that commit, or the release's PyPI-derived commit
    since: str  # where upstream's changes start: the pin, or its PyPI-derived commit
    upstream: str = ""  # a release: the upstream commit of its tag, what the finish pins
    pypi: PyPISource | None = None  # a release: its sdist
    location: str = ""  # a release: where its sdist was found


def _state_path(repo: Path) -> Path:
    return git.git_dir(repo) / STATE_FILE


def _scratch(fork: Fork) -> str:
    return f"{fork.branch}-rebase"


def is_release(onto: str) -> bool:
    """`--onto NAME==VERSION` names a PyPI release; anything else, a git tag or commit."""
    return "==" in onto


def release_tag(fork: Fork, version: str) -> str:
    """Upstream's tag of a release (forks.toml's release_tags, "v{version}" unless given)."""
    return fork.release_tags.format(version=version)


def _quiet(_line: str) -> None:
    pass


# ---------------------------------------------------------------- start


def start(root: Path, fork: Fork, onto: str, say: Say = _quiet, drop: Drop | None = None, upstream: str = "",
          index_urls: list[str] = (), find_links: list[Path] = ()) -> str:
    """Start or pick up the port for `onto`: a tag or commit, or NAME==VERSION with the upstream commit of its
    tag (`upstream`, else the port's), the release found on `index_urls` or in `find_links`."""
    st = _startable(root, fork, onto)
    if is_release(onto):
        target = _release(root, st, onto, upstream, index_urls, find_links)
    else:
        target = Onto(onto, git.resolve(st.path, onto) or _fetch(st.path, fork, onto), st.base)
    port = _open_port(root, fork, st, target, say)
    if drop:
        _mark(root, fork, port, load_entry(port, drop.name), drop)
    port.sessions.append(port_mod.Session(_now()))
    data = {
        "fork": fork.name,
        "port": str(port.dir.relative_to(root)),
        "to_ref": onto,
        "old_tip": st.tip,
        "old_base": st.base,
        "upstream": git.patch_ids_of_range(st.path, f"{target.since}..{target.commit}"),
        "release_location": target.location,
        "current": None,
        "stopped_at": None,
        "conflicts": [],
        "session": len(port.sessions) - 1,
        "clock": time.time(),
    }
    _save_port(port, data)
    git.enable_rerere(st.path)
    git.run(st.path, "checkout", "--quiet", "-B", _scratch(fork), target.commit)
    return _replay(root, fork, st.path, data, port, 0, say)


def _startable(root: Path, fork: Fork, onto: str) -> ops.State:
    st = ops.state(root, fork)
    if is_release(onto) and fork.pypi is None:
        raise ops.ForkError(f"{fork.name}: --onto {onto} names a PyPI release, but forks.{fork.name} has no `pypi`"
                            " (no pinned sdist to lay the release on); name a git tag or commit")
    ops._require_present(st)
    if st.source != "git" and not is_release(onto):
        release = f"; or name a PyPI release: --onto {fork.pypi.name}==<version> --upstream-commit SHA" if fork.pypi \
            else ""
        raise ops.ForkError(f"{fork.name}: --onto {onto} needs the upstream history; this tree is {st.source}."
                            f" Run `python -m tools.forks sync {fork.name} --source git --force` first{release}")
    if _state_path(st.path).exists():
        raise ops.ForkError(f"{fork.name}: a rebase is already under way; use --continue, --drop or --abort"
                            f" (`python -m tools.forks rebase {fork.name} --status` says where it stopped)")
    ops._require_no_local_work(st)
    if not ops.is_current(st):
        raise ops.ForkError(f"{fork.name}: {fork.branch} is not the series on disk; run"
                            f" `python -m tools.forks apply {fork.name}` first")
    return st


def _fetch(repo: Path, fork: Fork, onto: str) -> str:
    for spec in (f"refs/tags/{onto}:refs/tags/{onto}", onto):
        proc = git.run(repo, "fetch", "--quiet", fork.url, spec, config=ops.sources.ALLOW_LOCAL, check=False)
        sha = git.resolve(repo, onto) or (git.resolve(repo, "FETCH_HEAD") if proc.returncode == 0 else None)
        if sha:
            return sha
    raise ops.ForkError(f"{fork.name}: {onto!r} is neither a commit in {fork.path} nor fetchable from"
                        f" {fork.url}; fetch it there first or name a tag or commit that exists")


def _release(root: Path, st: ops.State, onto: str, given: str, index_urls: list[str],
             find_links: list[Path]) -> Onto:
    """`--onto NAME==VERSION`: the release's sdist laid out on the pin's PyPI-derived commit, in the fork."""
    fork = st.fork
    try:
        target, location = sources.find_release(fork, onto, index_urls, find_links)
        tag = release_tag(fork, target.version)
        upstream = _upstream_commit(root, fork, onto, tag, given)
        pin, commit = _release_base(st, target, location, index_urls, find_links)
    except sources.SourceError as exc:
        raise ops.ForkError(str(exc)) from None
    return Onto(tag, commit, pin, upstream, target, location)


def _release_base(st: ops.State, target: PyPISource, location: str, index_urls: list[str],
                  find_links: list[Path]) -> tuple[str, str]:
    """(the pin's PyPI-derived commit, the release `target`'s on top of it), in the fork's repository."""
    pin = st.base if st.source == "pypi" else pin_commit(st.path, st.fork, index_urls, find_links)
    return pin, release_commit(st.path, st.fork, target, location, pin)


def pin_commit(repo: Path, fork: Fork, index_urls: list[str], find_links: list[Path]) -> str:
    """The pin's sdist as the root commit `sync` makes of it, in `repo`."""
    archive = sources.download(fork, sources.find_distribution(fork, index_urls, find_links))
    return sources.commit_distribution(repo, fork, archive, parent=None, pinned=True)


def release_commit(repo: Path, fork: Fork, target: PyPISource, location: str, parent: str) -> str:
    """The release `target` (found at `location`) laid out on `parent` as a PyPI-derived commit of `repo`."""
    to_target = replace(fork, pypi=target)
    archive = sources.download(to_target, location)
    return sources.commit_distribution(repo, to_target, archive, parent=parent, pinned=False)


def _upstream_commit(root: Path, fork: Fork, onto: str, tag: str, given: str) -> str:
    """The commit of the release's tag: `given` (--upstream-commit), else the port's `upstream`; they agree."""
    directory = port_mod.dir_for(root, fork.name, _label(tag))
    kept = load_port(directory).upstream if (directory / port_mod.PORT_FILE).exists() else ""
    given = given.lower()
    if given and not re.fullmatch(r"[0-9a-f]{40}", given):
        raise ops.ForkError(f"{fork.name}: --upstream-commit {given!r} is not a 40-hex commit id; copy the full id"
                            f" of {tag}")
    if given and kept and given != kept:
        raise ops.ForkError(f"{directory / port_mod.PORT_FILE}: upstream = {kept}, the commit of {tag} the port"
                            f" began with, but --upstream-commit says {given}; check {tag}'s commit, then fix"
                            " `upstream` there, or leave --upstream-commit out")
    if not (given or kept):
        page = f" ({fork.url.removesuffix('.git')}/releases/tag/{tag})" if "github.com" in fork.url else ""
        raise ops.ForkError(f"{fork.name}: --onto {onto} is a PyPI release, and forks.toml pins the upstream commit"
                            f" of its tag {tag}, which no sdist carries. Pass --upstream-commit SHA, the full"
                            f" 40-hex commit of {tag}: its release page shows it{page}, or `git ls-remote"
                            f" {fork.url} 'refs/tags/{tag}^{{}}'` where that URL is reachable. The port keeps it:"
                            " once is enough")
    return given or kept


def _open_port(root: Path, fork: Fork, st: ops.State, target: Onto, say: Say) -> Port:
    """The port for `target`: read and matched with the old series where it exists, else begun (all pending)."""
    directory = port_mod.dir_for(root, fork.name, _label(target.ref))
    old = [name.removesuffix(".patch") for name in st.series.names()]
    if not (directory / port_mod.PORT_FILE).exists():
        port = Port(directory, fork.name, fork.ref, fork.commit, target.ref, target.commit, [Entry(n) for n in old],
                    to_note=_to_note(target))
        _keep_release(port, target)
        port_mod.write_series(port, st.series.layout())
        say(f"{fork.name}: new port {directory.relative_to(root)} ({len(old)} patches pending)")
        return port
    port = load_port(directory)
    _require_matches(port, fork, st, target.commit)
    _keep_release(port, target)
    _follow_series(port, old, say)
    counts = ", ".join(f"{v} {port.count(v)}" for v in port_mod.VERDICTS if port.count(v))
    say(f"{fork.name}: port {directory.relative_to(root)} ({counts})")
    return port


def load_port(directory: Path) -> Port:
    try:
        return port_mod.load(directory)
    except port_mod.PortError as exc:
        raise ops.ForkError(str(exc)) from None


def _require_matches(port: Port, fork: Fork, st: ops.State, new_base: str) -> None:
    where = port.dir / port_mod.PORT_FILE
    if port.fork != fork.name:
        raise ops.ForkError(f"{where}: fork = {port.fork!r}, but it sits where {fork.name}'s port goes; fix `fork`")
    if port.from_ not in (fork.commit, st.base):  # a PyPI tree's base is the pin's PyPI-derived commit
        raise ops.ForkError(f"{where}: the port starts from {port.from_ref} ({port.from_[:12]}), the pin is"
                            f" {fork.ref} ({fork.commit[:12]}); set the pin back, or move the port away to begin"
                            " anew")
    if port.to != new_base:
        raise ops.ForkError(f"{where}: to = {port.to[:12]}, but {port.to_ref} is {new_base[:12]} here (a moved"
                            " tag?); fix `to`, or move the port away to begin anew")


def _to_note(target: Onto) -> str:
    if not target.upstream:
        return ""
    return (f"to is not upstream's {target.ref} commit ({target.upstream}, `upstream`, what the finish pins): it is"
            f" the PyPI-derived commit of {target.pypi.file} (sha256 {target.pypi.sha256}), laid out on the pin's"
            f" PyPI-derived commit {target.since} as `rebase --dry-run` builds it; the same files give the same id.")


def _keep_release(port: Port, target: Onto) -> None:
    """A release's upstream commit and sdist go into port.toml, for --continue, other machines and the finish."""
    if not target.upstream:
        return
    found = {"requirement": target.pypi.requirement, "file": target.pypi.file, "sha256": target.pypi.sha256}
    if port.pypi and (port.pypi["file"], port.pypi["sha256"]) != (found["file"], found["sha256"]):
        raise ops.ForkError(f"{port.dir / port_mod.PORT_FILE}: [pypi] names {port.pypi['file']} (sha256"
                            f" {port.pypi['sha256']}), but {found['requirement']} is {found['file']} (sha256"
                            f" {found['sha256']}); fix [pypi] or delete it (the release's sdist goes there)")
    port.upstream, port.pypi = target.upstream, port.pypi or found


def _follow_series(port: Port, old: list[str], say: Say) -> None:
    """Order the port's entries as the old series, new patches of the series (merged meanwhile) pending."""
    gone = [e.name for e in port.entries if e.name not in old and e.verdict != port_mod.ADDED]
    if gone:
        raise ops.ForkError(f"{port.dir / port_mod.PORT_FILE}: {', '.join(gone)} no longer in the {port.fork}"
                            " series; restore them there, or delete their [[patch]] tables (and files) here")
    by_name = {e.name: e for e in port.entries if e.verdict != port_mod.ADDED}
    added = [n for n in old if n not in by_name]
    ordered = [by_name.get(n) or Entry(n) for n in old]
    for i, entry in enumerate(port.entries):  # the port's own patches stay after the entry they follow
        if entry.verdict == port_mod.ADDED:
            before = port.entries[i - 1].name if i else None
            ordered.insert(next((k + 1 for k, e in enumerate(ordered) if e.name == before), 0), entry)
    port.entries = ordered
    if added:
        say(f"{port.fork}: pending, new in the series since the port began: {', '.join(added)}")


# ---------------------------------------------------------------- replay


def _replay(root: Path, fork: Fork, repo: Path, data: dict, port: Port, first: int, say: Say) -> str:
    total = len(port.entries)
    for i in range(first, total):
        entry = port.entries[i]
        if entry.verdict in port_mod.SKIPPED:
            say(f"[{i + 1}/{total}] {entry.name}: {entry.verdict}")
        elif entry.verdict in port_mod.CARRIED:
            how = _attempt(root, fork, repo, data, port, i, port.dir / entry.file, say)
            if how == MERGED:  # its context moved (a patch before it was reworked): the port keeps what applies
                port_mod.write_patch(port, entry, git.format_patch(repo, git.out(repo, "rev-parse", "HEAD")))
            say(f"[{i + 1}/{total}] {entry.name}: {how}, {entry.verdict} (from the port)")
        else:
            _take(root, fork, repo, data, port, i, say)
    return _finish_or_wait(root, fork, repo, data, port)


def _take(root: Path, fork: Fork, repo: Path, data: dict, port: Port, i: int, say: Say) -> None:
    """A pending patch of the old series: dropped when upstream has it, else applied and recorded."""
    entry, total = port.entries[i], len(port.entries)
    path = root / fork.patches / entry.file
    landed = data["upstream"].get(git.patch_id(repo, path.read_text(encoding="utf-8")) or "")
    if landed:
        subject = git.out(repo, "log", "-1", "--format=%s", landed)
        _mark(root, fork, port, entry, Drop(entry.name, f"already upstream as {landed[:12]} ({subject})"))
        _save_port(port, data, decided=1)
        say(f"[{i + 1}/{total}] {entry.name}: dropped (already upstream as {landed[:12]})")
        return
    before = git.out(repo, "rev-parse", "HEAD")
    how = _attempt(root, fork, repo, data, port, i, path, say)
    _record(root, fork, repo, port, entry, before, None)
    _save_port(port, data, decided=1)
    verdict = {port_mod.PORTED: "", port_mod.REWORKED: ", reworked (its changed lines differ)",
               port_mod.DROPPED: " -> dropped (emptied by the replay)"}[entry.verdict]
    say(f"[{i + 1}/{total}] {entry.name}: {how}{verdict}")


def _attempt(root: Path, fork: Fork, repo: Path, data: dict, port: Port, i: int, path: Path, say: Say) -> str:
    """`git am --3way` one patch: CLEAN or MERGED, or stop the replay on a conflict."""
    before = git.out(repo, "rev-parse", "HEAD")
    as_is = git.run(repo, "apply", "--check", str(path), check=False).returncode == 0
    proc = git.run(repo, *ops.AM_OPTIONS, str(path), env=git.TOOL_IDENTITY, config=git.NO_SIGNING, check=False)
    if proc.returncode == 0:
        return CLEAN if as_is else MERGED
    entry = port.entries[i]
    data.update(current=entry.name, stopped_at=before, conflicts=git.unmerged_paths(repo))
    _save_state(repo, data)
    _save_port(port, data)
    say(f"[{i + 1}/{len(port.entries)}] {entry.name}: {CONFLICT}")
    origin = "the port's copy" if path.parent == port.dir else "from the old series"
    raise RebaseStopped(_stop_message(fork, repo, data, entry, origin, proc))


def _stop_message(fork: Fork, repo: Path, data: dict, entry: Entry, origin: str, proc) -> str:
    cmd = f"python -m tools.forks rebase {fork.name}"
    if data["conflicts"]:
        head = (f"{fork.name}: {entry.file} conflicts with {data['to_ref']} in {', '.join(data['conflicts'])}"
                f" ({origin}).\n  resolve the files in {repo}, `git -C {repo} add` them")
    elif git.am_in_progress(repo) and git.staged_changes(repo):
        head = (f"{fork.name}: {entry.file} conflicted with {data['to_ref']}; git rerere replayed the resolution"
                f" recorded in an earlier try and staged it.\n  review it (`git -C {repo} diff --cached`)")
    else:
        said = (proc.stderr + proc.stdout).strip().splitlines()
        head = (f"{fork.name}: git am could not apply {entry.file} ({origin}): {said[0] if said else ''}.\n"
                f"  apply it by hand in {repo} (`git -C {repo} am --show-current-patch=diff`), `git add`")
    return (f"{head}, then `{cmd} --continue --why \"what changed and why\"`;\n"
            f"  or skip it: `{cmd} --drop {entry.name} --why \"upstream does X in file:function (PR #N)\"`"
            f" (add --obsolete when nothing needs it any more);\n"
            f"  or stop: `{cmd} --abort` (the port keeps what got through; rerere keeps your resolutions)")


def _record(root: Path, fork: Fork, repo: Path, port: Port, entry: Entry, before: str, why: str | None) -> None:
    """Write what the replay made of `entry` into the port: its patch file and its verdict."""
    head = git.out(repo, "rev-parse", "HEAD")
    old_text = (root / fork.patches / entry.file).read_text(encoding="utf-8")
    if head == before:
        files = sorted({line.split(" b/", 1)[-1] for line in git.changed_lines(old_text)
                        if line.startswith("diff --git ")})
        _mark(root, fork, port, entry, Drop(entry.name, why or "emptied by the replay: upstream's tree already"
                                            f" has its change to {', '.join(files)}"))
        return
    text = git.format_patch(repo, head)
    same = git.changed_lines(text) == git.changed_lines(old_text)
    entry.verdict = port_mod.PORTED if same else port_mod.REWORKED
    kept = "" if entry.why == port_mod.PLACEHOLDER else entry.why
    entry.why = why or kept or ("" if same else port_mod.PLACEHOLDER)
    port_mod.write_patch(port, entry, text)
    port_mod.write_series(port, Series(root / fork.patches).layout())


def _mark(root: Path, fork: Fork, port: Port, entry: Entry, drop: Drop) -> None:
    entry.verdict, entry.why = drop.verdict, drop.why
    port_mod.remove_patch(port, entry)
    port_mod.write_series(port, Series(root / fork.patches).layout())


def _save_state(repo: Path, data: dict) -> None:
    _state_path(repo).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _save_port(port: Port, data: dict, decided: int = 0) -> None:
    """port.toml, with this session's time so far and the patches given a verdict in it."""
    _tick(port, data, decided)
    port_mod.save(port)


def _tick(port: Port, data: dict, decided: int = 0) -> None:
    if data["session"] >= len(port.sessions):  # its [[session]] was deleted by hand meanwhile
        port.sessions.append(port_mod.Session(_now()))
        data["session"] = len(port.sessions) - 1
    session = port.sessions[data["session"]]
    session.elapsed = int(time.time() - data["clock"])
    session.patches += decided


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _load(repo: Path, fork: Fork) -> dict:
    path = _state_path(repo) if git.is_repo_root(repo) else None
    if path is None or not path.exists():
        raise ops.ForkError(f"{fork.name}: no rebase under way on this machine; start or pick up a port with"
                            f" `python -m tools.forks rebase {fork.name} --onto REF`")
    data = json.loads(path.read_text(encoding="utf-8"))
    if "port" not in data:
        raise ops.ForkError(f"{fork.name}: this rebase was begun by an older tools.forks, without a port; run"
                            f" `python -m tools.forks rebase {fork.name} --abort` and start it again")
    return data


# ---------------------------------------------------------------- continue, drop, abort


def resume(root: Path, fork: Fork, why: str | None = None, say: Say = _quiet) -> str:
    repo = root / fork.path
    data = _load(repo, fork)
    port = load_port(root / data["port"])
    if data["current"] is None:  # every patch was through; whys were missing
        if why:
            raise ops.ForkError(f"{fork.name}: no patch is stopped for --why to go to; write the whys in"
                                f" {data['port']}/{port_mod.PORT_FILE}, then --continue")
        return _finish_or_wait(root, fork, repo, data, port)
    i, entry = _stopped_entry(port, data)
    _conclude_am(root, fork, repo, entry)
    _record(root, fork, repo, port, entry, data["stopped_at"], why)
    data.update(current=None, stopped_at=None, conflicts=[])
    _save_port(port, data, decided=1)
    say(f"[{i + 1}/{len(port.entries)}] {entry.name}: resolved, {entry.verdict}")
    return _replay(root, fork, repo, data, port, i + 1, say)


def _stopped_entry(port: Port, data: dict) -> tuple[int, Entry]:
    entry = load_entry(port, data["current"])
    return port.entries.index(entry), entry


def load_entry(port: Port, name: str) -> Entry:
    try:
        return port.entry(name)
    except port_mod.PortError as exc:
        raise ops.ForkError(str(exc)) from None


def _conclude_am(root: Path, fork: Fork, repo: Path, entry: Entry) -> None:
    """Commit the resolved patch (or skip it when the resolution left nothing), unless done by hand."""
    if not git.am_in_progress(repo):
        return  # the user finished (or skipped) the patch with git am by hand
    unmerged = git.unmerged_paths(repo)
    if unmerged:
        raise RebaseStopped(f"{fork.name}: still unmerged: {', '.join(unmerged)}; resolve and"
                            f" `git -C {repo} add` them, then --continue")
    if not git.staged_changes(repo):
        git.run(repo, "am", "--skip")
        return
    # Same committer and date as `apply` would give, so the branch is reproducible.
    headers, _ = git.mailinfo((root / fork.patches / entry.file).read_text(encoding="utf-8"), repo)
    env = {**git.TOOL_IDENTITY, "GIT_COMMITTER_DATE": headers["Date"]}
    git.run(repo, "am", "--continue", env=env, config=git.NO_SIGNING)


def drop(root: Path, fork: Fork, drop: Drop, say: Say = _quiet) -> str:
    """Skip a patch for good: the stopped one (the replay goes on), a later pending one, or with no replay
    under way any patch of the fork's port."""
    repo = root / fork.path
    if not (git.is_repo_root(repo) and _state_path(repo).exists()):
        return _drop_at_rest(root, fork, drop)
    data = _load(repo, fork)
    port = load_port(root / data["port"])
    entry = load_entry(port, drop.name)
    i = port.entries.index(entry)
    if entry.name == data["current"]:
        if git.am_in_progress(repo):
            git.run(repo, "am", "--abort")
        git.run(repo, "reset", "--quiet", "--hard", data["stopped_at"])
        _mark(root, fork, port, entry, drop)
        data.update(current=None, stopped_at=None, conflicts=[])
        _save_port(port, data, decided=1)
        say(f"[{i + 1}/{len(port.entries)}] {entry.name}: {entry.verdict}")
        return _replay(root, fork, repo, data, port, i + 1, say)
    stopped = _stopped_entry(port, data)[0] if data["current"] else len(port.entries)
    if entry.verdict != port_mod.PENDING or i < stopped:
        raise ops.ForkError(f"{fork.name}: {entry.name} is {entry.verdict} and already replayed; --drop takes the"
                            f" stopped patch or a pending one after it. Or --abort, then --drop it")
    _mark(root, fork, port, entry, drop)
    _save_port(port, data, decided=1)
    return f"{entry.name}: {entry.verdict}, recorded; still stopped at {data['current']}"


def _drop_at_rest(root: Path, fork: Fork, drop: Drop) -> str:
    dirs = port_dirs(root, fork.name)
    if len(dirs) != 1:
        found = ", ".join(d.name for d in dirs) or "none"
        raise ops.ForkError(f"{fork.name}: --drop without a replay under way needs exactly one port of the fork"
                            f" (found: {found}); name it with --onto REF (that also starts the replay)")
    port = load_port(dirs[0])
    entry = load_entry(port, drop.name)
    _mark(root, fork, port, entry, drop)
    port_mod.save(port)
    return f"{entry.name}: {entry.verdict}, recorded in {dirs[0].relative_to(root)}"


def port_dirs(root: Path, fork_name: str) -> list[Path]:
    """The port directories of one fork (by port.toml's `fork`; by name where port.toml is unreadable)."""
    found = []
    for directory in port_mod.all_dirs(root):
        try:
            mine = port_mod.load(directory).fork == fork_name
        except port_mod.PortError:
            mine = directory.name.startswith(f"{fork_name}-")
        if mine:
            found.append(directory)
    return found


def abort(root: Path, fork: Fork) -> str:
    repo = root / fork.path
    data = _raw_state(repo, fork)  # also a state of an older tools.forks, without a port
    if git.am_in_progress(repo):
        git.record_resolutions(repo)  # rerere keeps what was resolved so far, for the next try
        git.run(repo, "am", "--abort")
    git.run(repo, "checkout", "--quiet", "--force", fork.branch)
    git.run(repo, "branch", "--quiet", "-D", _scratch(fork))
    kept = ""
    if "port" in data and (root / data["port"] / port_mod.PORT_FILE).exists():
        port = load_port(root / data["port"])
        _save_port(port, data)
        kept = (f"; the port {data['port']} keeps {len(port.entries) - len(port.pending())} verdicts:"
                f" `python -m tools.forks rebase {fork.name} --onto {data['to_ref']}` goes on from it"
                " (delete it to begin anew)")
    _state_path(repo).unlink()
    return f"rebase aborted; {fork.branch} unchanged{kept}"


def _raw_state(repo: Path, fork: Fork) -> dict:
    path = _state_path(repo) if git.is_repo_root(repo) else None
    if path is None or not path.exists():
        raise ops.ForkError(f"{fork.name}: no rebase under way on this machine")
    return json.loads(path.read_text(encoding="utf-8"))


# ---------------------------------------------------------------- finish


def _finish_or_wait(root: Path, fork: Fork, repo: Path, data: dict, port: Port) -> str:
    unexplained = [e.name for e in port.entries if e.unexplained]
    if not unexplained:
        return _finish(root, fork, repo, data, port)
    data.update(current=None, stopped_at=None, conflicts=[])
    _save_state(repo, data)
    _save_port(port, data)
    raise RebaseStopped(f"{fork.name}: every patch is through, but {len(unexplained)} verdict(s) have no why yet:"
                        f" {', '.join(unexplained)}.\n  write each in {data['port']}/{port_mod.PORT_FILE}"
                        f" (why = \"...\"), then `python -m tools.forks rebase {fork.name} --continue`")


def _finish(root: Path, fork: Fork, repo: Path, data: dict, port: Port) -> str:
    _save_state(repo, data)  # a step below that fails (a release's sdist gone from the cache) leaves --continue
    replayed = git.out(repo, "rev-parse", "HEAD")
    range_diff = git.out(repo, "range-diff", "--no-color", f"{data.get('old_base') or port.from_}..{data['old_tip']}",
                         f"{port.to}..{replayed}")
    base, new_tip = _as_synced(fork, repo, data, port, replayed) if port.upstream else (port.to, replayed)
    git.run(repo, "update-ref", ops.BACKUP_REF.format(fork.name), data["old_tip"])
    git.run(repo, "checkout", "--quiet", "-B", fork.branch, new_tip)
    git.run(repo, "branch", "--quiet", "-D", _scratch(fork))
    git.set_config(repo, "recipe.base", base)
    # Move the pin first: export reads the base from forks.toml.
    pin = {"ref": port.to_ref, "commit": port.upstream or port.to, **({"pypi": port.pypi} if port.pypi else {})}
    manifest_mod.set_keys(root / manifest_mod.MANIFEST, fork.name, pin)
    moved = manifest_mod.load(root).forks[fork.name]
    ops.set_gitlink(root, fork, moved.commit)
    ops.export(root, moved, renames=_renames(repo, port, base, new_tip))
    _tick(port, data)  # the last session's time, for the report
    report = report_path(root, fork, port.from_ref, port.to_ref)
    report.write_text(_report(port, range_diff), encoding="utf-8")
    shutil.rmtree(port.dir)
    _state_path(repo).unlink(missing_ok=True)
    kept, dropped, changed, new = port.tally()
    summary = (f"rebased {fork.name} onto {port.to_ref} ({moved.commit[:12]}): kept {kept}, dropped {dropped},"
               f" changed {changed}{f', added {new}' if new else ''}; report {report.relative_to(root)}")
    if fork.pypi and not port.pypi:
        summary += (f"\nnote: forks.{fork.name}.pypi still names {fork.pypi.requirement}, the old pin's"
                    " distribution: set requirement, file and sha256 for the new release, or remove it (a [pypi]"
                    f" table in {port_mod.PORT_FILE} does it at the finish)")
    return summary


def _renames(repo: Path, port: Port, base: str, tip: str) -> dict[str, str]:
    """Old patch file -> the file its replayed commit exports as (a reworded subject renames it): one commit per
    carried patch, in order."""
    carried = port.carried()
    commits = git.commits(repo, base, tip)
    if len(commits) != len(carried):
        return {}
    names = series_mod.file_names(repo, commits)
    return {e.file: new for e, new in zip(carried, names, strict=True) if e.verdict != port_mod.ADDED}


def _as_synced(fork: Fork, repo: Path, data: dict, port: Port, replayed: str) -> tuple[str, str]:
    """A release's finish: the commit `sync` makes of the new pin's sdist (a root commit, `to`'s tree), the
    replayed branch grafted onto it, and the config sync records; returns (that commit, the new tip)."""
    if not port.pypi:
        raise ops.ForkError(f"{port.dir / port_mod.PORT_FILE}: a port with `upstream` needs [pypi], the release's"
                            f" sdist; `rebase {fork.name} --onto NAME==VERSION` writes it")
    moved = replace(fork, ref=port.to_ref, commit=port.upstream, pypi=_pypi_source(port.pypi))
    location = data.get("release_location") or str(sources.cache_dir() / moved.pypi.file)
    try:
        synced = sources.commit_distribution(repo, moved, sources.download(moved, location), parent=None,
                                             pinned=True)
    except (sources.SourceError, OSError) as exc:
        raise ops.ForkError(f"{fork.name}: {moved.pypi.file} for the new pin: {exc}; every patch is through:"
                            f" bring it back (--find-links at the start), then --continue") from None
    if git.out(repo, "rev-parse", f"{synced}^{{tree}}") != git.out(repo, "rev-parse", f"{port.to}^{{tree}}"):
        raise ops.ForkError(f"{fork.name}: {moved.pypi.file} laid out as `sync` does is not the tree of `to`"
                            f" ({port.to[:12]}) the port was replayed on; check [pypi] in {port.dir.name}")
    if git.resolve(repo, f"refs/tags/{moved.ref}") is None:
        git.run(repo, "tag", moved.ref, synced, config=git.NO_SIGNING)  # as sync tags it
    git.set_config(repo, "recipe.source", "pypi")
    git.set_config(repo, "recipe.upstream-commit", moved.commit)
    return synced, _graft(repo, port.to, replayed, synced)


def _pypi_source(table: dict) -> PyPISource:
    return PyPISource(table["requirement"], table["file"], table["sha256"], table.get("note", ""),
                      tuple(table.get("lacks", ())))


def _graft(repo: Path, base: str, tip: str, onto: str) -> str:
    """base..tip again on `onto`, whose tree is base's: the same trees, messages, authors and dates, so the
    commits `apply` makes of the series there. Returns the new tip."""
    parent = onto
    for sha in git.commits(repo, base, tip):
        header, _, message = git.run(repo, "cat-file", "commit", sha).stdout.partition("\n\n")
        lines = [line for line in header.split("\n") if not line.startswith("parent ")]
        lines.insert(1, f"parent {parent}")  # after `tree`
        parent = git.out(repo, "hash-object", "-t", "commit", "-w", "--stdin",
                         input="\n".join(lines) + "\n\n" + message)
    return parent


def report_path(root: Path, fork: Fork, from_ref: str, to_ref: str) -> Path:
    """Where a rebase (and the draft of its dry run) reports."""
    return root / fork.patches / f"REBASE-{_label(from_ref)}-{_label(to_ref)}.md"


def _label(ref: str) -> str:
    return ref[:12] if re.fullmatch(r"[0-9a-f]{40}", ref) else re.sub(r"[^A-Za-z0-9._-]+", "_", ref)


def duration(seconds: int) -> str:
    hours, rest = divmod(seconds, 3600)
    return f"{hours} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"


def _report(port: Port, range_diff: str) -> str:
    counts = ", ".join(f"{v} {port.count(v)}" for v in port_mod.VERDICTS if v != port_mod.PENDING)
    kept, dropped, changed, new = port.tally()
    lines = [
        f"# {port.fork}: series rebased from {port.from_ref} to {port.to_ref}",
        "",
        f"- from: `{port.from_ref}` ({port.from_})",
        f"- to: `{port.to_ref}` ({port.upstream or port.to})",
        *([f"- replayed on: {port.to}, the PyPI-derived commit of {port.pypi['file']} (no upstream history here)"]
          if port.upstream else []),
        f"- kept: {kept}, dropped: {dropped}, changed: {changed}, added: {new} ({counts})",
        f"- time: {duration(port.elapsed)} over {len(port.sessions)} session(s), conflicts resolved included",
        "",
        "## Verdicts",
        "",
        "| # | patch | verdict | why |",
        "|---|---|---|---|",
        *(f"| {i} | {e.file} | {e.verdict} | {e.why.replace('|', chr(92) + '|')} |"
          for i, e in enumerate(port.entries, 1)),
        "",
        "ported: the same changed lines (context may have moved). reworked: changed lines differ. dropped: upstream"
        " has the equivalent. obsolete: nothing needs it any more. added: new on the new base, no patch of the"
        " old series behind it.",
        "",
        "## git range-diff (old series vs new series)",
        "",
        "```",
        range_diff or "(no commits on either side)",
        "```",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- status and check


def status(root: Path, fork: Fork, onto: str | None = None) -> tuple[list[tuple[str, ...]], list[str]]:
    """Rows (verdict, count, patches) and lines saying where the port stands."""
    repo = root / fork.path
    data = _load(repo, fork) if git.is_repo_root(repo) and _state_path(repo).exists() else None
    port = load_port(_port_dir(root, fork, onto, data))
    rows = [("verdict", "count", "patches")]
    for verdict in port_mod.VERDICTS:
        names = [e.name for e in port.entries if e.verdict == verdict]
        shown = ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "")
        rows.append((verdict, str(len(names)), shown))
    return rows, _where(root, fork, port, data)


def _port_dir(root: Path, fork: Fork, onto: str | None, data: dict | None) -> Path:
    if data:
        return root / data["port"]
    if onto:
        ref = release_tag(fork, onto.partition("==")[2].strip()) if is_release(onto) else onto
        return port_mod.dir_for(root, fork.name, _label(ref))
    dirs = port_dirs(root, fork.name)
    if len(dirs) != 1:
        raise ops.ForkError(f"{fork.name}: {len(dirs)} ports ({', '.join(d.name for d in dirs) or 'none'});"
                            " name one with --onto REF")
    return dirs[0]


def _where(root: Path, fork: Fork, port: Port, data: dict | None) -> list[str]:
    lines = [f"port: {port.dir.relative_to(root)} ({port.from_ref} -> {port.to_ref}), {len(port.entries)} patches"]
    if data and data["current"]:
        i = [e.name for e in port.entries].index(data["current"]) + 1
        files = git.unmerged_paths(root / fork.path) or data["conflicts"]
        lines.append(f"stopped at [{i}/{len(port.entries)}] {data['current']}; conflicted:"
                     f" {', '.join(files) or 'none left (resolved): --continue'}")
    elif data:
        lines.append("every patch is through; whys to write: "
                     + ", ".join(e.name for e in port.entries if e.unexplained))
    else:
        onto = port.pypi["requirement"] if port.upstream and port.pypi else port.to_ref
        lines.append(f"no replay under way here; `python -m tools.forks rebase {fork.name} --onto {onto}`"
                     " replays the port and goes on")
    pending = [e.name for e in port.pending()]
    lines.append(f"left: {len(pending)} pending" + (f", next {pending[0]}" if pending else ""))
    unexplained = [e.name for e in port.entries if e.unexplained]
    if unexplained:
        lines.append(f"whys missing: {', '.join(unexplained)}")
    lines.append(f"time: {duration(port.elapsed)} over {len(port.sessions)} session(s)")
    return lines


def check_port(root: Path, fork: Fork | None, directory: Path, index_urls: list[str] = (),
               find_links: list[Path] = ()) -> tuple[list[str], str]:
    """Lint one port directory and, where the fork's source holds `to` (or `to` is a release's PyPI-derived
    commit, built as the rebase builds it), apply its patches onto `to` in a scratch index (nothing of the
    fork changes but objects). Returns (problems, what was done)."""
    try:
        port = port_mod.load(directory)
    except port_mod.PortError as exc:
        return [str(exc)], "port.toml unreadable"
    if fork is None or port.fork != fork.name:
        return [f"{directory / port_mod.PORT_FILE}: fork = {port.fork!r} is not in forks.toml (or not this"
                " directory's fork); fix `fork` or move the port"], "lint only"
    problems = port_mod.problems(port, root)
    st = ops.state(root, fork)
    if st.source == "absent":
        return problems, "lint only (source absent)"
    missing = _without_to(st, port, index_urls, find_links)
    if missing:
        return problems, (f"lint only: {port.to_ref} ({port.to[:12]}) is not in the {st.source} tree at"
                          f" {fork.path} ({missing})")
    failed = git.apply_check(st.path, port.to, [port.dir / e.file for e in port.carried()
                                                if (port.dir / e.file).is_file()])
    if failed:
        problems.append(f"{failed[0]}: does not apply onto {port.to_ref} after the port's patches before it:"
                        f" {failed[1]}")
    return problems, f"lint + the port's patches apply onto {port.to_ref}"


def _without_to(st: ops.State, port: Port, index_urls: list[str], find_links: list[Path]) -> str:
    """Why the port's `to` is not in the fork's repository; "" when it is. On a PyPI tree (or for a port with
    `upstream`) the release its `to_ref` names is built there first, as the rebase builds it."""
    if git.resolve(st.path, port.to):
        return ""
    hint = "sync it with --source git to replay the port"
    requirement = _release_of(st.fork, port)
    if st.base is None or requirement is None or not (st.source == "pypi" or port.upstream):
        return hint
    try:
        target, location = sources.find_release(st.fork, requirement, index_urls, find_links)
        built = _release_base(st, target, location, index_urls, find_links)[1]
    except (sources.SourceError, OSError, ValueError) as exc:  # an index or a download out of reach
        said = str(exc).splitlines()[0]
        return f"{requirement}'s PyPI-derived commit, to replay the port on, could not be built: {said}"
    if built != port.to:
        return f"{requirement}'s PyPI-derived commit is {built[:12]}, not `to`; {hint}"
    return ""


def _release_of(fork: Fork, port: Port) -> str | None:
    """NAME==VERSION of the release a port goes to: its [pypi], else the fork's distribution at the version
    of `to_ref` read with release_tags; None for a fork without `pypi` or a `to_ref` that is no release tag."""
    if port.pypi:
        return port.pypi["requirement"]
    from tools.forks.upgrade import tag_version  # here: upgrade imports rehearsal, which imports this module

    version = tag_version(fork.release_tags, port.to_ref) if fork.pypi else None
    return f"{fork.pypi.name}=={version}" if version else None
