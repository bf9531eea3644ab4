"""Tests of our verl series run against the materialised fork (installed in the test stack)."""

from __future__ import annotations

import pytest

from tests.gloo import run_processes


def require(module: str):
    """Import a module of our verl series, or skip saying why it is absent."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:
        pytest.skip(f"{module} not importable ({exc}): sync and apply the verl fork, then install it"
                    " (nox -s tests does both)", allow_module_level=True)  # most callers run at import


def run_forked(worker, world: int, *args) -> dict:
    """`worker(rank, port, *args, results)` in `world` forked processes (see tests/gloo.py)."""
    return run_processes(worker, world, *args)
