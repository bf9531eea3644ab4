"""The CI switch of tests/stack.py: under RL_RECIPE_REQUIRE_STACK=1 a missing piece fails, and only a source CI
cannot have may skip. Each case runs pytest on a small test file of its own, in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import stack

ROOT = stack.ROOT
CASES = '''
import pytest
from tests import stack

def test_missing_module():
    stack.require("no_such_module_of_the_stack")

def test_bare_skip():
    pytest.skip("something is absent")

def test_importorskip():
    pytest.importorskip("no_such_module_either")

def test_needs_mindspeed():
    stack.unavailable("mindspeed", "reads MindSpeed's parser")

@pytest.mark.skipif(True, reason=stack.unavailable_reason("mindspeed-llm", "reads MindSpeed-LLM"))
def test_marked_mindspeed_llm():
    pass

@pytest.mark.skipif(True, reason="needs the vllm source, which CI cannot have (a reason copied by hand)")
def test_vllm_passed_off_as_unavailable():
    pass

def test_passes():
    pass
'''
MODULE_SKIP = 'from tests import stack\nstack.require("no_such_module_at_import")\n\ndef test_never_runs():\n    pass\n'


# The child's conftest: our hooks, and a log of each test's final outcome (after our hooks changed it).
CONFTEST = """
import json, os
from tests.stack import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401

def _log(name, outcome):
    with open(os.environ["OUTCOMES"], "a") as f:
        f.write(json.dumps([name, outcome]) + "\\n")

def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _log(report.nodeid.split("::")[-1], report.outcome)

def pytest_collectreport(report):
    if report.outcome != "passed":
        _log(report.nodeid, report.outcome)
"""


def _outcomes(tmp_path, switch: str | None) -> dict[str, str]:
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    log = tmp_path / "outcomes.jsonl"
    env = {k: v for k, v in os.environ.items() if k != stack.SWITCH}
    env.update(PYTHONPATH=str(ROOT), OUTCOMES=str(log))
    if switch is not None:
        env[stack.SWITCH] = switch
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir",
                    str(tmp_path), "--continue-on-collection-errors", str(tmp_path)],
                   cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return dict(json.loads(line) for line in log.read_text().splitlines())


def test_without_the_switch_a_missing_piece_skips(tmp_path):
    got = _outcomes(tmp_path, None)
    assert got == {"test_missing_module": "skipped", "test_bare_skip": "skipped", "test_importorskip": "skipped",
                   "test_needs_mindspeed": "skipped", "test_marked_mindspeed_llm": "skipped",
                   "test_vllm_passed_off_as_unavailable": "skipped", "test_passes": "passed",
                   "test_module_skip.py": "skipped"}


def test_under_the_switch_only_a_source_ci_cannot_have_skips(tmp_path):
    got = _outcomes(tmp_path, "1")
    assert got == {"test_missing_module": "failed", "test_bare_skip": "failed", "test_importorskip": "failed",
                   "test_needs_mindspeed": "skipped", "test_marked_mindspeed_llm": "skipped",
                   "test_vllm_passed_off_as_unavailable": "failed", "test_passes": "passed",
                   "test_module_skip.py": "failed"}


def test_the_allow_list_is_the_forks_without_a_pypi_source_and_git():
    assert set(stack.UNAVAILABLE_TO_CI) == {"mindspeed", "mindspeed-llm", stack.GIT}
    with pytest.raises(ValueError, match="'vllm' is not a source CI cannot have"):
        stack.unavailable_reason("vllm", "vLLM has a PyPI source")
