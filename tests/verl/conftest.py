"""Tests of our verl series run against the materialised fork (installed in the test stack)."""

from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp


def require(module: str):
    """Import a module of our verl series, or skip saying why it is absent."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:
        pytest.skip(f"{module} not importable ({exc}): sync and apply the verl fork, then install it"
                    " (nox -s tests does both)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_forked(worker, world: int, *args) -> dict:
    """Run `worker(rank, port, *args, results)` in `world` processes; returns results[rank] by rank.

    Fork, not spawn: the workers inherit the imported modules (importing verl costs seconds each).
    The workers start gloo on 127.0.0.1:port themselves.
    """
    with mp.Manager() as manager:  # its server process ends here, not at interpreter exit
        results = manager.dict()
        mp.start_processes(worker, args=(free_port(), *args, results), nprocs=world, join=True,
                           start_method="fork")
        collected = dict(results)
    assert len(collected) == world, f"only ranks {sorted(collected)} reported"
    return collected
