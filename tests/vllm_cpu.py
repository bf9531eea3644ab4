"""vLLM 0.11's V1 CPU engine, one per gloo rank, in the rank's own process (the live rebalance test and benchmark).

Test and benchmark tooling: `engine_rank` makes this process a gloo rank with the environment vLLM reads to run
in-process on CPU, and `tiny_engine` builds the engine on a tiny model (tools/weights/tiny_llama.py) the way
both callers run it: bf16, eager, seed 0, no prefix caching, 16-token KV blocks.
"""

from __future__ import annotations

import contextlib
import os


def vllm_cpu_env(world: int) -> dict[str, str]:
    """The environment of one of `world` processes on this host that each run a V1 engine core in-process (no
    worker processes), with no plugins (vllm-ascend) and 1 GiB of KV cache."""
    return {
        "VLLM_PLUGINS": "none",
        "VLLM_USE_V1": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        # One entry per process (the vllm series' external-launcher binding): "all" leaves the OpenMP threads where
        # torch put them. The default, "auto", binds each process to its own NUMA node, and this host has one.
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(["all"] * world),
    }


@contextlib.contextmanager
def engine_rank(rank: int, port: int, world: int):
    """This process as gloo rank `rank` of `world` on 127.0.0.1:port, one torch thread, set up for an in-process
    vLLM engine with distributed_executor_backend="external_launcher"; the process group ends with the block."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        **vllm_cpu_env(world),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny_engine(path: str, *, max_len: int, max_seqs: int):
    """vLLM's LLM on the model at `path`, TP1, `max_seqs` sequences at a time of up to `max_len` tokens each (one
    step schedules at most `max_len` tokens)."""
    from vllm import LLM

    return LLM(
        model=path,
        dtype="bfloat16",
        distributed_executor_backend="external_launcher",
        tensor_parallel_size=1,
        enforce_eager=True,
        max_model_len=max_len,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_len,
        seed=0,
        enable_prefix_caching=False,
        block_size=16,
    )
