"""Session-wide test settings."""

from __future__ import annotations

import os
import sys
import time

import pytest

# The groups of the tests on pytest-xdist's workers (see tests/parallel.py).
from tests.parallel import pytest_collection_modifyitems, pytest_xdist_make_scheduler  # noqa: F401

# Under RL_RECIPE_REQUIRE_STACK=1 a skip fails unless it names a source CI cannot have (see tests/stack.py).
from tests.stack import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401
from tests.threads import RAY_CLIENT_THREADS, native_threads

# One Ray auth mode for the whole session, set before anything imports Ray (it reads the mode once, then). Tests
# start clusters of their own; with a token in ~/.ray, the launcher's cli.main, run in-process, would otherwise
# switch later clusters to token auth while this process stays a disabled-mode client.
os.environ["RAY_AUTH_MODE"] = "disabled"

_status: list[int] = []
_STARTED = time.monotonic()
SLOW_PHASE_S = 60.0  # named as it ends: a CI run cut off at its time limit still shows where the time went


def pytest_runtest_logreport(report):
    if report.duration >= SLOW_PHASE_S and not os.environ.get("PYTEST_XDIST_WORKER"):  # xdist's controller says it
        print(f"\nslow: {report.nodeid} ({report.when}) {report.duration:.0f} s,"
              f" {time.monotonic() - _STARTED:.0f} s into the session", file=sys.stderr, flush=True)


def pytest_sessionfinish(session, exitstatus):
    _status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Name the native threads that will still run while the interpreter finalizes, and leave with pytest's own
    exit status, skipping finalization, only when Ray's GCS client threads are among them.

    A CI run segfaulted once in eight right after "438 passed", in interpreter finalization. Two kinds of threads
    outlived their tests then: the gloo groups that Megatron's destroy_model_parallel leaves referenced (now
    dropped by tests/gloo.py) and those of Ray's in-process GCS client, which Ray 2.60 keeps running after
    ray.shutdown() and Cluster.shutdown() with nothing left to stop them (docs/upstream/ray-exit-threads.md).
    Any other run finalizes normally, so a crash there shows; a failing test still fails the run."""
    running = sorted(native_threads())
    if not running or not _status:
        return
    print(f"\nnative threads still running at exit: {', '.join(running)}", file=sys.stderr)
    ray_threads = RAY_CLIENT_THREADS.intersection(running)
    if ray_threads:
        print(f"leaving without finalization: Ray's {', '.join(sorted(ray_threads))} cannot be stopped"
              " (docs/upstream/ray-exit-threads.md)", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status[-1])
