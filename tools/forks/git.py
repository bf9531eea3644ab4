"""Thin, project-agnostic wrappers around the git command line.

Nothing here knows about forks, series or this repository's layout; the fork policy lives in
`tools.forks.ops`. Every call goes through `run`, so errors always carry the command and git's own
message.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

# Author/committer used for commits the tools create themselves (PyPI-derived bases, replayed
# patches' committer). Fixed so that the same inputs give the same commit ids on every machine.
TOOL_IDENTITY = {
    "GIT_COMMITTER_NAME": "rl-recipe forks",
    "GIT_COMMITTER_EMAIL": "forks@rl-recipe.invalid",
}

# Commits and tags made by the tools are never signed (no key prompts on CI or clusters).
NO_SIGNING = ("commit.gpgSign=false", "tag.gpgSign=false")

# Options that make `git format-patch` output independent of the user's configuration and of the
# git version: no commit id, no version signature, full blob ids, no diffstat, fixed abbreviation,
# fixed rename detection, no numbering in the subject (so adding a patch rewrites no other file).
FORMAT_PATCH_OPTIONS = (
    "--zero-commit",
    "--no-signature",
    "--full-index",
    "--no-stat",
    "--abbrev=12",
    "--find-renames=50%",
    "--keep-subject",
    "--no-color",
    "--no-encode-email-headers",
    "--no-to",
    "--no-cc",
    "--no-add-header",
    "-O/dev/null",  # an empty order file: paths in natural order whatever diff.orderFile says
)
# Configuration that could otherwise change diff text: forced to git's defaults.
NEUTRAL_DIFF_CONFIG = (
    "diff.noprefix=false",
    "diff.mnemonicPrefix=false",
    "diff.relative=false",
    "diff.algorithm=myers",
    "diff.indentHeuristic=true",
    "diff.suppressBlankEmpty=false",
    "diff.context=3",
    "diff.interHunkContext=0",
    "core.quotePath=true",
    "format.signOff=false",
    "format.coverLetter=false",
    "format.useAutoBase=false",
    "format.thread=false",
    "color.ui=false",
)


class GitError(RuntimeError):
    """A git command failed; `str()` names the command, the repository and git's message."""

    def __init__(self, args: list[str], cwd: Path, returncode: int, stderr: str):
        self.args_ = args
        self.cwd = cwd
        self.returncode = returncode
        self.stderr = stderr.strip()
        super().__init__(f"git {' '.join(args)} (in {cwd}) failed with exit {returncode}: {self.stderr}")


def run(
    cwd: Path | str,
    *args: str,
    env: dict[str, str] | None = None,
    config: tuple[str, ...] = (),
    check: bool = True,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `git -C cwd args`; raise GitError on failure when `check`."""
    cmd = ["git"]
    for item in config:
        cmd += ["-c", item]
    cmd += list(args)
    full_env = {**os.environ, "LC_ALL": "C", "GIT_TERMINAL_PROMPT": "0", **(env or {})}
    proc = subprocess.run(
        cmd, cwd=cwd, env=full_env, input=input, capture_output=True, text=True, encoding="utf-8"
    )
    if check and proc.returncode != 0:
        raise GitError(list(args), Path(cwd), proc.returncode, proc.stderr or proc.stdout)
    return proc


def out(cwd: Path | str, *args: str, **kw) -> str:
    """stdout of a git command, stripped."""
    return run(cwd, *args, **kw).stdout.strip()


def is_repo_root(path: Path) -> bool:
    """True when `path` is the top of a work tree of its own (a `.git` dir or gitfile inside)."""
    return (path / ".git").exists()


def resolve(repo: Path, rev: str) -> str | None:
    """Commit id of `rev`, or None when it does not name a commit in `repo`."""
    proc = run(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
    return proc.stdout.strip() or None


def head_branch(repo: Path) -> str | None:
    """Short name of the checked-out branch, None when HEAD is detached."""
    proc = run(repo, "symbolic-ref", "--quiet", "--short", "HEAD", check=False)
    return proc.stdout.strip() or None


def dirty_paths(repo: Path) -> list[str]:
    """Tracked files with uncommitted changes plus untracked, non-ignored files.

    In a work tree never checked out, git reports every file of HEAD as a staged deletion; nobody
    made those changes, so there only the untracked files count.
    """
    lines = run(repo, "status", "--porcelain=v1", "--untracked-files=normal").stdout.splitlines()
    if not checked_out(repo):
        lines = [line for line in lines if line.startswith("??")]
    return [line[3:] for line in lines if line]


def checked_out(repo: Path) -> bool:
    """False for a work tree git never filled: no index, as `clone --no-checkout` leaves it."""
    return (git_dir(repo) / "index").exists()


def unpublished(repo: Path, rev: str, *known: str) -> list[str]:
    """Commits of `rev` on no remote-tracking branch or tag and not in `known`'s history, oldest first."""
    return out(repo, "rev-list", "--reverse", rev, "--not", "--remotes", "--tags", *known).split()


def commits(repo: Path, base: str, tip: str) -> list[str]:
    """Commits in base..tip, oldest first."""
    text = out(repo, "rev-list", "--reverse", f"{base}..{tip}")
    return text.split()


def has_merges(repo: Path, base: str, tip: str) -> bool:
    return bool(out(repo, "rev-list", "--merges", f"{base}..{tip}"))


def get_config(repo: Path, key: str) -> str | None:
    proc = run(repo, "config", "--local", "--get", key, check=False)
    return proc.stdout.strip() or None


def set_config(repo: Path, key: str, value: str) -> None:
    run(repo, "config", "--local", key, value)


def git_dir(repo: Path) -> Path:
    return Path(out(repo, "rev-parse", "--absolute-git-dir"))


def init_borrowing(dest: Path, lender: Path | None = None) -> None:
    """A new repository at `dest`, without hooks, that reads `lender`'s objects (git's alternates) and writes
    only its own: nothing done in it changes `lender`."""
    run(dest.parent, "init", "--quiet", "--template=", str(dest))
    set_config(dest, "core.autocrlf", "false")
    if lender is not None:
        objects = out(lender, "rev-parse", "--path-format=absolute", "--git-path", "objects")
        info = git_dir(dest) / "objects" / "info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "alternates").write_text(objects + "\n", encoding="utf-8")


def tags(repo: Path) -> list[str]:
    """Names of the tags in `repo`."""
    return out(repo, "tag", "--list").split()


def remote_tags(cwd: Path, url: str, config: tuple[str, ...] = ()) -> list[str]:
    """Names of the tags at `url` (url.<base>.insteadOf honoured), without cloning it."""
    listing = out(cwd, "ls-remote", "--tags", "--refs", url, config=config)
    return [line.split("refs/tags/", 1)[1] for line in listing.splitlines() if "refs/tags/" in line]


def am_in_progress(repo: Path) -> bool:
    return (git_dir(repo) / "rebase-apply").is_dir()


def unmerged_paths(repo: Path) -> list[str]:
    return out(repo, "diff", "--name-only", "--diff-filter=U").split()


def patch_id(repo: Path, diff_text: str) -> str | None:
    """`git patch-id --stable` of one diff; None for an empty diff."""
    text = out(repo, "patch-id", "--stable", input=diff_text)
    return text.split()[0] if text else None


def patch_ids_of_range(repo: Path, rev_range: str) -> dict[str, str]:
    """patch-id -> commit for every non-merge commit in `rev_range`."""
    log = run(repo, "log", "-p", "--no-merges", "--no-color", rev_range).stdout
    ids = out(repo, "patch-id", "--stable", input=log)
    return {pid: sha for pid, sha in (line.split() for line in ids.splitlines())}


def format_patch(repo: Path, commit: str) -> str:
    """One commit as a mail-formatted patch, byte-stable across machines and configurations."""
    return run(
        repo,
        "format-patch",
        *FORMAT_PATCH_OPTIONS,
        "--stdout",
        "-1",
        commit,
        config=NEUTRAL_DIFF_CONFIG,
    ).stdout


def mailinfo(patch_text: str, cwd: Path) -> tuple[dict[str, str], str]:
    """Split a mail-formatted patch with `git mailinfo`: (headers, commit message body)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        msg, diff = Path(tmp, "msg"), Path(tmp, "diff")
        info = out(cwd, "mailinfo", "-k", "--encoding=UTF-8", str(msg), str(diff), input=patch_text)
        headers = {}
        for line in info.splitlines():
            key, _, value = line.partition(": ")
            headers[key] = value
        return headers, msg.read_text(encoding="utf-8")


def trailers(message: str, cwd: Path) -> list[tuple[str, str]]:
    """(key, value) trailers of a commit message, parsed by git itself."""
    text = run(cwd, "interpret-trailers", "--parse", input=message).stdout
    result = []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        result.append((key.strip(), value.strip()))
    return result


def enable_rerere(repo: Path) -> None:
    """Turn on git rerere in `repo`'s own config: a conflict resolved once is resolved (and staged) again
    when the same conflict comes back. Its records stay in `repo`'s git dir (rr-cache), never elsewhere."""
    set_config(repo, "rerere.enabled", "true")
    set_config(repo, "rerere.autoupdate", "true")


def record_resolutions(repo: Path) -> None:
    """Let rerere record the files resolved so far (before an abort would throw the resolution away)."""
    run(repo, "rerere", check=False)


def staged_changes(repo: Path) -> bool:
    return run(repo, "diff", "--cached", "--quiet", check=False).returncode != 0


def apply_check(repo: Path, base: str, paths: list[Path]) -> tuple[Path, str] | None:
    """Apply `paths` in order to a scratch index at `base` (work tree, index and refs untouched);
    the first failure as (path, git's error), None when all apply."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        run(repo, "read-tree", base, env=env)
        for path in paths:
            proc = run(repo, "apply", "--cached", str(path), env=env, check=False)
            if proc.returncode != 0:
                return path, proc.stderr.strip()[:300]
    return None


_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_FILE_HEADERS = ("new file mode", "deleted file mode", "old mode", "new mode", "rename from", "rename to",
                 "copy from", "copy to", "Binary files", "GIT binary patch")


def changed_lines(patch_text: str) -> list[str]:
    """What a patch changes, without its context, line numbers or blob ids: each file's `diff --git` line and
    mode/rename lines, and the removed and added lines of its hunks (counted, so no line is misread)."""
    found: list[str] = []
    old_left = new_left = 0
    for line in patch_text.split("\n"):
        if old_left > 0 or new_left > 0:
            tag = line[:1]
            if tag in ("+", "-", "\\"):
                found.append(line)
            if tag != "\\":  # "\ No newline at end of file" belongs to the line before it
                old_left -= tag != "+"
                new_left -= tag != "-"
        elif line.startswith("diff --git "):
            found.append(line)
        elif found and (match := _HUNK.match(line)):
            old_left, new_left = int(match[1] or 1), int(match[2] or 1)
        elif found and line.startswith((*_FILE_HEADERS, "\\")):
            found.append(line)
    return found
