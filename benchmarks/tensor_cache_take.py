"""TensorCache reshard of one stage's inputs (rollout DP -> train DP): all keys in one packed all_to_all
(`take()` of our verl series) vs one all_to_all per key (`execute.reshard_rows`, the path it replaced).

gloo processes on this machine; each stage of the GRPO step takes about 8 keys of mixed dtypes (token ids,
masks, log-probs, advantages). Rollout layout: every rank its own DP rank; train layout: DP world/2 (TP2).
Time per take: the slowest rank's median over the repeats, each started after a barrier.

  python benchmarks/tensor_cache_take.py [--world 4] [--rows 256] [--seq 1024] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests import traffic  # noqa: E402
from tests.gloo import run_processes  # noqa: E402

KEYS = {"input_ids": torch.int64, "attention_mask": torch.int64, "position_ids": torch.int64,
        "responses": torch.int64, "response_mask": torch.bool, "old_log_probs": torch.float32,
        "ref_log_prob": torch.float32, "advantages": torch.float32}


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank, port, world, rows, seq, repeats, results):
    from verl.single_controller.base.cached_dispatch import CacheRequest
    from verl.utils.reshard import execute, plan
    from verl.utils.reshard.tensor_cache import TensorCache, layout_rows
    from verl.workers.tensor_cache_worker import take

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rollout = layout_rows(rows, world, list(range(world)))
        train_dp = tuple(r // 2 for r in range(world))  # TP2: ranks 2k, 2k+1 share DP rank k
        mine = rollout[rank]
        local = {k: (torch.rand(len(mine), seq) * 100).to(dtype) for k, dtype in KEYS.items()}
        request = CacheRequest("train", rows, get_keys=tuple(KEYS), dp_rank_of=train_dp)
        need = request.layout()
        moves = plan.row_moves(rollout, need)

        def packed():
            cache = TensorCache(rank)
            for key, tensor in local.items():
                cache.put(key, tensor, rollout)
            return take(cache, request, None)

        def per_key():
            return {k: execute.reshard_rows(t, rollout, need, moves) for k, t in local.items()}

        with traffic.count_received() as packed_stats:
            packed()
        with traffic.count_received() as per_key_stats:
            per_key()
        results[rank] = dict(packed=_timed(packed, repeats), per_key=_timed(per_key, repeats),
                             packed_calls=packed_stats.calls["all_to_all_single"],
                             per_key_calls=per_key_stats.calls["all_to_all_single"], bytes=packed_stats.bytes)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4, help="gloo processes (even: the train layout is TP2)")
    parser.add_argument("--rows", type=int, default=256, help="rows of the batch (prompts x n)")
    parser.add_argument("--seq", type=int, default=1024, help="elements per row of every key")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    results = run_processes(_worker, args.world, args.world, args.rows, args.seq, args.repeats)
    print(f"{len(KEYS)} keys x {args.world} ranks, {args.rows} rows x {args.seq}, rollout DP {args.world} ->"
          f" train DP {args.world // 2}")
    print(f"{'rank':>4} {'MiB in':>7} {'per-key ms':>10} {'calls':>5} {'packed ms':>9} {'calls':>5} {'ratio':>6}")
    for rank, r in sorted(results.items()):
        print(f"{rank:4} {r['bytes'] / 2**20:7.2f} {1e3 * r['per_key']:10.2f} {r['per_key_calls']:5}"
              f" {1e3 * r['packed']:9.2f} {r['packed_calls']:5} {r['per_key'] / r['packed']:6.2f}")
    slowest_packed = max(r["packed"] for r in results.values())
    slowest_per_key = max(r["per_key"] for r in results.values())
    print(f"headline: take() per-key/packed = {slowest_per_key / slowest_packed:.2f}x"
          f" (slowest rank: {1e3 * slowest_per_key:.2f} ms vs {1e3 * slowest_packed:.2f} ms)")


if __name__ == "__main__":
    main()
