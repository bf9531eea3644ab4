"""Session-wide test settings."""

from __future__ import annotations

import os
import sys

import pytest

# Under RL_RECIPE_REQUIRE_STACK=1 a skip fails unless it names a source CI cannot have (see tests/stack.py).
from tests.stack import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401

_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """With RL_RECIPE_TEST_HARD_EXIT=1 (nox -s tests sets it), leave with pytest's own exit status
    once every result is reported, skipping interpreter finalization: tearing down torch, gloo and
    Ray state at exit segfaulted once in eight CI runs here (exit -11 right after "438 passed").
    A failing test still fails the run; only the crash after the report is avoided."""
    if os.environ.get("RL_RECIPE_TEST_HARD_EXIT") == "1" and _status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status[-1])
