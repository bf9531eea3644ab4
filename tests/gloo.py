"""Multi-process helpers for the collective tests (gloo on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import os
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


@contextlib.contextmanager
def single_rank_model_parallel():
    """torch.distributed on gloo with this process as the one rank, and Megatron model parallel (1, 1), as in a
    TP1 worker; an existing process group is reused and left alone."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        drop_leftover_groups(parallel_state)
        if created:
            dist.destroy_process_group()


def drop_leftover_groups(parallel_state) -> None:
    """Forget the process groups that Megatron's destroy_model_parallel leaves referenced.

    megatron-core 0.12.1 does not reset _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP(_GLOO), so two gloo groups,
    their four worker threads and the TCPStore server thread of the default group outlive
    dist.destroy_process_group() and run on into interpreter exit. Dropping the references lets them shut down."""
    import torch.distributed as dist

    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
