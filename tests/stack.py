"""What a test needs from the stack, and whether its absence may skip.

Locally a test whose stack (torch, verl, vLLM, Megatron-core, Ray, ...) or fork source is missing skips, saying
why. Under RL_RECIPE_REQUIRE_STACK=1 (`nox -s tests` sets it, so CI runs with it) such a test fails instead: CI
installs the whole stack and can fetch every fork with a PyPI source. The only skips left there are the sources
CI cannot have, named in UNAVAILABLE_TO_CI. The report hooks below turn any other skip into a failure under the
switch, so a bare `pytest.skip` or `importorskip` cannot hide a missing piece either.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from typing import NoReturn

import pytest

from tools.forks import manifest as manifest_mod

SWITCH = "RL_RECIPE_REQUIRE_STACK"
ROOT = Path(__file__).resolve().parents[1]
INSTALL = "nox -s tests installs the stack and syncs and applies the forks"
GIT = "git"  # what only a fork's git source has


def _unavailable_to_ci() -> dict[str, str]:
    """Source name -> why CI cannot have it: the forks without a PyPI source in forks.toml (CI reaches no
    gitcode), and the forks' git sources, since a fresh clone has no git mirror and syncs from PyPI, whose
    sdists lack some trees (forks.toml's pypi.note says which)."""
    forks = manifest_mod.load(ROOT).forks.values()
    unavailable = {f.name: f"git-only ({f.url}), forks.toml has no PyPI source" for f in forks if f.pypi is None}
    unavailable[GIT] = "a fresh clone has no `git config url.<mirror>.insteadOf <url>`, so forks come from PyPI"
    return unavailable


UNAVAILABLE_TO_CI = _unavailable_to_ci()
_ALLOWED = re.compile(r"needs the (\S+) source, which CI cannot have")


def series(fork: str) -> str:
    """The fix for a missing fork module or patch."""
    return f"sync and apply the {fork} fork, then install it (nox -s tests does both)"


def stack_required() -> bool:
    return os.environ.get(SWITCH) == "1"


def missing(what: str, fix: str = INSTALL) -> NoReturn:
    """A piece the test needs is absent: skip saying why, or fail under the switch (works at module level too)."""
    message = f"{what}: {fix}"
    if stack_required():
        pytest.fail(f"{message} ({SWITCH}=1: CI has the whole stack, so a missing piece fails)", pytrace=False)
    pytest.skip(f"{message} (under {SWITCH}=1 this fails)", allow_module_level=True)


def require(module: str, fix: str = INSTALL):
    """Import `module` (of the stack or of our forks' series), or report it missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing(f"{module} is not importable ({exc})", fix)


def unavailable_reason(source: str, why: str) -> str:
    """The skip reason for a test that needs a source CI cannot have (for `skipif(reason=...)` too)."""
    if source not in UNAVAILABLE_TO_CI:
        raise ValueError(f"{source!r} is not a source CI cannot have; use tests.stack.missing (allowed: "
                         f"{', '.join(sorted(UNAVAILABLE_TO_CI))})")
    return f"needs the {source} source, which CI cannot have ({UNAVAILABLE_TO_CI[source]}): {why}"


def unavailable(source: str, why: str) -> NoReturn:
    """Skip a test that needs a source CI cannot have; the one kind of skip the switch lets through."""
    pytest.skip(unavailable_reason(source, why), allow_module_level=True)


def skip_allowed(reason: str) -> bool:
    """Whether a skip reason is one that `unavailable` gave for an allow-listed source."""
    match = _ALLOWED.search(reason)
    return bool(match) and match.group(1) in UNAVAILABLE_TO_CI


def _fail_hidden_skip(report) -> None:
    if not (stack_required() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not skip_allowed(reason):
        report.outcome = "failed"
        report.longrepr = (f"skipped under {SWITCH}=1, where only a source CI cannot have "
                           f"({', '.join(sorted(UNAVAILABLE_TO_CI))}) may skip: {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_hidden_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_hidden_skip(outcome.get_result())
