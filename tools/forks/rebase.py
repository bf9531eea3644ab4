"""`rebase`: replay a fork's series onto a new upstream base, dropping what landed upstream.

The replay runs on a scratch branch (`recipe/<fork>-rebase`); `recipe/<fork>`, the series, the pin
and the gitlink change only once every patch is through. A conflict stops the replay with its state
in `<git dir>/recipe-rebase.json`, to be resumed with `--continue` or undone with `--abort`.
`--dry-run` is `tools.forks.rehearsal`: the whole replay in a scratch repository.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tools.forks import git, ops
from tools.forks import manifest as manifest_mod
from tools.forks.manifest import Fork

STATE_FILE = "recipe-rebase.json"


class RebaseStopped(ops.ForkError):
    """The replay stopped on a conflict; the message says where and how to go on."""


def _state_path(repo: Path) -> Path:
    return git.git_dir(repo) / STATE_FILE


def _scratch(fork: Fork) -> str:
    return f"{fork.branch}-rebase"


def is_release(onto: str) -> bool:
    """`--onto NAME==VERSION` names a PyPI release; anything else, a git tag or commit."""
    return "==" in onto


def start(root: Path, fork: Fork, onto: str) -> str:
    st = ops.state(root, fork)
    if is_release(onto):
        raise ops.ForkError(f"{fork.name}: --onto {onto} is a PyPI release, which names no upstream commit for"
                            f" forks.toml to pin. See its cost with --dry-run; rebase onto the release's git tag"
                            f" (through a mirror: `git config url.<mirror>.insteadOf {fork.url}`)")
    ops._require_present(st)
    if st.source != "git":
        raise ops.ForkError(f"{fork.name}: rebase needs the upstream history; this tree is {st.source}."
                            f" Run `python -m tools.forks sync {fork.name} --source git --force` first")
    if _state_path(st.path).exists():
        raise ops.ForkError(f"{fork.name}: a rebase is already under way; use --continue or --abort")
    ops._require_no_local_work(st)
    if not ops.is_current(st):
        raise ops.ForkError(f"{fork.name}: {fork.branch} is not the series on disk; run"
                            f" `python -m tools.forks apply {fork.name}` first")
    new_base = git.resolve(st.path, onto) or _fetch(st.path, fork, onto)
    upstream = git.patch_ids_of_range(st.path, f"{st.base}..{new_base}")
    data = {
        "fork": fork.name,
        "from_ref": fork.ref,
        "from": st.base,
        "to_ref": onto,
        "to": new_base,
        "old_tip": st.tip,
        "patches": st.series.names(),
        "next": 0,
        "kept": [],
        "dropped": [],
        "upstream": upstream,
    }
    git.run(st.path, "checkout", "--quiet", "-B", _scratch(fork), new_base)
    return _replay(root, fork, st.path, data)


def _fetch(repo: Path, fork: Fork, onto: str) -> str:
    for spec in (f"refs/tags/{onto}:refs/tags/{onto}", onto):
        proc = git.run(repo, "fetch", "--quiet", fork.url, spec, config=ops.sources.ALLOW_LOCAL, check=False)
        sha = git.resolve(repo, onto) or (git.resolve(repo, "FETCH_HEAD") if proc.returncode == 0 else None)
        if sha:
            return sha
    raise ops.ForkError(f"{fork.name}: {onto!r} is neither a commit in {fork.path} nor fetchable from"
                        f" {fork.url}; fetch it there first or name a tag or commit that exists")


def _replay(root: Path, fork: Fork, repo: Path, data: dict) -> str:
    patch_dir = root / fork.patches
    while data["next"] < len(data["patches"]):
        name = data["patches"][data["next"]]
        text = (patch_dir / name).read_text(encoding="utf-8")
        landed = data["upstream"].get(git.patch_id(repo, text) or "")
        if landed:
            data["dropped"].append({"patch": name, "why": f"already upstream as {landed[:12]}"})
        else:
            before = git.out(repo, "rev-parse", "HEAD")
            proc = git.run(repo, *ops.AM_OPTIONS, str(patch_dir / name), env=git.TOOL_IDENTITY,
                           config=git.NO_SIGNING, check=False)
            if proc.returncode != 0:
                data["stopped_at"] = before
                _save(repo, data)
                files = git.unmerged_paths(repo) or ["(see git am output)"]
                raise RebaseStopped(
                    f"{fork.name}: {name} conflicts with {data['to_ref']} in {', '.join(files)}.\n"
                    f"  resolve the files in {repo}, `git -C {repo} add` them, then"
                    f" `python -m tools.forks rebase {fork.name} --continue`;"
                    f" or give up with `python -m tools.forks rebase {fork.name} --abort`"
                )
            _note(data, repo, name, before)
        data["next"] += 1
    return _finish(root, fork, repo, data)


def _note(data: dict, repo: Path, name: str, before: str) -> None:
    if git.out(repo, "rev-parse", "HEAD") == before:
        data["dropped"].append({"patch": name, "why": "emptied by the replay (its change is upstream)"})
    else:
        data["kept"].append(name)


def _save(repo: Path, data: dict) -> None:
    _state_path(repo).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _load(repo: Path, fork: Fork) -> dict:
    path = _state_path(repo)
    if not path.exists():
        raise ops.ForkError(f"{fork.name}: no rebase under way")
    return json.loads(path.read_text(encoding="utf-8"))


def resume(root: Path, fork: Fork) -> str:
    repo = root / fork.path
    data = _load(repo, fork)
    name = data["patches"][data["next"]]
    if git.am_in_progress(repo):
        unmerged = git.unmerged_paths(repo)
        if unmerged:
            raise RebaseStopped(f"{fork.name}: still unmerged: {', '.join(unmerged)}; resolve and"
                                f" `git -C {repo} add` them, then --continue")
        before = git.out(repo, "rev-parse", "HEAD")
        staged = git.run(repo, "diff", "--cached", "--quiet", check=False).returncode != 0
        if staged:
            # Same committer and date as `apply` would give, so the branch is reproducible.
            headers, _ = git.mailinfo((root / fork.patches / name).read_text(encoding="utf-8"), repo)
            env = {**git.TOOL_IDENTITY, "GIT_COMMITTER_DATE": headers["Date"]}
            git.run(repo, "am", "--continue", env=env, config=git.NO_SIGNING)
        else:
            git.run(repo, "am", "--skip")
        _note(data, repo, name, before)
    else:  # the user finished (or skipped) the patch with git am by hand
        _note(data, repo, name, data["stopped_at"])
    data["next"] += 1
    return _replay(root, fork, repo, data)


def abort(root: Path, fork: Fork) -> str:
    repo = root / fork.path
    _load(repo, fork)
    if git.am_in_progress(repo):
        git.run(repo, "am", "--abort")
    git.run(repo, "checkout", "--quiet", "--force", fork.branch)
    git.run(repo, "branch", "--quiet", "-D", _scratch(fork))
    _state_path(repo).unlink()
    return f"rebase aborted; {fork.branch} unchanged"


def _finish(root: Path, fork: Fork, repo: Path, data: dict) -> str:
    new_tip = git.out(repo, "rev-parse", "HEAD")
    git.run(repo, "update-ref", ops.BACKUP_REF.format(fork.name), data["old_tip"])
    git.run(repo, "checkout", "--quiet", "-B", fork.branch, new_tip)
    git.run(repo, "branch", "--quiet", "-D", _scratch(fork))
    git.set_config(repo, "recipe.base", data["to"])
    changed = _changed(repo, data)
    range_diff = git.out(repo, "range-diff", "--no-color", f"{data['from']}..{data['old_tip']}",
                         f"{data['to']}..{new_tip}")
    # Move the pin first: export reads the base from forks.toml.
    manifest_path = root / manifest_mod.MANIFEST
    manifest_mod.set_keys(manifest_path, fork.name, {"ref": data["to_ref"], "commit": data["to"]})
    moved = manifest_mod.load(root).forks[fork.name]
    ops.set_gitlink(root, fork, data["to"])
    ops.export(root, moved)
    report = report_path(root, fork, data["from_ref"], data["to_ref"])
    report.write_text(_report(fork, data, changed, range_diff), encoding="utf-8")
    _state_path(repo).unlink(missing_ok=True)
    summary = (f"rebased {fork.name} onto {data['to_ref']} ({data['to'][:12]}): kept {len(data['kept'])},"
               f" dropped {len(data['dropped'])}, changed {len(changed)}; report {report.relative_to(root)}")
    if fork.pypi:
        summary += (f"\nnote: forks.{fork.name}.pypi still names {fork.pypi.requirement}, the old pin's"
                    " distribution: set requirement, file and sha256 for the new release, or remove it")
    return summary


def _changed(repo: Path, data: dict) -> list[str]:
    """Kept patches whose diff differs after the replay (context moved or conflict resolved)."""
    old = git.commits(repo, data["from"], data["old_tip"])
    new = git.commits(repo, data["to"], git.out(repo, "rev-parse", "HEAD"))
    old_by_name = dict(zip(data["patches"], old, strict=True))
    changed = []
    for name, sha in zip(data["kept"], new, strict=True):
        before = git.patch_id(repo, git.out(repo, "show", "--no-color", old_by_name[name]))
        after = git.patch_id(repo, git.out(repo, "show", "--no-color", sha))
        if before != after:
            changed.append(name)
    return changed


def report_path(root: Path, fork: Fork, from_ref: str, to_ref: str) -> Path:
    """Where a rebase (and the draft of its dry run) reports."""
    return root / fork.patches / f"REBASE-{_label(from_ref)}-{_label(to_ref)}.md"


def _label(ref: str) -> str:
    return ref[:12] if re.fullmatch(r"[0-9a-f]{40}", ref) else re.sub(r"[^A-Za-z0-9._-]+", "_", ref)


def _report(fork: Fork, data: dict, changed: list[str], range_diff: str) -> str:
    lines = [
        f"# {fork.name}: series rebased from {data['from_ref']} to {data['to_ref']}",
        "",
        f"- from: `{data['from_ref']}` ({data['from']})",
        f"- to: `{data['to_ref']}` ({data['to']})",
        f"- kept: {len(data['kept'])}, dropped: {len(data['dropped'])}, changed: {len(changed)}",
        "",
        "## Kept",
        *([f"- {name}{' (changed)' if name in changed else ''}" for name in data["kept"]] or ["- none"]),
        "",
        "## Dropped",
        *([f"- {d['patch']}: {d['why']}" for d in data["dropped"]] or ["- none"]),
        "",
        "## git range-diff (old series vs new series)",
        "",
        "```",
        range_diff or "(no commits on either side)",
        "```",
        "",
    ]
    return "\n".join(lines)
