"""ruff's pyflakes rules (F) over the Python files our verl, vLLM and Megatron series touch, in the patched trees.

Two sets of findings count. Anywhere in a touched file: the F codes that are errors when the code runs (undefined
names F821/F822/F823, syntax-level F7xx, %-format and str.format misuse F50x/F52x, comparisons with `is` F632),
since a hunk of ours can break an upstream line (drop the import a later line uses). On the lines our series adds
only: every F code, so our code brings no unused import or variable either, while upstream's own F401/F841 in the
files we touch (dozens: verl re-exports by import) are upstream's to fix, and so are the runtime errors upstream
already has at the pin (compared by path, code and message, since line numbers move). The added lines are those
of `git diff <base>` in the fork tree, which tools.forks keeps as a git repository at the pin.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from tests import stack
from tools.forks import manifest as manifest_mod
from tools.forks import ops
from tools.forks.series import Series

ROOT = stack.ROOT
FORKS = ("verl", "vllm", "megatron")
RUNTIME_ERRORS = re.compile(r"F82[123]|F7\d\d|F5[02]\d|F632")
_HUNK = re.compile(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@")


def ruff() -> str:
    """ruff from the test dependency group (`nox -s tests` installs it), else one on PATH."""
    try:
        from ruff.__main__ import find_ruff_bin

        return str(find_ruff_bin())
    except ImportError:
        found = shutil.which("ruff")
        return found or stack.missing("ruff is not installed", "pip install the test group of pyproject.toml")


def touched_python_files(patches: Path) -> list[str]:
    """The .py paths the series' patches write (their `+++ b/` lines), in series order."""
    files: list[str] = []
    for patch in Series(patches).paths():
        for line in patch.read_text().splitlines():
            path = line.removeprefix("+++ b/")
            if path != line and path.endswith(".py") and path not in files:
                files.append(path)
    return files


def added_lines(tree: Path, base: str, files: list[str]) -> dict[str, set[int]]:
    """Path -> the line numbers (in the tree as it is) that differ from `base`."""
    diff = subprocess.run(["git", "diff", "-U0", "--no-color", "--no-ext-diff", base, "--", *files], cwd=tree,
                          capture_output=True, text=True, check=True).stdout
    added: dict[str, set[int]] = {}
    path = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            path = line.removeprefix("+++ b/")
        elif m := _HUNK.match(line):
            start, count = int(m.group(1)), int(m.group(2) or 1)
            added.setdefault(path, set()).update(range(start, start + count))
    return added


def _ruff_f(tree: Path, files: list[str]) -> list[dict]:
    proc = subprocess.run([ruff(), "check", "--isolated", "--no-cache", "--select", "F", "--output-format", "json",
                           "--exit-zero", *files], cwd=tree, capture_output=True, text=True, check=True)
    return [{**f, "path": str(Path(f["filename"]).relative_to(tree.resolve()))} for f in json.loads(proc.stdout)]


def _at_base(tree: Path, base: str, files: list[str]) -> Counter:
    """(path, code, message) of upstream's own runtime-error findings at the pin (line numbers move, these do not)."""
    with tempfile.TemporaryDirectory() as scratch:
        existing = subprocess.run(["git", "ls-tree", "--name-only", base, "--", *files], cwd=tree,
                                  capture_output=True, text=True, check=True).stdout.split()
        archive = subprocess.run(["git", "archive", base, "--", *existing], cwd=tree, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", scratch], input=archive, check=True)
        found = _ruff_f(Path(scratch), existing) if existing else []
    return Counter((f["path"], f["code"], f["message"]) for f in found if RUNTIME_ERRORS.fullmatch(f["code"]))


def pyflakes_problems(tree: Path, base: str, files: list[str]) -> list[str]:
    """`path:line: code message` for each finding that counts (see the module docstring)."""
    added, upstream = added_lines(tree, base, files), _at_base(tree, base, files)
    problems = []
    for found in _ruff_f(tree, files):
        key, row = (found["path"], found["code"], found["message"]), found["location"]["row"]
        if RUNTIME_ERRORS.fullmatch(found["code"]) and upstream[key]:
            upstream[key] -= 1  # upstream's own (megatron's distrib_optimizer reads an undefined fp8_flag)
        elif RUNTIME_ERRORS.fullmatch(found["code"]) or row in added.get(found["path"], ()):
            problems.append(f"{found['path']}:{row}: {found['code']} {found['message']}")
    return problems


@pytest.mark.parametrize("name", FORKS)
def test_the_series_adds_no_pyflakes_error(name):
    fork = manifest_mod.load(ROOT).forks[name]
    state = ops.state(ROOT, fork)
    if state.base is None:
        stack.missing(f"the {name} tree at {fork.path} is not at its pin", stack.series(name))
    files = [f for f in touched_python_files(ROOT / fork.patches) if (state.path / f).is_file()]
    assert files, f"no Python file of the {name} series found in {state.path}"
    assert pyflakes_problems(state.path, state.base, files) == []


def test_an_undefined_name_of_ours_is_caught_and_upstream_s_unused_import_is_not(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    module = tmp_path / "mod.py"
    module.write_text("import os\nimport sys\n\n\ndef f():\n    return sys.argv\n")  # upstream: os unused
    git("init", "-q")
    git("add", "mod.py")
    git("-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-q", "-m", "upstream")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    # our hunk: drops the sys import that an upstream line reads, and adds a line with an unused import
    module.write_text("import os\n\n\ndef f():\n    import json\n    return sys.argv\n")
    assert pyflakes_problems(tmp_path, base, ["mod.py"]) == [
        "mod.py:5: F401 `json` imported but unused",
        "mod.py:6: F821 Undefined name `sys`",
    ]
