"""`rebase --dry-run`: the whole series replayed onto the new base in a scratch repository.

The scratch repository reads the fork's objects through git's alternates and writes only its own (a tag
to fetch is fetched into it), so the fork (HEAD, branches, index, work tree, refs, objects) is never
touched; it is deleted afterwards. Every patch gets one result:

  clean             `git apply` takes it as it stands
  3-way merged      it needed the 3-way merge of `git am --3way`
  conflict          the merge left files conflicted (named, with the patch's hunks that do not apply as
                    they stand); the patch is left out and the replay goes on
  already upstream  an upstream commit has its patch-id, or the replay left nothing of it

A later patch *needs* a left-out one when the series replayed at the pin without the left-out patch does
not take it (`git apply`, no 3-way): its lines or their context come from the left-out patch, directly or
through a patch that needs it. It is told at the pin, so upstream's changes cannot cause it.

`--onto NAME==VERSION` compares two PyPI releases: the pinned and the target sdist, laid out as `sync`
does, committed as two commits (pin, then target on top). The pin's tree comes from its sdist even when
the fork was synced from git, so that both sides lack the same files (docs, examples) and the difference
between them is upstream's, not the packaging's. A patch's changes to a file the pin's sdist lacks (an
upstream test or doc the distribution leaves out) are left out of such a replay on both sides, and named
in the patch's detail: the sdists cannot judge them.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tools.forks import git, ops, rebase, sources
from tools.forks.manifest import Fork, PyPISource

CLEAN, MERGED, CONFLICT, UPSTREAM = "clean", "3-way merged", "conflict", "already upstream"
COLUMNS = ("#", "patch", "result", "detail")
LEGEND = (
    "clean: `git apply` takes the patch as it stands. 3-way merged: it needed `git am --3way`'s merge."
    " conflict: the merge left the files named conflicted (with the patch's hunks that do not apply as they"
    " stand); the patch was left out and the replay went on. already upstream: an upstream commit has its"
    " patch-id, or the replay left nothing of it. A patch needs a left-out one when the series replayed at"
    " the pin without that patch does not take it (`git apply`, no 3-way)."
)


@dataclass
class Outcome:
    patch: str
    result: str
    why: str = ""  # already upstream as which commit, or emptied; a conflict without files: git's error
    conflicts: dict[str, list[str]] = field(default_factory=dict)  # file -> the patch's hunk headers there
    needs: list[str] = field(default_factory=list)  # left-out patches it does not apply without
    needed_by: list[str] = field(default_factory=list)  # later patches that do not apply without it
    unjudged: list[str] = field(default_factory=list)  # files it changes that the sdists lack (PyPI replays)

    def detail(self, hunks: bool = True) -> str:
        """Why, conflicts and dependences; `hunks=False` counts the hunks instead of listing their headers."""
        parts = [self.why] if self.why else []
        for name, headers in self.conflicts.items():
            if not headers:
                parts.append(name)
            else:
                parts.append(f"{name}: {', '.join(headers)}" if hunks else
                             f"{name} ({len(headers)} hunk{'s' * (len(headers) > 1)})")
        if self.needs:
            parts.append(f"needs {', '.join(self.needs)} (left out)")
        if self.needed_by:
            parts.append(f"needed by {', '.join(self.needed_by)}")
        if self.unjudged:
            parts.append(f"not in the sdists, not replayed: {', '.join(self.unjudged)}")
        return "; ".join(parts)


@dataclass
class Base:
    ref: str  # as named: tag, commit or NAME==VERSION
    commit: str  # in the scratch repository
    pypi: PyPISource | None = None  # the distribution, where the tree is PyPI-derived

    def describe(self) -> str:
        text = f"`{self.ref}` ({self.commit})"
        if self.pypi:
            text += f", PyPI-derived from {self.pypi.file} (sha256 {self.pypi.sha256})"
        return text


@dataclass
class Rehearsal:
    fork: str
    old: Base
    new: Base
    outcomes: list[Outcome]

    def count(self, result: str) -> int:
        return sum(o.result == result for o in self.outcomes)

    @property
    def conflicted(self) -> bool:
        return self.count(CONFLICT) > 0

    def summary(self) -> str:
        counts = ", ".join(f"{result} {self.count(result)}" for result in (CLEAN, MERGED, CONFLICT, UPSTREAM))
        needing = sum(bool(o.needs) for o in self.outcomes)
        return counts + (f"; needing a left-out patch {needing}" if needing else "")

    def rows(self, hunks: bool = True) -> list[tuple[str, ...]]:
        return [(str(i), o.patch, o.result, o.detail(hunks)) for i, o in enumerate(self.outcomes, 1)]


def rehearse(root: Path, fork: Fork, onto: str, index_urls: list[str], find_links: list[Path]) -> Rehearsal:
    """Replay the series on disk onto `onto` (tag, commit or NAME==VERSION) without touching the fork."""
    st = ops.state(root, fork)
    paths = st.series.paths()
    with tempfile.TemporaryDirectory(prefix=f"rebase-{fork.name}-") as tmp:
        scratch = Path(tmp, "repo")
        if rebase.is_release(onto):
            git.init_borrowing(scratch, st.path if st.present else None)
            old, new = _pypi_bases(fork, scratch, onto, index_urls, find_links)
        else:
            _require_history(st, onto)
            git.init_borrowing(scratch, st.path)
            old = Base(fork.ref, st.base)
            new = Base(onto, git.resolve(st.path, onto) or rebase._fetch(scratch, fork, onto))
        at_pin, absent = _trees_at_pin(scratch, fork, old.commit, paths, distribution=old.pypi is not None)
        outcomes = _replay(scratch, old.commit, new.commit, paths, absent)
        _mark_needs(scratch, at_pin, paths, outcomes, absent)
    return Rehearsal(fork.name, old, new, outcomes)


def _require_history(st: ops.State, onto: str) -> None:
    ops._require_present(st)
    if st.source != "git":
        release = f"{st.fork.pypi.name}==<version>" if st.fork.pypi else "a PyPI release"
        raise ops.ForkError(f"{st.fork.name}: --onto {onto} needs the upstream history; this tree is {st.source}."
                            f" Name a PyPI release instead ({release}), or run"
                            f" `python -m tools.forks sync {st.fork.name} --source git --force` first")


def _pypi_bases(fork: Fork, scratch: Path, onto: str, index_urls: list[str],
                find_links: list[Path]) -> tuple[Base, Base]:
    """The pinned and the target sdist as two commits of `scratch`: pin, then target on top."""
    if fork.pypi is None:
        raise ops.ForkError(f"{fork.name}: --onto {onto} names a PyPI release, but forks.{fork.name} has no"
                            " `pypi` (no pinned sdist to compare with); name a git tag or commit")
    try:
        target, location = sources.find_release(fork, onto, index_urls, find_links)
        old = rebase.pin_commit(scratch, fork, index_urls, find_links)
        new = rebase.release_commit(scratch, fork, target, location, parent=old)
    except sources.SourceError as exc:
        raise ops.ForkError(str(exc)) from None
    return Base(fork.ref, old, fork.pypi), Base(onto, new, target)


@contextmanager
def _index_at(repo: Path, tree: str) -> Iterator[dict[str, str]]:
    """The environment of a scratch index holding `tree`: `git apply --cached` there touches nothing else."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp, "index"))}
        git.run(repo, "read-tree", tree, env=env)
        yield env


_ABSENT = re.compile(r"^error: (.+): does not exist in index$")


def _trees_at_pin(scratch: Path, fork: Fork, pin: str, paths: list[Path],
                  distribution: bool = False) -> tuple[list[str], list[list[str]]]:
    """The tree at the pin after each prefix of the series ([pin, pin + patch 1, ...]), and per patch the files
    left out of the replay: where the pin is an sdist (`distribution`), those it changes that the sdist lacks."""
    absent: list[list[str]] = []
    with _index_at(scratch, pin) as env:
        trees = [git.out(scratch, "write-tree", env=env)]
        for path in paths:
            absent.append([])
            while True:
                proc = git.run(scratch, "apply", "--cached", *_excluding(absent[-1]), str(path), env=env, check=False)
                errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
                lacking = [m.group(1) for m in map(_ABSENT.match, errors) if m]
                if not (proc.returncode and distribution and lacking and len(lacking) == len(errors)):
                    break
                absent[-1] += [name for name in lacking if name not in absent[-1]]
            if proc.returncode:
                raise ops.ForkError(f"{fork.name}: {path.name} does not apply to the pin {pin[:12]}, so a rebase"
                                    f" cannot be judged: {proc.stderr.strip()[:300]}\n  fix: make the series apply"
                                    f" to its pin first (`python -m tools.forks check {fork.name}`)")
            trees.append(git.out(scratch, "write-tree", env=env))
    return trees, absent


def _excluding(names: list[str]) -> list[str]:
    """`git apply`/`git am` options that leave these files out (--exclude takes a pattern: escape it)."""
    return ["--exclude=" + re.sub(r"([\[\]*?\\])", r"\\\1", name) for name in names]


def _replay(scratch: Path, old: str, new: str, paths: list[Path], absent: list[list[str]]) -> list[Outcome]:
    upstream = git.patch_ids_of_range(scratch, f"{old}..{new}")
    git.run(scratch, "checkout", "--quiet", "--detach", new)
    outcomes = []
    for path, left_out in zip(paths, absent, strict=True):
        landed = upstream.get(git.patch_id(scratch, path.read_text(encoding="utf-8")) or "")
        outcome = Outcome(path.name, UPSTREAM, f"as {landed[:12]}") if landed else _apply(scratch, path, left_out)
        outcome.unjudged = list(left_out)
        outcomes.append(outcome)
    return outcomes


def _apply(scratch: Path, path: Path, left_out: list[str] | None = None) -> Outcome:
    """Apply one patch as `rebase` would (git am --3way), less the files `left_out`; on a conflict, leave it out."""
    excluding = _excluding(left_out or [])
    before = git.out(scratch, "rev-parse", "HEAD")
    as_is = git.run(scratch, "apply", "--check", *excluding, str(path), check=False).returncode == 0
    proc = git.run(scratch, *ops.AM_OPTIONS, *excluding, str(path), env=git.TOOL_IDENTITY, config=git.NO_SIGNING,
                   check=False)
    if proc.returncode == 0:
        if git.out(scratch, "rev-parse", "HEAD") == before:
            return Outcome(path.name, UPSTREAM, "emptied by the replay (its change is upstream)")
        return Outcome(path.name, CLEAN if as_is else MERGED)
    unmerged = git.unmerged_paths(scratch)
    if git.am_in_progress(scratch):
        git.run(scratch, "am", "--abort")
    rejected = _rejected_hunks(scratch, path, excluding)
    conflicts = {name: rejected.get(name, []) for name in unmerged} if unmerged else rejected
    said = (proc.stderr + proc.stdout).splitlines()
    error = "" if conflicts else next((s for s in said if s.startswith("error:")), said[-1] if said else "")
    return Outcome(path.name, CONFLICT, error, conflicts)


def _rejected_hunks(scratch: Path, path: Path, excluding: list[str] = ()) -> dict[str, list[str]]:
    """File -> headers of the patch's hunks that `git apply` rejects at HEAD (its .rej files); resets after."""
    git.run(scratch, "apply", "--reject", *excluding, str(path), check=False)
    untracked = git.run(scratch, "ls-files", "--others", "-z").stdout.split("\0")
    found = {}
    for name in sorted(n for n in untracked if n.endswith(".rej")):
        text = (scratch / name).read_text(encoding="utf-8", errors="replace")
        found[name.removesuffix(".rej")] = [line.rstrip() for line in text.splitlines() if line.startswith("@@ ")]
    git.run(scratch, "reset", "--quiet", "--hard")
    git.run(scratch, "clean", "-f", "-d", "-x", "--quiet")
    return found


def _mark_needs(scratch: Path, at_pin: list[str], paths: list[Path], outcomes: list[Outcome],
                absent: list[list[str]]) -> None:
    """Mark the later patches that do not apply at the pin once a left-out patch is taken away."""
    for i, left_out in enumerate(outcomes):
        if left_out.result != CONFLICT:
            continue
        with _index_at(scratch, at_pin[i]) as env:  # the series up to, not including, the left-out patch
            for later, path, lacking in zip(outcomes[i + 1:], paths[i + 1:], absent[i + 1:], strict=True):
                if git.run(scratch, "apply", "--cached", *_excluding(lacking), str(path), env=env,
                           check=False).returncode:
                    later.needs.append(left_out.patch)
                    left_out.needed_by.append(later.patch)


def report(r: Rehearsal) -> str:
    """The draft of the REBASE report: every patch's result, as Markdown."""
    lines = [
        f"# {r.fork}: dry run of a rebase from {r.old.ref} to {r.new.ref} (draft)",
        "",
        f"Nothing was changed: `python -m tools.forks rebase {r.fork} --onto {r.new.ref} --dry-run` replayed the"
        " series on disk in a scratch repository. " + ("The rebase itself (with --upstream-commit, the commit of the"
                                                       " release's tag) reports beside this draft." if r.new.pypi else
                                                       "The rebase itself replaces this draft with its report."),
        "",
        f"- from: {r.old.describe()}",
        f"- to: {r.new.describe()}",
        f"- {r.summary()}",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in r.rows()),
        "",
        LEGEND,
        "",
    ]
    return "\n".join(lines)


def write_report(root: Path, fork: Fork, r: Rehearsal) -> Path:
    """Write the draft where `rebase` writes its report (temp file + rename); returns the path."""
    path = rebase.report_path(root, fork, r.old.ref, r.new.ref)
    replace_file(path, report(r))
    return path


def replace_file(path: Path, text: str) -> None:
    """Write `text` to `path` through a temp file and a rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; the report is for everyone, as `open` would make it
    os.replace(tmp, path)
