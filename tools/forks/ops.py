"""Fork policy: what each `tools.forks` verb does to a fork checkout and its patch series.

State that `apply` and `export` record lives in the fork repository's own git config:
`recipe.source` (git | pypi), `recipe.base` (the commit the series applies onto), and
`recipe.tip` / `recipe.series` (branch tip and series digest when branch and series last agreed).
A branch tip other than `recipe.tip` means commits that are not in the series yet.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from tools.forks import git, sources
from tools.forks import manifest as manifest_mod
from tools.forks import series as series_mod
from tools.forks.manifest import Fork, Manifest
from tools.forks.series import Series

AM_OPTIONS = ("am", "--3way", "--keep", "--keep-cr", "--committer-date-is-author-date", "--quiet")
BACKUP_REF = "refs/recipe/backup/{}"


class ForkError(RuntimeError):
    """An operation on a fork failed; the message names the fork, what failed and the fix."""


@dataclass
class State:
    """What is on disk for one fork."""

    fork: Fork
    path: Path
    source: str  # git | pypi | absent
    base: str | None  # None while the tree lacks the pin (sync fetches it)
    tip: str | None  # branch tip
    recorded_tip: str | None
    recorded_series: str | None
    series: Series

    @property
    def present(self) -> bool:
        return self.source != "absent"


def state(root: Path, fork: Fork) -> State:
    path = root / fork.path
    series = Series(root / fork.patches)
    if not git.is_repo_root(path):
        return State(fork, path, "absent", None, None, None, None, series)
    # A checkout made by `git clone --recursive` has no recipe.source: it is a git one.
    source = git.get_config(path, "recipe.source") or "git"
    if source == "pypi":
        # A PyPI tree serves only the pin it was made for; after the pin moves it is stale.
        made_for = git.get_config(path, "recipe.upstream-commit")
        base = git.get_config(path, "recipe.base") if made_for == fork.commit else None
    else:
        base = git.resolve(path, fork.commit)
    return State(
        fork,
        path,
        source,
        base,
        git.resolve(path, f"refs/heads/{fork.branch}"),
        git.get_config(path, "recipe.tip"),
        git.get_config(path, "recipe.series"),
        series,
    )


def _require_present(st: State) -> None:
    if st.source == "absent":
        raise ForkError(
            f"{st.fork.name}: no source at {st.path}; run `python -m tools.forks sync {st.fork.name}`"
        )
    if st.base is None:
        raise ForkError(
            f"{st.fork.name}: the {st.source} tree at {st.path} is not at the pin {st.fork.commit[:12]}"
            f" ({st.fork.ref}) yet; run `python -m tools.forks sync {st.fork.name}`"
        )


def _require_clean(st: State) -> None:
    dirty = git.dirty_paths(st.path)
    if dirty:
        shown = ", ".join(dirty[:5]) + (" ..." if len(dirty) > 5 else "")
        raise ForkError(
            f"{st.fork.name}: uncommitted changes in {st.path} ({shown}). Keep them: commit on"
            f" {st.fork.branch} and run `python -m tools.forks export {st.fork.name}`;"
            f" discard them: `git -C {st.path} stash` (or `checkout -- .` and `clean -fd`)"
        )


def stray_commits(st: State) -> list[str]:
    """Commits on the fork branch that the series on disk does not account for."""
    if st.tip is None or st.tip == st.recorded_tip:
        return []
    if st.recorded_tip and git.run(st.path, "merge-base", "--is-ancestor", st.recorded_tip, st.tip,
                                   check=False).returncode == 0:
        return git.commits(st.path, st.recorded_tip, st.tip)
    # A branch made or rewritten by hand: it is fine exactly when it renders to the series on disk.
    if st.base and _branch_matches_series(st):
        return []
    return git.commits(st.path, st.base, st.tip) if st.base else [st.tip]


def _branch_matches_series(st: State) -> bool:
    ancestor = git.run(st.path, "merge-base", "--is-ancestor", st.base, st.tip, check=False)
    if ancestor.returncode != 0 or git.has_merges(st.path, st.base, st.tip):
        return False
    rendered = series_mod.render(st.path, git.commits(st.path, st.base, st.tip), st.series.layout())
    return not series_mod.differences(st.series, rendered)


def _require_no_local_work(st: State) -> None:
    """Nothing in the fork that a rebuild, replacement or push would lose or leave out."""
    _require_clean(st)
    _refuse_strays(st)


def _refuse_strays(st: State) -> None:
    stray = stray_commits(st)
    if stray:
        subjects = [git.out(st.path, "log", "-1", "--format=%h %s", c) for c in stray[:5]]
        keep = st.recorded_tip or st.base
        raise ForkError(
            f"{st.fork.name}: {len(stray)} commit(s) on {st.fork.branch} are not in the series:"
            f" {'; '.join(subjects)}. Keep them: `python -m tools.forks export {st.fork.name}`;"
            f" discard them: `git -C {st.path} reset --hard {keep[:12]}`"
        )


def set_gitlink(root: Path, fork: Fork, commit: str | None = None) -> None:
    """Stage the superproject's gitlink (when `commit` is given) and shield it from `git add -A`.

    With a series applied, or a PyPI-derived tree, the fork's HEAD is not the gitlink commit, and a
    plain `git add -A` would stage that local commit as the new gitlink. skip-worktree (a flag of
    the local index, never committed) makes git leave the entry alone until a tool moves it.
    """
    if not sources.is_gitlink(root, fork.path):
        return
    if commit:
        git.run(root, "update-index", "--add", "--cacheinfo", f"160000,{commit},{fork.path}")
    git.run(root, "update-index", "--skip-worktree", "--", fork.path)


def _record(st: State, tip: str) -> None:
    git.set_config(st.path, "recipe.tip", tip)
    git.set_config(st.path, "recipe.series", st.series.digest())
    git.set_config(st.path, "recipe.applied-base", st.base)


def is_current(st: State) -> bool:
    """Branch exists and equals the series on disk, applied onto the current base."""
    return (
        st.tip is not None
        and st.tip == st.recorded_tip
        and st.recorded_series == st.series.digest()
        and git.get_config(st.path, "recipe.applied-base") == st.base
    )


# ---------------------------------------------------------------- sync


def sync(root: Path, fork: Fork, source: str, force: bool, index_urls: list[str],
         find_links: list[Path]) -> str:
    """Bring the upstream tree at the pin; returns a one-line report."""
    st = state(root, fork)
    if st.base and source in ("auto", st.source) and not force:
        set_gitlink(root, fork)
        head = off_pin(st)
        return _back_to_pin(root, st, head) if head else f"already present ({st.source})" + _lacks_report(st)
    if st.source == "git" and source in ("auto", "git") and not force:
        # The pin moved (a pulled rebase): fetch it into the existing checkout, losing nothing.
        _require_no_local_work(st)
        try:
            sources.sync_git(root, fork)
        except sources.SourceError as exc:
            raise ForkError(str(exc)) from None
        set_gitlink(root, fork)
        return f"updated to the new pin {fork.commit[:12]} from git; run apply"
    if st.source != "absent":
        if not force:
            made_for = "" if st.base else " made for another pin"
            raise ForkError(
                f"{fork.name}: {st.path} already holds a {st.source} tree{made_for}; pass --force to"
                f" replace it with the {source} source"
            )
        _require_no_local_work(st)  # st.source is git or pypi here
        shutil.rmtree(st.path)
    elif st.path.exists() and any(st.path.iterdir()):
        raise ForkError(f"{fork.name}: {st.path} has files but no git repository; move them away")
    if source == "pypi" and fork.pypi is None:
        raise ForkError(f"{fork.name}: git-only: forks.toml has no PyPI source for it")
    try:
        if source in ("git", "auto"):
            try:
                sources.sync_git(root, fork)
                set_gitlink(root, fork)
                return "synced from git"
            except sources.SourceError as exc:
                _clear_failed_checkout(st.path)
                if source == "git" or fork.pypi is None:
                    raise
                git_failure = str(exc)
        sources.sync_pypi(root, fork, index_urls, find_links)
        set_gitlink(root, fork)
        return f"synced from PyPI ({fork.pypi.file})" + (
            f" after git failed: {git_failure.splitlines()[0]}" if source == "auto" else ""
        ) + _lacks_report(state(root, fork))
    except sources.SourceError as exc:
        raise ForkError(str(exc)) from None


def _lacks_report(st: State) -> str:
    """For a PyPI tree: the trees its distribution lacks compared with the pin (forks.toml's pypi.lacks)."""
    said = sources.lacks_sentence(st.fork) if st.source == "pypi" else ""
    return f"\n  {said}; no patch of the series may touch or import them (check enforces it)" if said else ""


def off_pin(st: State) -> str | None:
    """HEAD's commit when a git tree holds the pin but sits neither at it nor on the fork branch.

    An interrupted `git submodule update --init` leaves each clone it made at the remote's default
    branch, never checked out: the pin is there, HEAD is not at it.
    """
    if st.source != "git" or st.base is None or git.head_branch(st.path) == st.fork.branch:
        return None
    head = git.resolve(st.path, "HEAD")
    return head if head != st.base else None


def _back_to_pin(root: Path, st: State, head: str) -> str:
    """Check out the pin where that loses nothing of ours; else refuse, naming what is ours."""
    branch = git.head_branch(st.path)
    how = f"branch {branch}" if branch else "detached"
    if not git.checked_out(st.path):
        how += ", never checked out: an interrupted clone"
    where = f"{head[:12]} ({how})"
    commits = git.unpublished(st.path, "HEAD", st.base)
    dirty = git.dirty_paths(st.path)
    if commits or dirty:
        raise ForkError(_off_pin_refusal(st, where, commits, dirty, branch))
    sources.checkout_pin(root, st.fork)
    return f"was at {where}, off the pin: checked out the pin {st.base[:12]} ({st.fork.ref})"


def _off_pin_refusal(st: State, where: str, commits: list[str], dirty: list[str], branch: str | None) -> str:
    ours, keep, pin = [], [], st.base[:12]
    if commits:
        subjects = [git.out(st.path, "log", "-1", "--format=%h %s", c) for c in commits[:5]]
        ours.append(f"{len(commits)} commit(s) on no upstream branch or tag ({'; '.join(subjects)})")
        if branch is None:
            keep.append("`git branch <name>`")
    if dirty:
        shown = ", ".join(dirty[:5]) + (" ..." if len(dirty) > 5 else "")
        ours.append(f"{len(dirty)} uncommitted file(s) ({shown})")
        # Without an index git would stash every file of HEAD as deleted: move the files instead.
        keep.append("`git stash --include-untracked`" if git.checked_out(st.path) else "move them out of the tree")
    keep.append(f"`git checkout --detach {pin}`" + (f" (the commits stay on {branch})" if commits and branch else ""))
    discard = [f"`git checkout --force --detach {pin}`", *(["`git clean -fd`"] if dirty else [])]
    return (
        f"{st.fork.name}: {st.path} is at {where}, not at the pin {pin} ({st.fork.ref}), and holds work of ours:"
        f" {'; '.join(ours)}. Fix, in that directory, to keep it: {', then '.join(keep)};"
        f" to discard it: {', then '.join(discard)}"
    )


def _clear_failed_checkout(path: Path) -> None:
    """A failed submodule clone can leave a gitfile behind; the PyPI fallback needs an empty dir."""
    if path.is_dir() and [p.name for p in path.iterdir()] == [".git"] and (path / ".git").is_file():
        (path / ".git").unlink()


# ---------------------------------------------------------------- apply


def apply(root: Path, fork: Fork, dry_run: bool = False) -> str:
    st = state(root, fork)
    _require_present(st)
    sources.exclude_build_outputs(st.path)
    _require_no_local_work(st)
    set_gitlink(root, fork)
    names = st.series.names()
    if is_current(st):
        if git.head_branch(st.path) != fork.branch:
            git.run(st.path, "checkout", "--quiet", fork.branch)
            return f"up to date ({len(names)} patches); checked out {fork.branch}"
        return f"up to date ({len(names)} patches)"
    if dry_run:
        return f"would replay {len(names)} patches onto {st.base[:12]} as {fork.branch}"
    if st.tip:
        git.run(st.path, "update-ref", BACKUP_REF.format(fork.name), st.tip)
    git.run(st.path, "checkout", "--quiet", "--force", "-B", fork.branch, st.base)
    for path in st.series.paths():
        proc = git.run(st.path, *AM_OPTIONS, str(path), env=git.TOOL_IDENTITY,
                       config=git.NO_SIGNING, check=False)
        if proc.returncode != 0:
            files = git.unmerged_paths(st.path)
            git.run(st.path, "am", "--abort", check=False)
            git.run(st.path, "checkout", "--quiet", "--force", "-B", fork.branch, st.tip or st.base)
            raise ForkError(
                f"{fork.name}: {path.name} does not apply onto {st.base[:12]}"
                f" (conflicts in {', '.join(files) or 'unknown files'}): {proc.stderr.strip()[:400]}\n"
                "  fix: the series does not match the pin; refresh it with `rebase` or fix the patch"
            )
    _record(st, git.out(st.path, "rev-parse", "HEAD"))
    return f"applied {len(names)} patches onto {st.base[:12]} as {fork.branch}"


# ---------------------------------------------------------------- export


def export(root: Path, fork: Fork, check: bool = False, renames: dict[str, str] | None = None) -> list[str]:
    """Write the branch as the series (or, with check, list what differs); returns changed files. `renames`
    (old patch file -> new) keeps a renamed patch under its topic header."""
    st = state(root, fork)
    _require_present(st)
    if st.tip is None:
        raise ForkError(f"{fork.name}: no {fork.branch} branch; run `python -m tools.forks apply {fork.name}`")
    if git.run(st.path, "merge-base", "--is-ancestor", st.base, st.tip, check=False).returncode:
        raise ForkError(f"{fork.name}: {fork.branch} does not descend from the pin {st.base[:12]}; "
                        "rebuild it with `apply` or move the pin with `rebase`")
    if git.has_merges(st.path, st.base, st.tip):
        raise ForkError(f"{fork.name}: {fork.branch} has merge commits; a series must be linear")
    layout = series_mod.renamed(st.series.layout(), renames or {})
    rendered = series_mod.render(st.path, git.commits(st.path, st.base, st.tip), layout)
    if check:
        changed = series_mod.differences(st.series, rendered)
        if changed and st.tip == st.recorded_tip and st.recorded_series != st.series.digest():
            raise ForkError(f"{fork.name}: the series on disk changed since {fork.branch} was built"
                            f" ({', '.join(changed)}); run `python -m tools.forks apply {fork.name}`")
        return changed
    changed = series_mod.write(st.series, rendered)
    _record(st, st.tip)
    return changed


# ---------------------------------------------------------------- check


def check(root: Path, fork: Fork) -> list[str]:
    """Lint the series, and replay it onto the pin when the source is present."""
    st = state(root, fork)
    problems = series_mod.lint(st.series, root) + lacks_problems(fork, st.series.paths())
    if st.base and not problems:
        problems += _apply_check(st)
    return problems


# The paths a patch names: its diff headers, renames and copies (git quotes a path with unusual characters).
_PATCH_PATHS = re.compile(r'^(?:diff --git "?a/(.+?)"? "?b/(.+?)"?|(?:rename|copy) (?:from|to) (.+)'
                          r'|(?:---|\+\+\+) "?[ab]/(.+?)"?)$', re.MULTILINE)


def patch_paths(text: str) -> set[str]:
    """The files a patch (git format-patch output) creates, changes, deletes or renames, relative to the fork."""
    return {path for match in _PATCH_PATHS.finditer(text) for path in match.groups() if path}


def lacks_problems(fork: Fork, patches: list[Path]) -> list[str]:
    """Patches that need a tree the fork's PyPI distribution lacks (forks.toml's pypi.lacks): one that touches a
    path under it, or whose added lines name it as a Python module. Such a series could not apply, or its code
    not import, on the tree `sync` lays out from PyPI, where CI gets the fork."""
    if fork.pypi is None or not fork.pypi.lacks:
        return []
    modules = {tree: re.compile(rf"\b{re.escape(tree.replace('/', '.'))}\b") for tree in fork.pypi.lacks
               if "." not in tree.rsplit("/", 1)[-1]}
    problems = []
    for path in patches:
        text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
        for touched in sorted(patch_paths(text)):
            tree = manifest_mod.lacked(fork, touched)
            if tree:
                problems.append(f"{path}: touches {touched}, under {tree}, which {fork.pypi.file} lacks"
                                f" (forks.{fork.name}.pypi.lacks); CI syncs from it, so the series must not need it")
        added = [line[1:] for line in text.splitlines() if line.startswith("+") and not line.startswith("+++")]
        for tree, module in modules.items():
            line = next((a.strip() for a in added if module.search(a)), None)
            if line:
                problems.append(f"{path}: adds {line!r}, which needs {tree}, which {fork.pypi.file} lacks"
                                f" (forks.{fork.name}.pypi.lacks); CI syncs from it, so the series must not need it")
    return problems


def _apply_check(st: State) -> list[str]:
    """Apply every patch in order to a scratch index at the pin; the work tree is never touched."""
    failed = git.apply_check(st.path, st.base, st.series.paths())
    return [f"{failed[0]}: does not apply to the pin {st.base[:12]}: {failed[1]}"] if failed else []


# ---------------------------------------------------------------- publish


def publish(root: Path, fork: Fork, remote: str, force: bool = False, dry_run: bool = False) -> list[str]:
    """Push the fork branch to `remote` and point the submodule (URL and gitlink) at it."""
    st = state(root, fork)
    _require_present(st)
    _require_no_local_work(st)
    if not is_current(st) or export(root, fork, check=True):
        raise ForkError(f"{fork.name}: {fork.branch} and the series disagree; run `apply` (or `export`"
                        " for new commits) first, so that what is published is what is reviewed")
    refspec = f"{'+' if force else ''}{fork.branch}:refs/heads/{fork.branch}"
    steps = [
        f"git -C {st.path} push {remote} {refspec}",
        f"set .gitmodules submodule.{fork.path}.url = {remote}, branch = {fork.branch}",
        f"set gitlink {fork.path} = {st.tip[:12]}",
        f"set forks.{fork.name}.published_url / published_commit in third_party/forks.toml",
    ]
    if dry_run:
        return steps
    proc = git.run(st.path, "push", "--quiet", remote, refspec, config=sources.ALLOW_LOCAL, check=False)
    if proc.returncode != 0:
        raise ForkError(f"{fork.name}: push to {remote} failed: {proc.stderr.strip()[:400]}\n"
                        "  fix: check the URL and your access; pass --force to overwrite a rebased branch")
    git.run(root, "config", "-f", ".gitmodules", f"submodule.{fork.path}.url", remote)
    git.run(root, "config", "-f", ".gitmodules", f"submodule.{fork.path}.branch", fork.branch)
    set_gitlink(root, fork, st.tip)
    git.run(root, "submodule", "sync", "--quiet", "--", fork.path)
    manifest_mod.set_keys(root / manifest_mod.MANIFEST, fork.name,
                          {"published_url": remote, "published_commit": st.tip})
    return steps


def gitlink_problems(manifest: Manifest) -> list[str]:
    """Disagreements between forks.toml, .gitmodules and the superproject's gitlinks."""
    root = manifest.root
    if not git.is_repo_root(root):
        return []
    problems = []
    stage = git.out(root, "ls-files", "--stage", "--", *[f.path for f in manifest.forks.values()])
    links = {line.split("\t")[1]: line.split()[1] for line in stage.splitlines() if line.startswith("160000")}
    for fork in manifest.forks.values():
        if links.get(fork.path) != fork.gitlink:
            problems.append(f"{fork.name}: gitlink {fork.path} is {links.get(fork.path)}, forks.toml says"
                            f" {fork.gitlink}")
        proc = git.run(root, "config", "-f", ".gitmodules", "--get", f"submodule.{fork.path}.url", check=False)
        if proc.stdout.strip() != fork.submodule_url:
            problems.append(f"{fork.name}: .gitmodules url is {proc.stdout.strip() or 'missing'},"
                            f" forks.toml says {fork.submodule_url}")
    return problems

