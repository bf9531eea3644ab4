"""Patch series on disk: `third_party/patches/<fork>/series` plus one format-patch file per commit.

The `series` file lists patch files in the order they apply; `#` starts a comment. File names are
derived from subjects (no numbers), so inserting a patch renames nothing else.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tools.forks import git

SERIES = "series"
UPSTREAM_STATUS = re.compile(r"^(Pending|Submitted \S+|Inappropriate \S.*)$")
# a file the patch creates: `diff --git a/X b/X` followed by `new file mode`
NEW_FILE = re.compile(r"^diff --git a/(\S+) b/\1\nnew file mode", re.MULTILINE)
SERIES_HEADER = "# Order in which the patches apply (tools.forks export writes this file).\n"
SUBJECT_MAX = 72  # what upstream maintainers (and git log --oneline) read without wrapping
SLUG_MAX = 64  # git format-patch's file-name length; we cut at a word boundary instead of mid-word
SIGN_OFF = "Signed-off-by"  # the DCO line vLLM's CI (and many upstreams) require on every commit
# Our own tracker, cited as "issue 8", "issues 6/7" or "#12". An upstream reference is written as a
# URL or as owner/repo#N, which the lookbehind and the URL scrub leave alone.
TRACKER_REF = re.compile(r"\bissues?\s+#?\d+(?:\s*(?:/|,|and|&)\s*#?\d+)*|(?<![\w/.-])#\d+\b", re.IGNORECASE)
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+", re.IGNORECASE)


@dataclass(frozen=True)
class Patch:
    file: str
    subject: str
    message: str  # commit message body (after the subject), trailers included
    trailers: dict[str, str]


class Series:
    def __init__(self, directory: Path):
        self.dir = directory

    @property
    def series_file(self) -> Path:
        return self.dir / SERIES

    def names(self) -> list[str]:
        """Patch files in order; empty when the series does not exist yet."""
        if not self.series_file.is_file():
            return []
        lines = self.series_file.read_text(encoding="utf-8").splitlines()
        return [s for s in (line.split("#", 1)[0].strip() for line in lines) if s]

    def paths(self) -> list[Path]:
        return [self.dir / n for n in self.names()]

    def digest(self) -> str:
        """Hash of the series file and every listed patch: what `apply` stamps a branch with."""
        h = hashlib.sha256()
        for name in self.names():
            path = self.dir / name
            h.update(name.encode() + b"\0")
            h.update(path.read_bytes() if path.is_file() else b"<missing>")
            h.update(b"\0")
        return h.hexdigest()

    def added_tests(self) -> list[str]:
        """Test files (``test_*.py``) the patches create, as paths in the fork's tree, in series order."""
        found = []
        for path in self.paths():
            text = path.read_text(encoding="utf-8") if path.is_file() else ""
            for match in NEW_FILE.finditer(text):
                name = match.group(1)
                if os.path.basename(name).startswith("test_") and name.endswith(".py") and name not in found:
                    found.append(name)
        return found

    def files_on_disk(self) -> list[str]:
        return sorted(p.name for p in self.dir.glob("*.patch")) if self.dir.is_dir() else []


def parse(patch_path: Path, cwd: Path) -> Patch:
    headers, message = git.mailinfo(patch_path.read_text(encoding="utf-8"), cwd)
    pairs = git.trailers(message, cwd)
    return Patch(patch_path.name, headers.get("Subject", ""), message, dict(pairs))


def lint(series: Series, cwd: Path) -> list[str]:
    """Problems of a series as sentences naming the file and the fix; empty when clean."""
    problems: list[str] = []
    names = series.names()
    listed = set(names)
    if series.files_on_disk() and not series.series_file.is_file():
        problems.append(f"{series.dir}: patches exist but no `series` file lists their order")
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{series.series_file}: {dup} is listed twice")
    for name in names:
        if not (series.dir / name).is_file():
            problems.append(f"{series.series_file}: lists {name}, which does not exist")
    for name in series.files_on_disk():
        if name not in listed:
            problems.append(f"{series.dir / name}: not listed in `series`; add it or delete it")
    subjects: dict[str, str] = {}
    for path in series.paths():
        if not path.is_file():
            continue
        patch = parse(path, cwd)
        where = f"{path}"
        if not patch.subject:
            problems.append(f"{where}: no Subject line")
        elif patch.subject in subjects:
            problems.append(f"{where}: subject {patch.subject!r} repeats {subjects[patch.subject]}")
        subjects.setdefault(patch.subject, path.name)
        trailer_lines = {f"{k}: {v}" for k, v in patch.trailers.items()}
        body = [s for s in map(str.strip, patch.message.splitlines()) if s and s not in trailer_lines]
        if not body:
            problems.append(f"{where}: the message has no body saying why the change exists")
        if not patch.trailers.get("Reason"):
            problems.append(f"{where}: missing trailer `Reason: <why we carry it>`")
        status = patch.trailers.get("Upstream-Status", "")
        if not UPSTREAM_STATUS.match(status):
            problems.append(
                f"{where}: trailer Upstream-Status is {status!r}; use `Pending`,"
                " `Submitted <link>` or `Inappropriate <why>`"
            )
        problems += [f"{where}: {problem}" for problem in sendable_problems(patch)]
    return problems


def sendable_problems(patch: Patch) -> list[str]:
    """What keeps a patch from being sent upstream as it stands: each as `rule; fix`."""
    problems = []
    if len(patch.subject) > SUBJECT_MAX:
        problems.append(f"subject is {len(patch.subject)} characters (rule: at most {SUBJECT_MAX}); shorten it"
                        " on the branch (`git rebase -i`, reword) and export")
    if not patch.trailers.get(SIGN_OFF):
        problems.append(f"missing trailer `{SIGN_OFF}: Name <email>` (rule: DCO, required upstream); add it"
                        " with `git commit --amend -s` or `git rebase --signoff <base>` and export")
    for line in patch.message.splitlines():
        for ref in TRACKER_REF.findall(URL.sub("", line)):
            problems.append(f"cites our issue tracker ({ref.strip()!r} in {line.strip()!r}; rule: messages and"
                            " trailers must make sense upstream); say the why in words, or link upstream by URL")
    return problems


def subject_slug(subject: str) -> str:
    """The subject's words, lower case and dash-joined, cut after the last whole word that fits SLUG_MAX."""
    words = re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-").split("-")
    text = words[0][:SLUG_MAX]  # a single word longer than the limit is the only one cut
    for word in words[1:]:
        if len(text) + 1 + len(word) > SLUG_MAX:
            break
        text += "-" + word
    return text or "patch"


def file_name(subject: str, taken: set[str]) -> str:
    """A readable, unique file name from a subject line."""
    stem = subject_slug(subject)
    name, n = f"{stem}.patch", 2
    while name in taken:
        name, n = f"{stem}-{n}.patch", n + 1
    return name


def render(repo: Path, commit_ids: list[str]) -> dict[str, str]:
    """Patch file name -> content for commits (oldest first), plus the `series` text under SERIES."""
    files: dict[str, str] = {}
    for sha in commit_ids:
        subject = git.out(repo, "log", "-1", "--format=%s", sha)
        files[file_name(subject, set(files))] = git.format_patch(repo, sha)
    files[SERIES] = SERIES_HEADER + "".join(f"{name}\n" for name in files)
    return files


def differences(series: Series, rendered: dict[str, str]) -> list[str]:
    """Files that would change if `rendered` were written to the series directory."""
    changed = []
    for name, text in rendered.items():
        path = series.dir / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            changed.append(name)
    changed += [name for name in series.files_on_disk() if name not in rendered]
    return changed


def write(series: Series, rendered: dict[str, str]) -> list[str]:
    """Write changed files atomically, delete stale patches; returns the names touched."""
    touched = differences(series, rendered)
    series.dir.mkdir(parents=True, exist_ok=True)
    for name in touched:
        path = series.dir / name
        if name not in rendered:
            path.unlink()
            continue
        fd, tmp = tempfile.mkstemp(dir=series.dir, prefix=f".{name}.")
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(rendered[name])
        os.replace(tmp, path)
    return touched
