"""How the suite is spread over pytest-xdist's workers (`nox -s tests` runs one per core, up to 4).

Half the suite's time one core idles (pip, git, single-process tests, waits on subprocesses), so two workers finish
it sooner. A test module runs whole on one worker, so its module fixtures (a gloo world, a vLLM engine, a launch) are
made once. The modules that start Ray clusters run one after another on one worker, first, as together they take
longest: no two clusters then share the machine (the smoke checks count the Ray processes started during their run,
and the recipe runs share one session fixture). A bare `pytest` runs everything in one process, as before.

xdist's own `--dist loadgroup` cannot do this under pytest 9.2: it renames test ids through `Item._nodeid`, which
pytest no longer reads, so every group is ignored. The scheduler below groups by module path instead.
"""

from __future__ import annotations

import os

import pytest

RAY_GROUP = "ray-clusters"
# the modules that start a Ray cluster (ray.init, ray.cluster_utils, or a launch through tools.launch / tools.smoke)
RAY_CLUSTER_MODULES = frozenset({
    "tests/launch/test_cluster.py",
    "tests/launch/test_faults.py",
    "tests/recipes/test_fault_tolerance.py",
    "tests/recipes/test_learning.py",
    "tests/recipes/test_smoke.py",
    "tests/verl/test_colocated_ref.py",
    "tests/verl/test_cpu_backend.py",
})


def group_of(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return RAY_GROUP if module in RAY_CLUSTER_MODULES else module


def ray_first(items: list) -> None:
    """Move the Ray group to the front, stable otherwise: xdist hands out groups in collection order (with
    `--no-loadscope-reorder`), and the longest should start first."""
    items.sort(key=lambda item: group_of(item.nodeid) != RAY_GROUP)


def by_module(config, log):
    """xdist's load-by-scope scheduling, whose scope is the test's module, or the Ray group."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByModule(config, log)


# the hooks, which tests/conftest.py takes in (and tests/test_parallel.py's scratch suite)
@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent without xdist
def pytest_xdist_make_scheduler(config, log):
    return by_module(config, log)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        ray_first(items)
