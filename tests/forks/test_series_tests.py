"""`tools.forks test`: the test files a series creates are found from the patches themselves and run in the fork."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tools.forks.series import Series

PATCH = """From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
Subject: [PATCH] Add a thing

diff --git a/pkg/thing.py b/pkg/thing.py
new file mode 100644
--- /dev/null
+++ b/pkg/thing.py
@@ -0,0 +1 @@
+VALUE = 3
diff --git a/tests/test_old.py b/tests/test_old.py
index 1111111..2222222 100644
--- a/tests/test_old.py
+++ b/tests/test_old.py
@@ -1 +1 @@
-x = 1
+x = 2
diff --git a/tests/unit/test_thing.py b/tests/unit/test_thing.py
new file mode 100644
--- /dev/null
+++ b/tests/unit/test_thing.py
@@ -0,0 +1 @@
+def test_value(): from pkg.thing import VALUE; assert VALUE == {value}
diff --git a/tests/unit/helpers.py b/tests/unit/helpers.py
new file mode 100644
"""


def _series(tmp_path: Path, value: int) -> Series:
    d = tmp_path / "patches"
    d.mkdir()
    (d / "add-a-thing.patch").write_text(PATCH.format(value=value))
    (d / "series").write_text("add-a-thing.patch\n")
    return Series(d)


def test_only_created_test_files_are_listed(tmp_path):
    assert _series(tmp_path, 3).added_tests() == ["tests/unit/test_thing.py"]  # not a changed test, not a helper


def _fork(tmp_path: Path, value: int, profiles: str = 'profiles = ["cpu"]\n') -> Path:
    """A repository whose manifest names one fork, with the series' files laid out as if applied; the fork is not
    installed, so its test imports pkg.thing from the tree."""
    root = tmp_path / "repo"
    (root / "third_party" / "patches").mkdir(parents=True)
    series = _series(tmp_path, value)
    series.dir.rename(root / "third_party" / "patches" / "thing")
    tree = root / "third_party" / "thing"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "thing.py").write_text("VALUE = 3\n")
    (tree / "tests" / "unit").mkdir(parents=True)
    (tree / "tests" / "unit" / "test_thing.py").write_text(
        f"def test_value():\n    from pkg.thing import VALUE\n    assert VALUE == {value}\n")
    (root / "third_party" / "forks.toml").write_text(
        'schema = 1\n[forks.thing]\npath = "third_party/thing"\nurl = "https://example.invalid/thing.git"\n'
        'ref = "v1"\ncommit = "' + "0" * 40 + '"\npatches = "third_party/patches/thing"\ndistribution = "thing"\n'
        + profiles)
    return root


def _run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.forks", "--root", str(root), "test", *(args or ["thing"])],
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])


def test_the_command_runs_them_in_the_fork_and_fails_with_them(tmp_path):
    good = _run(_fork(tmp_path / "a", 3))
    assert good.returncode == 0, good.stdout + good.stderr
    assert "1 test file(s) of the series" in good.stdout and "1 passed" in good.stdout
    bad = _run(_fork(tmp_path / "b", 4))  # the fork's test asserts a value the tree does not have
    assert bad.returncode == 1 and "1 failed" in bad.stdout


def test_a_profile_runs_the_tests_of_the_forks_whose_test_profiles_name_it(tmp_path):
    npu_only = 'profiles = ["npu"]\n'
    not_declared = _run(_fork(tmp_path / "a", 3, npu_only), "--profile", "cpu")
    assert not_declared.returncode == 0 and "test file(s)" not in not_declared.stdout, not_declared.stdout
    declared = _run(_fork(tmp_path / "b", 3, npu_only + 'test_profiles = ["npu", "cpu"]\n'), "--profile", "cpu")
    assert declared.returncode == 0, declared.stdout + declared.stderr
    assert "thing: 1 test file(s) of the series" in declared.stdout and "1 passed" in declared.stdout


def test_options_may_follow_the_fork_names_and_what_follows_dashes_goes_to_pytest(tmp_path):
    root = _fork(tmp_path / "a", 3, 'profiles = ["npu"]\ntest_profiles = ["npu", "cpu"]\n')
    not_declared = _run(root, "thing", "--profile", "cuda")  # was handed to pytest, which refused it
    assert not_declared.returncode == 0 and "test file(s)" not in not_declared.stdout, \
        not_declared.stdout + not_declared.stderr
    deselected = _run(root, "thing", "--profile", "cpu", "--", "-k", "no_such_test")
    assert deselected.returncode == 5 and "1 deselected" in deselected.stdout, deselected.stdout + deselected.stderr
    every_fork = _run(root, "--", "-k", "value")  # was read as the fork names "-k" and "value"
    assert every_fork.returncode == 0 and "1 passed" in every_fork.stdout, every_fork.stdout + every_fork.stderr
    other = subprocess.run([sys.executable, "-m", "tools.forks", "--root", str(root), "status", "--", "-q"],
                           capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert other.returncode == 2 and "for `test` only; `status` takes none" in other.stderr
