"""Patch series on disk: `third_party/patches/<fork>/series` plus one format-patch file per commit.

The `series` file lists patch files in the order they apply; `#` starts a comment. File names are
derived from subjects (no numbers), so inserting a patch renames nothing else. Topic headers group the
patches for readers, without changing their order:

    # == CPU backend ==
    # the trainer runs on CPUs for tests and small machines   (optional: one or more "why" lines)
    answer-verl-s-device-memory-and-seeding-calls-on-cpu.patch

A topic may recur when the apply order interleaves it with others. `export` keeps every header before
the first of its patches that is still there; a new patch simply follows its predecessor.
"""

from __future__ import annotations

import hashlib
import itertools
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
TOPIC = re.compile(r"^# == (?P<name>\S.*?) ==$")
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


@dataclass(frozen=True)
class Group:
    """Consecutive patches under one topic header; the header is empty for patches before any topic."""

    header: tuple[str, ...]  # the `# == name ==` line, then its `# why` lines
    patches: tuple[str, ...]

    @property
    def topic(self) -> str:
        return TOPIC.match(self.header[0])["name"] if self.header else ""

    @property
    def why(self) -> str:
        return " ".join(line[1:].strip() for line in self.header[1:])


@dataclass(frozen=True)
class Layout:
    """A parsed `series` file: its groups in order, and what `export` would not write back."""

    groups: tuple[Group, ...]
    lost: tuple[str, ...]  # "line N: what and the fix", for comments outside topic headers and the like

    @property
    def names(self) -> list[str]:
        return [name for group in self.groups for name in group.patches]


def parse_layout(text: str) -> Layout:
    """The one reader of `series` text: patches in order, grouped under their topic headers.

    Blank lines and comments are never patches. The top comment and topic headers (with the `#`
    lines right under them) are what `export` writes back; any other comment is reported in `lost`.
    """
    groups: list[tuple[int, list[str], list[str]]] = [(0, [], [])]  # (line of the header, header, patches)
    lost: list[tuple[int, str]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        _, header, patches = groups[-1]
        if TOPIC.match(line):
            groups.append((number, [line], []))
        elif line.startswith("#"):
            if header and not patches:
                header.append(line)
            elif number > 1 or line != SERIES_HEADER.strip():
                lost.append((number, f"comment {line!r} is not under a `# == topic ==` header; export drops"
                                     " it: make it a topic header, or a `# why` line right under one"))
        elif line:
            name, _, comment = line.partition("#")
            if comment:
                lost.append((number, f"comment after {name.strip()!r}; export drops it: move it into the"
                                     " topic header above"))
            patches.append(name.strip())
    lost += [(number, f"topic {header[0]!r} has no patches; export drops it: delete it or list patches under it")
             for number, header, patches in groups if header and not patches]
    return Layout(tuple(Group(tuple(h), tuple(p)) for _, h, p in groups if p),
                  tuple(f"line {number}: {problem}" for number, problem in sorted(lost)))


def arrange(old: Layout, names: list[str]) -> Layout:
    """Lay out `names` (the new apply order) under the headers of `old`.

    A header goes before the first of its patches still present (so a header whose patches all
    disappeared is dropped); any other patch, new ones included, follows its predecessor.
    """
    present = set(names)
    anchors: dict[str, tuple[str, ...]] = {}
    for group in old.groups:
        first = next((n for n in group.patches if n in present), None)
        if group.header and first:
            anchors.setdefault(first, group.header)
    groups: list[tuple[tuple[str, ...], list[str]]] = [((), [])]
    for name in names:
        if name in anchors:
            groups.append((anchors[name], []))
        groups[-1][1].append(name)
    return Layout(tuple(Group(h, tuple(p)) for h, p in groups if p), ())


def format_layout(layout: Layout) -> str:
    """`series` text as export writes it: the top comment, then each group, a blank line before a header."""
    text = SERIES_HEADER
    for group in layout.groups:
        if group.header:
            text += "\n" + "".join(f"{line}\n" for line in group.header)
        text += "".join(f"{name}\n" for name in group.patches)
    return text


def topics(layout: Layout) -> dict[str, list[Group]]:
    """The groups of each topic, topics in order of first appearance ("" for patches before any header)."""
    by_topic: dict[str, list[Group]] = {}
    for group in layout.groups:
        by_topic.setdefault(group.topic, []).append(group)
    return by_topic


class Series:
    def __init__(self, directory: Path):
        self.dir = directory

    @property
    def series_file(self) -> Path:
        return self.dir / SERIES

    def layout(self) -> Layout:
        """The parsed `series` file; no groups when it does not exist yet."""
        if not self.series_file.is_file():
            return Layout((), ())
        return parse_layout(self.series_file.read_text(encoding="utf-8"))

    def names(self) -> list[str]:
        """Patch files in order; empty when the series does not exist yet."""
        return self.layout().names

    def paths(self) -> list[Path]:
        return [self.dir / n for n in self.names()]

    def digest(self) -> str:
        """Hash of the listed patches, names and contents, in order: what `apply` stamps a branch with.
        Comments and topic headers do not count, so editing them asks for no rebuild."""
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
    layout = series.layout()
    names = layout.names
    listed = set(names)
    if series.files_on_disk() and not series.series_file.is_file():
        problems.append(f"{series.dir}: patches exist but no `series` file lists their order")
    problems += [f"{series.series_file}: {lost}" for lost in layout.lost]
    if series.series_file.is_file() and not layout.lost:
        problems += _layout_problems(series.series_file, layout)
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{series.series_file}: {dup} is listed twice")
    for name in names:
        if not (series.dir / name).is_file():
            problems.append(f"{series.series_file}: lists {name}, which does not exist")
    for name in series.files_on_disk():
        if name not in listed:
            problems.append(f"{series.dir / name}: not listed in `series`; add it or delete it")
    return problems + lint_patches([p for p in series.paths() if p.is_file()], cwd)


def lint_patches(paths: list[Path], cwd: Path) -> list[str]:
    """Problems of the patch files themselves: subject, body, trailers, fit to send upstream."""
    problems: list[str] = []
    subjects: dict[str, str] = {}
    for path in paths:
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


def _layout_problems(path: Path, layout: Layout) -> list[str]:
    """The first line where the file differs from what export would write (blank lines, spacing)."""
    have = path.read_text(encoding="utf-8").split("\n")
    want = format_layout(layout).split("\n")
    for number, (line, expected) in enumerate(itertools.zip_longest(have, want), 1):
        if line != expected:
            shown = [repr(x) if x is not None else "the end of the file" for x in (line, expected)]
            return [f"{path}: line {number} is {shown[0]}, export writes {shown[1]} (the top comment, the"
                    " patches, a blank line before each `# == topic ==` header and nowhere else, a final newline)"]
    return []


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


def render(repo: Path, commit_ids: list[str], on_disk: Layout) -> dict[str, str]:
    """Patch file name -> content for commits (oldest first), plus the `series` text under SERIES,
    its patches grouped under the topic headers of `on_disk` (the series being replaced)."""
    names = file_names(repo, commit_ids)
    files = {name: git.format_patch(repo, sha) for name, sha in zip(names, commit_ids, strict=True)}
    files[SERIES] = format_layout(arrange(on_disk, list(files)))
    return files


def file_names(repo: Path, commit_ids: list[str]) -> list[str]:
    """The patch file name of each commit (oldest first), as export names them."""
    names: list[str] = []
    for sha in commit_ids:
        names.append(file_name(git.out(repo, "log", "-1", "--format=%s", sha), set(names)))
    return names


def renamed(layout: Layout, names: dict[str, str]) -> Layout:
    """`layout` with patches renamed (old file name -> new), so that their topic headers follow them."""
    return Layout(tuple(Group(g.header, tuple(names.get(n, n) for n in g.patches)) for g in layout.groups),
                  layout.lost)


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
        replace_text(path, rendered[name])
    return touched


def replace_text(path: Path, text: str) -> None:
    """Write `text` byte for byte (no newline translation) through a temp file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
        handle.write(text)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a file of the repository is for everyone
    os.replace(tmp, path)
