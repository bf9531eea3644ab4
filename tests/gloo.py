"""Multi-process helpers for the collective tests (gloo on 127.0.0.1)."""

from __future__ import annotations

import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(worker, world: int, *args, start_method: str = "fork") -> dict:
    """Run `worker(rank, port, *args, results)` in `world` processes; returns results[rank] by rank.

    Fork (the default) lets the workers inherit imported modules (importing verl costs seconds each);
    spawn is for callers whose process already runs threads that a fork could deadlock on.
    The workers start gloo on 127.0.0.1:port themselves.
    """
    with mp.Manager() as manager:  # its server process ends here, not at interpreter exit
        results = manager.dict()
        mp.start_processes(worker, args=(free_port(), *args, results), nprocs=world, join=True,
                           start_method=start_method)
        collected = dict(results)
    assert len(collected) == world, f"only ranks {sorted(collected)} reported"
    return collected
