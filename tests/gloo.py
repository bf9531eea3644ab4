"""Multi-process helpers for the collective tests (gloo on 127.0.0.1)."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import sys
import time

import torch.multiprocessing as mp

# A hung collective fails its test after this long with every rank's stack, instead of holding CI until its own
# limit; the slowest run_processes test takes about 100 s on 2 cores.
DEADLINE_S = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int, attempts: int = 100) -> int:
    """The first of `count` consecutive ports that are all free now, for a program that takes a base port and adds
    to it (vLLM's DP groups: dp_groups.PORT_STRIDE per group)."""
    for _ in range(attempts):
        base = free_port()
        if base + count <= 65536 and all(_bindable(base + i) for i in range(1, count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1 in {attempts} tries")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def run_processes(worker, world: int, *args, start_method: str = "spawn", deadline_s: float = DEADLINE_S) -> dict:
    """Run `worker(rank, port, *args, results)` in `world` processes; returns results[rank] by rank.

    Spawn (the default): by the time these tests run, the pytest process holds Ray's, gRPC's and tokenizers'
    threads, and a fork copies their half-held locks (a forked rank died with glibc's "double free or corruption"
    in a full run). Fork is faster (the workers inherit imported modules) where the caller knows it has no threads.
    The workers start gloo on 127.0.0.1:port themselves. Ranks still running after `deadline_s` print their
    stacks (faulthandler on SIGUSR1), are killed, and the call raises TimeoutError naming them.
    """
    with mp.Manager() as manager:  # its server process ends here, not at interpreter exit
        results = manager.dict()
        context = mp.start_processes(_traced, args=(worker, free_port(), *args, results), nprocs=world, join=False,
                                     start_method=start_method)
        _join_by(context, time.monotonic() + deadline_s)
        collected = dict(results)
    assert len(collected) == world, f"only ranks {sorted(collected)} reported"
    return collected


def _traced(rank, worker, *args):
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    worker(rank, *args)


def _join_by(context, deadline: float) -> None:
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() < deadline:
            continue
        hung = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
        for rank in hung:
            os.kill(context.processes[rank].pid, signal.SIGUSR1)
        time.sleep(2)  # let them write their stacks
        for p in context.processes:
            p.kill()
        raise TimeoutError(f"ranks {hung} still ran after the deadline; their stacks are on stderr above")


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

    megatron-core 0.12.3 does not reset _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP(_GLOO), so two gloo groups,
    their four worker threads and the TCPStore server thread of the default group outlive
    dist.destroy_process_group() and run on into interpreter exit. Dropping the references lets them shut down."""
    import torch.distributed as dist

    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
