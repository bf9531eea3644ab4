"""The train/test arithmetic, and the command line as a user meets it (help texts, usage errors)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.data.schema import Example
from tools.data.writer import held_out_count, split

ROOT = Path(__file__).parents[2]
COMMANDS = ["deepscaler", "gsm8k", "synthetic-arith"]


@pytest.mark.parametrize(("n", "ratio", "expected"), [
    (1000, 0.01, 10),
    (1000, 0.0, 0),
    (1000, 1.0, 1000),
    (10, 0.25, 3),  # 2.5 rounds half up
    (50, 0.01, 1),  # 0.5 rounds up to 1
    (40, 0.01, 1),  # 0.4 would be 0: a ratio above 0 keeps one test row
    (3, 0.99, 2),  # 2.97 would be 3: a ratio below 1 keeps one train row
    (1, 0.5, 1),
    (1, 0.4, 0),
    (0, 0.5, 0),
])
def test_test_count(n, ratio, expected):
    assert held_out_count(n, ratio) == expected


def test_split_keeps_source_order_and_covers_every_example():
    examples = [Example(i, f"p{i}", str(i), "") for i in range(20)]
    parts = split(examples, 0.25, seed=7)
    assert len(parts["test"]) == 5
    assert sorted(parts["train"] + parts["test"], key=lambda e: e.index) == examples
    assert parts["train"] == sorted(parts["train"], key=lambda e: e.index)
    assert split(examples, 0.25, seed=7) == parts


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.data", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_top_level_help():
    result = run("--help")
    assert result.returncode == 0
    for text in [*COMMANDS, "verl", "\\boxed{}", "--skip-bad", "Exit codes"]:
        assert text in result.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command):
    result = run(command, "--help")
    assert result.returncode == 0
    for option in ("--dst", "--test-ratio", "--seed", "--instruction", "--dry-run"):
        assert option in result.stdout
    assert ("--src" in result.stdout) == (command != "synthetic-arith")


@pytest.mark.parametrize(("args", "message"), [
    ([], "required"),
    (["deepscaler", "--dst", "x"], "--src"),
    (["synthetic-arith", "--dst", "x", "--test-ratio", "1.5"], "outside 0.0..1.0"),
    (["synthetic-arith", "--dst", "x", "--test-ratio", "lots"], "not a number"),
    (["synthetic-arith", "--dst", "x", "--n", "0"], "below the minimum 1"),
    (["synthetic-arith", "--dst", "x", "--ops", "+/"], "one or more of '+-*'"),
    (["synthetic-arith", "--dst", "x", "--max-terms", "1"], "below the minimum 2"),
])
def test_usage_errors_exit_2(args, message):
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr


def test_bad_input_exits_1(tmp_path):
    src = tmp_path / "ds.json"
    src.write_text('[{"problem": "P"}]')
    result = run("deepscaler", "--src", str(src), "--dst", str(tmp_path / "o"))
    assert result.returncode == 1
    assert "error:" in result.stderr and "row 0: missing field 'answer'" in result.stderr


def test_progress_bar_only_for_large_conversions(tmp_path):
    small = run("synthetic-arith", "--dst", str(tmp_path / "s"), "--n", "100")
    large = run("synthetic-arith", "--dst", str(tmp_path / "l"), "--n", "12000", "--test-ratio", "0")
    assert small.returncode == large.returncode == 0
    assert "row/s" not in small.stderr
    assert "12000/12000" in large.stderr
