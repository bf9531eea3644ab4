"""`python -m tools.forks`: the command line over tools.forks.ops (argument parsing and printing only)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from tools.forks import git, ops, rehearsal, sources, upgrade
from tools.forks import port as port_mod
from tools.forks import rebase as rebase_mod
from tools.forks import series as series_mod
from tools.forks.manifest import PROFILES, ManifestError, find_root, load
from tools.forks.port import PortError
from tools.forks.series import Series

EXIT_OK, EXIT_CHECK, EXIT_ERROR, EXIT_STOPPED = 0, 1, 2, 3

REBASE_EPILOG = """\
The work goes into a port directory, third_party/patches/ports/<fork>-<REF>/, that you commit as
you go: port.toml gives each patch of the old series a verdict (pending, ported, reworked, dropped,
obsolete) and a why; each patch that got through is there as export writes it, listed in `series`.
On another machine (or after --abort) the same `--onto REF` replays the port and goes on with the
first pending patch. See third_party/patches/PORTING.md.

Each patch prints one line, [i/N] name: clean | 3-way | conflict | dropped | obsolete. A patch
already upstream (same git patch-id, or emptied by the replay) is dropped with the commit or file
that has it. On a conflict the replay stops (exit 3) naming the patch and files. Then either:
  resolve, `git add`, --continue [--why "what changed and why"]   (ported if its changed lines are
      the old ones, else reworked: a reworked patch needs a why before the rebase can finish)
  --drop NAME --why "upstream does X in file:function (PR #N)"    (or --obsolete: nothing needs it)
  --abort                                                         (git rerere remembers resolutions)
When no patch is pending it moves the pin in forks.toml and the gitlink, writes the series from the
new branch, writes third_party/patches/<fork>/REBASE-<from>-<to>.md with every verdict and its why
and the time the port took, and removes the port directory.

--dry-run shows the whole cost and changes nothing in the fork: it replays the full series
in a scratch repository and gives every patch one result: clean (applies as it stands),
3-way merged, conflict (files and hunks; the patch is left out and the replay goes on,
naming the later patches that need it: those that do not apply at the pin without it),
or already upstream. The table is printed and written as a draft of the REBASE report.
It exits 1 when a patch conflicts (a check that found problems; nothing stopped).
Without the git history (CI, firewalled sites), name a PyPI release as NAME==VERSION (forks with
a `pypi` source): the pinned and the target sdist are compared instead.

A fork without upstream's git history (vLLM: only PyPI sdists here) rebases onto a release too:
`--onto NAME==VERSION --upstream-commit SHA`, SHA being the full commit of the release's tag (its
release page shows it). The replay runs on the release's sdist laid out on the pin's, as --dry-run
builds it; the port is ports/<fork>-<tag>/ (the tag from forks.toml's release_tags) and keeps SHA
as `upstream`, so --continue and other machines need not repeat it. The finish pins ref = the tag,
commit = SHA and pypi = the release's sdist, moves the gitlink to SHA, and leaves the fork a PyPI
tree as `sync` + `apply` make it for the new pin.

  python -m tools.forks rebase verl --onto v0.6.1 --dry-run       # what it will cost
  python -m tools.forks rebase verl --onto v0.6.1                 # start, or pick up the port
  python -m tools.forks rebase vllm --onto vllm==0.11.0 --upstream-commit <40-hex commit of v0.11.0>
  python -m tools.forks rebase verl --status
  python -m tools.forks rebase verl --continue --why "v0.6.1 split fsdp_workers.py; hook moved"
  python -m tools.forks rebase verl --drop NAME --why "upstream does it in utils/device.py (PR #1234)"
  git add third_party/patches/ports && git commit -m "verl port: 12 of 46"   # any time
"""

DESCRIPTION = """\
Manage the pinned upstream forks under third_party/ and their patch series.

Each fork is a submodule pinned to an upstream commit (third_party/forks.toml). Our changes live
as one format-patch file per commit in third_party/patches/<fork>/, in the order of its `series`
file, and as commits on the branch recipe/<fork> inside the submodule. Typical use:

  python -m tools.forks sync            # upstream trees at the pins (git, else PyPI)
  python -m tools.forks apply           # series -> branch recipe/<fork>
  (edit and commit on recipe/<fork> inside third_party/<fork>)
  python -m tools.forks export verl     # branch -> series; review `git diff third_party/patches`
  python -m tools.forks series verl     # the series' topics with their patch counts
  python -m tools.forks rebase verl --onto v0.6.1   # through a port dir; rebase --help
  python -m tools.forks upgrade-report  # every fork's series on its next releases

Exit codes: 0 ok, 1 a check found problems, 2 an operation failed, 3 a rebase stopped (a conflict, or
whys to write).
"""


def _fork_args(p: argparse.ArgumentParser, nargs: str = "*") -> None:
    p.add_argument("forks", nargs=nargs, metavar="FORK", help="fork names from forks.toml (default: all)")


def parser() -> argparse.ArgumentParser:
    # --root and --profile work before or after the command; SUPPRESS keeps a later default
    # from overwriting an earlier value.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=argparse.SUPPRESS,
                        help="repository root (default: found above the current directory)")
    common.add_argument("--profile", choices=PROFILES, default=argparse.SUPPRESS,
                        help="only the forks this device profile installs (for `test`: whose test_profiles name it)")
    top = argparse.ArgumentParser(prog="python -m tools.forks", description=DESCRIPTION, parents=[common],
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help: str, epilog: str = "") -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help + ("\n\n" + epilog if epilog else ""),
                              parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter)

    p = add("status", "One table: pin, source, branch, series and work tree of each fork.",
            "--check exits 1 unless every selected fork is present, applied, current and clean, and\n"
            "the gitlinks, .gitmodules and forks.toml agree.")
    _fork_args(p)
    p.add_argument("--check", action="store_true", help="exit 1 when anything is off")

    p = add("sync", "Bring each fork's upstream tree at its pin.",
            "git: `git submodule update` at the gitlink; url.<mirror>.insteadOf is honoured.\n"
            "pypi: download the pinned distribution (sha256 checked) and lay it out as a git\n"
            "repository whose one commit is tagged with the upstream ref and marked PyPI-derived.\n"
            "auto: git, else pypi, else an error naming what was tried. A present tree is left\n"
            "alone unless --force (which still refuses to drop uncommitted or unexported work).\n"
            "A git tree that holds the pin but sits elsewhere, off recipe/<fork> (an interrupted\n"
            "`git submodule update --init` leaves its clones at the remote's default branch), is\n"
            "checked out at the pin when it holds no commit or change of ours, else refused.")
    _fork_args(p)
    p.add_argument("--source", choices=("auto", "git", "pypi"), default="auto")
    p.add_argument("--force", action="store_true", help="replace a tree that is already present")
    _index_args(p)
    p.add_argument("--dry-run", action="store_true", help="say what would be synced and from where")

    p = add("apply", "Replay each series onto its pin as branch recipe/<fork> (git am -3).",
            "A no-op when the branch already equals the series. Refuses uncommitted work and\n"
            "commits that are not in the series, and says how to export or discard them.")
    _fork_args(p)
    p.add_argument("--dry-run", action="store_true", help="say what would be replayed")

    p = add("series", "List each series' topics with their patch counts, in apply order.",
            "Topics are the `# == name ==` headers of third_party/patches/<fork>/series; a topic the\n"
            "apply order interleaves with others is counted once, with the number of places it appears.\n"
            "Works without the fork sources.")
    _fork_args(p)

    p = add("export", "Write branch recipe/<fork> back as its patch series (deterministic).",
            "Topic headers of the series (`# == name ==` and the `# why` lines under it) stay before\n"
            "their first patch still there; a new commit joins the topic of the one before it.\n"
            "--check writes nothing and exits 1 when the series on disk differs from the branch.")
    _fork_args(p)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 on any difference")

    p = add("check", "Lint every series and port and, where the source is present, replay them.",
            "Lint: listed files exist, every patch is listed, subjects are unique, each patch has a\n"
            "body and the trailers `Reason:` and `Upstream-Status:` (Pending | Submitted <link> |\n"
            "Inappropriate <why>). Fit to send upstream: subjects of at most 72 characters, a\n"
            "`Signed-off-by:` trailer, and no citation of our issue tracker (`issue 8`, `#12`) in the\n"
            "message or its trailers; upstream references are URLs or owner/repo#N. The `series` file\n"
            "reads as export writes it: no comment that export would drop, a blank line before each topic.\n"
            "\n"
            "Ports (third_party/patches/ports/<fork>-<ref>/, see `rebase --help`): port.toml reads, every\n"
            "verdict that needs a why has one (not the TODO placeholder), every ported or reworked patch is\n"
            "there and listed in its `series`, in order, and nothing else is; the patches pass the lint\n"
            "above. Where the fork's source holds the port's `to` commit they are applied onto it in a\n"
            "scratch index (recipe/<fork> and the work tree untouched). On a PyPI tree the release the port\n"
            "goes to is laid out as `rebase --onto NAME==VERSION` does; if that gives `to`, the port is\n"
            "applied onto it, else (another `to`, or the release out of reach) lint only.")
    _fork_args(p)
    _index_args(p, "for a port onto a PyPI release: ")

    p = add("test", "Run the tests the series adds, inside each fork's patched tree.",
            "The test files a patch creates (test_*.py) run with this interpreter's pytest, from the\n"
            "fork's root and without the fork's own conftest files (upstream's need its whole test\n"
            "environment). --profile selects the forks whose test_profiles (forks.toml) name it: a fork\n"
            "the profile does not install is imported from that tree. Arguments after -- go to\n"
            "pytest; options and fork names may come in any order before it. Exits with pytest's status.\n"
            "\n"
            "  python -m tools.forks test megatron --profile cpu -- -x -k rng")
    p.usage = "python -m tools.forks test [-h] [--root ROOT] [--profile {npu,cuda,cpu}] [FORK ...] [-- PYTEST_ARG ...]"
    _fork_args(p)

    p = add("rebase", "Carry a fork's series to a new upstream tag or commit, over as many sessions as it takes.",
            REBASE_EPILOG)
    _fork_args(p, nargs=1)
    p.add_argument("--onto", metavar="REF",
                   help="new upstream tag or commit (starts, or picks up the port for REF); or a PyPI release"
                        " NAME==VERSION, with --upstream-commit or --dry-run")
    p.add_argument("--upstream-commit", metavar="SHA", default="",
                   help="with --onto NAME==VERSION: the 40-hex upstream commit of the release's tag (its release"
                        " page shows it), pinned at the finish; the port keeps it")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--continue", dest="resume", action="store_true",
                      help="go on after resolving the stopped patch (give --why when you changed it)")
    mode.add_argument("--abort", action="store_true",
                      help="leave the replay; recipe/<fork> stays as it was, the port keeps what got through")
    mode.add_argument("--status", action="store_true",
                      help="the port's verdict counts, where it stopped, conflicted files, what is left")
    p.add_argument("--drop", metavar="NAME",
                   help="skip this patch for good (with --why): the stopped one, a later one, or with --onto"
                        " one before the replay starts")
    p.add_argument("--obsolete", action="store_true",
                   help="with --drop: the verdict is obsolete (nothing needs it), not dropped (upstream has it)")
    p.add_argument("--why", metavar="TEXT",
                   help="with --continue: what changed in the patch and why; with --drop: upstream's"
                        " equivalent (file:function, PR) or what went away")
    p.add_argument("--dry-run", action="store_true",
                   help="with --onto: replay the whole series in a scratch repository and report each patch")
    _index_args(p, "for --onto NAME==VERSION: ")

    rule = textwrap.fill(
        f"Targets, per fork: {upgrade.RULE.format(minors='N')} (N: --minors, default {upgrade.DEFAULT_MINORS})."
        " So a pin 0.9.1 gives 0.9.2 (its final, else its newest pre-release) and the newest final (else"
        " pre-release) of 0.10, of 0.11 and of 0.12. Release names come from the fork's git tags where its tree"
        " is a git checkout at the pin, else from its PyPI sdists (targets NAME==VERSION), else from the tags at"
        " its url. forks.toml's release_tags maps tag names to versions (\"v{version}\" unless given,"
        " \"core_v{version}\" for Megatron); the pin's version is its ref read so, or its `release`.", 95)
    p = add("upgrade-report", "Try every series on its fork's next upstream releases; write UPGRADE.md.",
            rule + "\n\n"
            "Each target is `rebase <fork> --onto <target> --dry-run`'s replay in a scratch repository\n"
            "(nothing changes): clean / 3-way / conflict / already upstream per patch. A target that\n"
            "cannot be reached is a row saying why; a fork without patches gets rows that name its\n"
            "releases. Results go to third_party/patches/upgrade.json (the forks run replace their\n"
            "rows, the others stay), and UPGRADE.md is rendered from that file and the forks'\n"
            "third_party/patches/<fork>/upgrade-notes.toml (a runbook and a judgement column; every\n"
            "patch needs its entry there, or the render fails naming it): --render-only renders it\n"
            "again without network or sources. Exits 0 once both are written.\n"
            "\n"
            "  python -m tools.forks upgrade-report\n"
            "  python -m tools.forks upgrade-report verl --minors 1\n"
            "  python -m tools.forks upgrade-report --targets vllm-ascend=+v0.10.0rc1 --targets vllm=vllm==0.10.1\n"
            "  python -m tools.forks upgrade-report --render-only")
    _fork_args(p)
    p.add_argument("--minors", type=int, default=upgrade.DEFAULT_MINORS, metavar="N",
                   help=f"how many minor series after the pin's to try (default {upgrade.DEFAULT_MINORS})")
    p.add_argument("--targets", action="append", default=[], metavar="FORK=REF,...",
                   help="this fork's targets instead of the rule's; FORK=+REF,... adds them to the rule's"
                        " (repeatable; REF: tag, commit or NAME==VERSION)")
    p.add_argument("--render-only", action="store_true",
                   help="render UPGRADE.md from upgrade.json; no network, no sources")
    _index_args(p, "for PyPI releases: ")

    p = add("pins", "Print the pins as the Markdown table the README carries (a test keeps them equal).")
    _fork_args(p)

    p = add("publish", "Push recipe/<fork> to a fork remote and point the submodule at it.",
            "Switches the .gitmodules URL and the gitlink to the published branch, so that clones get\n"
            "our commits from the fork; the series stays the review copy (export --check guards it).")
    _fork_args(p, nargs=1)
    p.add_argument("--remote", required=True, metavar="URL", help="the fork's git remote")
    p.add_argument("--force", action="store_true", help="overwrite the remote branch (after a rebase)")
    p.add_argument("--dry-run", action="store_true", help="print the steps only")
    return top


def _index_args(p: argparse.ArgumentParser, purpose: str = "") -> None:
    p.add_argument("--index-url", action="append", default=[], metavar="URL",
                   help=f"{purpose}simple index to search (repeatable; default $PIP_INDEX_URL or PyPI)")
    p.add_argument("--find-links", action="append", default=[], type=Path, metavar="DIR",
                   help=f"{purpose}folder holding distribution files, searched before any index (repeatable)")


def _indexes(args) -> list[str]:
    return args.index_url or [os.environ.get("PIP_INDEX_URL") or sources.DEFAULT_INDEX]


def main(argv: list[str] | None = None) -> int:
    # What follows `--` is pytest's, split off here: a REMAINDER positional after the fork names took
    # `test megatron --profile cpu`'s --profile for pytest, and argparse files `test -- -q` under FORK.
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser().parse_args(argv)
    if pytest_args and args.command != "test":
        parser().error(f"arguments after -- go to pytest, for `test` only; `{args.command}` takes none")
    args.pytest_args = pytest_args
    try:
        root = (getattr(args, "root", None) or find_root(Path.cwd())).resolve()
        manifest = load(root)
        forks = manifest.select(args.forks, getattr(args, "profile", None), tests=args.command == "test")
        return COMMANDS[args.command](args, manifest, forks)
    except rebase_mod.RebaseStopped as exc:
        print(f"stopped: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    except (ops.ForkError, ManifestError, git.GitError, PortError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _each(forks, action) -> int:
    """Run `action(fork)` for every fork, report per fork, keep going after a failure."""
    failed = 0
    for fork in forks:
        try:
            print(f"{fork.name}: {action(fork)}")
        except (ops.ForkError, git.GitError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            failed += 1
    return EXIT_ERROR if failed else EXIT_OK


def cmd_status(args, manifest, forks) -> int:
    rows, off = [("fork", "pin", "source", "branch", "series", "work tree")], 0
    for fork in forks:
        row, ok = _status_row(manifest.root, fork)
        rows.append(row)
        off += not ok
    _print_plain(rows)
    problems = ops.gitlink_problems(manifest)
    for problem in problems:
        print(f"superproject: {problem}")
    return EXIT_CHECK if args.check and (off or problems) else EXIT_OK


def _print_plain(rows: list[tuple[str, ...]]) -> None:
    """Rows (the first one the header) as left-aligned columns."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _print_table(title: str, rows: list[tuple[str, ...]]) -> None:
    """A rich table where rich is installed (tools.forks runs before anything is), else plain columns."""
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        print(title)
        _print_plain(rows)
        return
    table = Table(title=title, title_justify="left")
    for name in rows[0]:
        table.add_column(name, overflow="fold")
    for row in rows[1:]:
        table.add_row(*(Text(cell) for cell in row))  # Text: a `[...]` in a hunk header is not markup
    Console(highlight=False).print(table)


def _status_row(root: Path, fork) -> tuple[tuple[str, ...], bool]:
    st = ops.state(root, fork)
    pin = f"{fork.ref} @ {fork.commit[:12]}"
    n = len(st.series.names())
    if st.base is None:
        hint = "run sync" if st.source == "absent" else f"{st.source} tree not at the pin, run sync"
        return (fork.name, pin, st.source, "-", f"{n} patches", hint), False
    source = f"pypi ({fork.pypi.file})" if st.source == "pypi" and fork.pypi else st.source
    branch = f"{fork.branch} @ {st.tip[:12]}" if st.tip else "not applied"
    stray = ops.stray_commits(st)
    if st.tip is None:
        series = f"{n} patches, run apply"
    elif stray:
        series = f"{n} patches +{len(stray)} commits not exported"
    elif ops.is_current(st):
        series = f"{n} patches, applied"
    else:
        series = f"{n} patches, stale: run apply"
    dirty = git.dirty_paths(st.path)
    on_branch = git.head_branch(st.path) == fork.branch
    tree = f"{len(dirty)} uncommitted" if dirty else ("clean" if on_branch else "clean, HEAD off branch")
    head = ops.off_pin(st)
    if head:
        tree = f"off pin ({head[:12]}){f', {len(dirty)} uncommitted' if dirty else ''}, run sync"
    ok = ops.is_current(st) and not stray and not dirty and on_branch
    return (fork.name, pin, source, branch, series, tree), ok


def cmd_sync(args, manifest, forks) -> int:
    indexes = _indexes(args)
    failed = 0
    for fork in forks:
        if args.source == "pypi" and fork.pypi is None:
            print(f"{fork.name}: git-only (no PyPI source); skipped")
            continue
        if args.dry_run:
            print(f"{fork.name}: would sync {fork.path} at {fork.ref} ({fork.commit[:12]}) from"
                  f" {_origins(fork, args.source)}")
            continue
        try:
            print(f"{fork.name}: {ops.sync(manifest.root, fork, args.source, args.force, indexes, args.find_links)}")
        except (ops.ForkError, git.GitError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            failed += 1
    return EXIT_ERROR if failed else EXIT_OK


def _origins(fork, source: str) -> str:
    git_origin = fork.url
    pypi_origin = fork.pypi.requirement if fork.pypi else None
    if source == "git":
        return git_origin
    if source == "pypi":
        return str(pypi_origin)
    return f"{git_origin}, else {pypi_origin}" if pypi_origin else f"{git_origin} (git-only)"


def cmd_apply(args, manifest, forks) -> int:
    return _each(forks, lambda fork: ops.apply(manifest.root, fork, dry_run=args.dry_run))


def cmd_export(args, manifest, forks) -> int:
    differing, result = 0, EXIT_OK
    for fork in forks:
        if not args.check:
            result = max(result, _each([fork], lambda f: _describe(ops.export(manifest.root, f))))
            continue
        if ops.state(manifest.root, fork).tip is None:
            print(f"{fork.name}: skipped, no {fork.branch} branch here (source absent or not applied)")
            continue
        try:
            changed = ops.export(manifest.root, fork, check=True)
        except (ops.ForkError, git.GitError) as exc:
            print(f"differs: {exc}", file=sys.stderr)
            differing += 1
            continue
        if changed:
            print(f"{fork.name}: series on disk differs from {fork.branch}: {', '.join(changed)};"
                  f" run `python -m tools.forks export {fork.name}`")
            differing += 1
        else:
            print(f"{fork.name}: series matches {fork.branch}")
    return EXIT_CHECK if differing else result


def _describe(changed: list[str]) -> str:
    return f"wrote {', '.join(changed)}" if changed else "unchanged"


def cmd_series(args, manifest, forks) -> int:
    for fork in forks:
        layout = Series(manifest.root / fork.patches).layout()
        by_topic = series_mod.topics(layout)
        print(f"{fork.name}: {len(layout.names)} patches, {len(by_topic.keys() - {''})} topics")
        for topic, groups in by_topic.items():
            count = sum(len(group.patches) for group in groups)
            places = f" (in {len(groups)} places)" if len(groups) > 1 else ""
            why = next((group.why for group in groups if group.why), "")
            print(f"  {count:3d}  {topic or '(no topic)'}{places}" + (f"\n       {why}" if why else ""))
    return EXIT_OK


def cmd_check(args, manifest, forks) -> int:
    bad = 0
    for fork in forks:
        st = ops.state(manifest.root, fork)
        problems = ops.check(manifest.root, fork)
        where = "lint + applies to the pin" if st.base else "lint only (source absent)"
        for problem in problems:
            print(f"{fork.name}: {problem}")
        if not problems:
            print(f"{fork.name}: ok, {len(st.series.names())} patches ({where})")
        bad += bool(problems)
    index = (_indexes(args), args.find_links)
    return EXIT_CHECK if bad + _check_ports(manifest, forks, bool(args.forks), index) else EXIT_OK


def _check_ports(manifest, forks, chosen: bool, index: tuple[list[str], list[Path]]) -> int:
    """Lint the port directories of the chosen forks (every one when none was named); how many are bad."""
    bad, names = 0, {f.name for f in forks}
    for directory in port_mod.all_dirs(manifest.root):
        owner = next((f for f in manifest.forks.values() if directory in rebase_mod.port_dirs(manifest.root, f.name)),
                     None)
        if owner is None and chosen or owner is not None and owner.name not in names:
            continue
        problems, done = rebase_mod.check_port(manifest.root, owner, directory, *index)
        label = f"port {directory.relative_to(manifest.root)}"
        for problem in problems:
            print(f"{label}: {problem}")
        if not problems:
            print(f"{label}: ok ({done})")
        bad += bool(problems)
    return bad


def cmd_test(args, manifest, forks) -> int:
    status = EXIT_OK
    extra = args.pytest_args
    for fork in forks:
        tests = Series(manifest.root / fork.patches).added_tests()
        if not tests:
            print(f"{fork.name}: the series adds no tests")
            continue
        cwd = manifest.root / fork.path
        missing = [t for t in tests if not (cwd / t).is_file()]
        if missing:
            raise ops.ForkError(f"{fork.name}: {', '.join(missing)} not in {fork.path};"
                                f" run `python -m tools.forks apply {fork.name}`")
        print(f"{fork.name}: {len(tests)} test file(s) of the series, in {fork.path}", flush=True)
        cmd = [sys.executable, "-m", "pytest", "--noconftest", "-p", "no:cacheprovider", "-q", *extra, *tests]
        status = max(status, subprocess.run(cmd, cwd=cwd).returncode)
    return status


def cmd_rebase(args, manifest, forks) -> int:
    fork, root = forks[0], manifest.root
    _check_rebase_args(args)
    drop = rebase_mod.Drop(args.drop, args.why, "obsolete" if args.obsolete else "dropped") if args.drop else None
    if args.abort:
        print(rebase_mod.abort(root, fork))
    elif args.status:
        rows, lines = rebase_mod.status(root, fork, args.onto)
        _print_table(f"{fork.name}: port", rows)
        print("\n".join(lines))
    elif args.resume:
        print(rebase_mod.resume(root, fork, args.why, say=_say))
    elif args.dry_run:
        result = rehearsal.rehearse(root, fork, args.onto, _indexes(args), args.find_links)
        path = rehearsal.write_report(root, fork, result)
        _print_table(f"{fork.name}: dry run of a rebase from {result.old.ref} to {result.new.ref}",
                     [rehearsal.COLUMNS, *result.rows(hunks=False)])  # the report lists the hunks
        print(f"{fork.name}: {result.summary()}; draft report {path.relative_to(root)}")
        return EXIT_CHECK if result.conflicted else EXIT_OK
    elif args.onto:
        print(rebase_mod.start(root, fork, args.onto, say=_say, drop=drop, upstream=args.upstream_commit,
                               index_urls=_indexes(args), find_links=args.find_links))
    else:
        print(rebase_mod.drop(root, fork, drop, say=_say))
    return EXIT_OK


def _check_rebase_args(args) -> None:
    """The combinations `rebase` takes; anything else is an error that names the right form."""
    wrong = None
    if not (args.onto or args.resume or args.abort or args.status or args.drop):
        wrong = "say what to do: --onto REF, --continue, --abort, --status, or --drop NAME --why TEXT"
    elif args.drop and not args.why:
        wrong = f"--drop {args.drop} needs --why \"upstream does X in file:function (PR #N)\" (or what went away)"
    elif args.obsolete and not args.drop:
        wrong = "--obsolete goes with --drop NAME"
    elif args.why and not (args.resume or args.drop):
        wrong = "--why goes with --continue or --drop"
    elif args.dry_run and (not args.onto or args.drop or args.resume or args.abort or args.status):
        wrong = "--dry-run goes with --onto REF alone"
    elif (args.resume or args.abort) and (args.onto or args.drop):
        wrong = "--continue and --abort take no --onto or --drop; run them on their own"
    elif args.status and args.drop:
        wrong = "--status takes no --drop"
    elif args.upstream_commit and not (args.onto and rebase_mod.is_release(args.onto) and not args.dry_run):
        wrong = "--upstream-commit goes with --onto NAME==VERSION, to start or pick up the rebase onto that release"
    if wrong:
        raise ops.ForkError(f"rebase: {wrong}")


def _say(line: str) -> None:
    print(line, flush=True)


def cmd_upgrade_report(args, manifest, forks) -> int:
    root = manifest.root
    if args.render_only:
        doc = upgrade.render_only(manifest)
    else:
        plans = upgrade.plans(root, forks, args.minors, args.targets, _indexes(args), args.find_links)
        for p in plans:
            if p.error:
                print(f"{p.fork.name}: no targets: {p.error}", file=sys.stderr)
        today = datetime.now(UTC).date().isoformat()
        entries = upgrade.run(root, plans, _indexes(args), args.find_links, today, _track)
        doc = upgrade.write(manifest, entries)
    _print_table("cheapest move per fork (fewest conflicts)",
                 [("fork", "pin", "target", "conflicts", "dropped"), *upgrade.cheapest(doc)])
    print(f"wrote {upgrade.REPORT_PATH}" + ("" if args.render_only else f" and {upgrade.JSON_PATH}"))
    return EXIT_OK


def _track(jobs: list, label) -> Iterator:
    """A progress bar over the targets (rich where installed, else one line per target)."""
    try:
        from rich.console import Console
        from rich.progress import Progress
    except ImportError:
        for i, job in enumerate(jobs, 1):
            print(f"[{i}/{len(jobs)}] {label(job)}", flush=True)
            yield job
        return
    with Progress(console=Console(stderr=True)) as progress:
        bar = progress.add_task("targets", total=len(jobs))
        for job in jobs:
            progress.update(bar, description=label(job))
            yield job
            progress.advance(bar)


def cmd_publish(args, manifest, forks) -> int:
    steps = ops.publish(manifest.root, forks[0], args.remote, force=args.force, dry_run=args.dry_run)
    print("\n".join(("would: " if args.dry_run else "done: ") + s for s in steps))
    return EXIT_OK


def pins_table(forks) -> str:
    rows = ["| fork | path | upstream | ref | commit | PyPI fallback | profiles |",
            "|---|---|---|---|---|---|---|"]
    for f in forks:
        fallback = f"`{f.pypi.file}`" if f.pypi else "none (git only)"
        rows.append(f"| {f.name} | `{f.path}` | {f.url} | `{f.ref}` | `{f.commit}` | {fallback} |"
                    f" {', '.join(f.profiles)} |")
    return "\n".join(rows) + "\n"


def cmd_pins(args, manifest, forks) -> int:
    print(pins_table(forks), end="")
    return EXIT_OK


COMMANDS = {
    "pins": cmd_pins,
    "status": cmd_status,
    "sync": cmd_sync,
    "apply": cmd_apply,
    "export": cmd_export,
    "series": cmd_series,
    "check": cmd_check,
    "test": cmd_test,
    "rebase": cmd_rebase,
    "publish": cmd_publish,
    "upgrade-report": cmd_upgrade_report,
}
