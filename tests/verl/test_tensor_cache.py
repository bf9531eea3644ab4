"""TensorCache (verl series) on gloo processes: a reshard from rollout DP 8 to train DP 2 equals the
driver's collect-then-split; matching layouts move nothing; a stage's keys of mixed dtypes and shapes
travel in one packed all_to_all that delivers what the per-key path delivers."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests import traffic
from tests.verl.conftest import require, run_ranks

cache_mod = require("verl.utils.reshard.tensor_cache")
execute = require("verl.utils.reshard.execute")
plan = require("verl.utils.reshard.plan")
WORLD, ROWS = 8, 36


def _worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        full = torch.arange(ROWS * 5, dtype=torch.float32).view(ROWS, 5)
        rollout = cache_mod.layout_rows(ROWS, WORLD, list(range(WORLD)))  # rollout DP 8
        train = cache_mod.layout_rows(ROWS, 2, [(r // 2) % 2 for r in range(WORLD)])  # TP2, DP2, PP2
        cache = cache_mod.TensorCache(rank)
        cache.put("responses", full[rollout[rank].start:rollout[rank].stop], rollout)
        got = cache.get("responses", train)
        driver_split = torch.chunk(full, 2)[(rank // 2) % 2]  # what collect-then-split hands this rank
        moved_for_reshard = cache.rows_received
        cache.put("ref_log_prob", got * 2, train)
        same = cache.get("ref_log_prob", train)  # ref -> update: the same layout
        results[rank] = (torch.equal(got, driver_split), moved_for_reshard, cache.rows_received - moved_for_reshard,
                         torch.equal(same, driver_split * 2))
    finally:
        dist.destroy_process_group()


def test_reshard_equals_collect_then_split_and_matching_layouts_move_nothing():
    results = run_ranks(_worker, WORLD)
    for rank in range(WORLD):
        equal, moved, moved_same, same_ok = results[rank]
        assert equal, f"rank {rank}: resharded rows differ from the driver's split"
        assert moved == ROWS // 2 - _own(rank), "only the rows a rank lacks travel"
        assert moved_same == 0 and same_ok


def _own(rank: int) -> int:
    """Rows of its train share that a rank already holds from rollout (they never move)."""
    rollout = cache_mod.layout_rows(ROWS, WORLD, list(range(WORLD)))[rank]
    train = cache_mod.layout_rows(ROWS, 2, [(r // 2) % 2 for r in range(WORLD)])[rank]
    return len(set(rollout) & set(train))


TRAIN = (0, 1, 2, 0)  # the stage's DP rank of every worker (DP 3: rank 3 replicates rank 0)
# key -> (row shape, dtype, DP rank of every worker when it was cached)
KEYS = {"input_ids": ((6,), torch.int64, (0, 1, 2, 3)), "attention_mask": ((6,), torch.bool, (0, 1, 2, 3)),
        "old_log_probs": ((5,), torch.bfloat16, (3, 2, 1, 0)), "values": ((), torch.float32, (0, 1, 0, 1)),
        "hidden": ((3, 2), torch.float16, (0, 0, 0, 0)), "advantages": ((5,), torch.float64, TRAIN)}
PACKED_WORLD, PACKED_ROWS = 4, 22  # 22 rows over DP 4, 3 and 2: uneven shares


def full_batch(key: str) -> torch.Tensor:
    shape, dtype, _ = KEYS[key]
    values = torch.arange(PACKED_ROWS * max(1, torch.Size(shape).numel()), dtype=torch.float64)
    values = values.view(PACKED_ROWS, *shape) * (1.37 if dtype.is_floating_point else 1)
    return values % 2 == 1 if dtype == torch.bool else values.to(dtype)


def _packed_worker(rank, port, results):
    from verl.single_controller.base.cached_dispatch import CacheRequest
    from verl.workers.tensor_cache_worker import take

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=PACKED_WORLD)
    try:
        cache, cached_with = cache_mod.TensorCache(rank), {}
        for key, (_, _, dp_rank_of) in KEYS.items():
            cached_with[key] = cache_mod.layout_rows(PACKED_ROWS, max(dp_rank_of) + 1, list(dp_rank_of))
            mine = cached_with[key][rank]
            cache.put(key, full_batch(key)[mine.start:mine.stop], cached_with[key])
        request = CacheRequest("train", PACKED_ROWS, get_keys=tuple(KEYS), dp_rank_of=TRAIN)
        need = request.layout()
        with traffic.count_received() as per_key_stats:
            per_key = {}
            for key in KEYS:
                have, rows = cached_with[key], cache.entries[key][0]
                per_key[key] = rows if have == need else execute.reshard_rows(rows, have, need,
                                                                              plan.row_moves(have, need))
        replicated = cache_mod.TensorCache(rank)  # every rank holds every row: the split moves nothing
        replicated.put("hidden", full_batch("hidden"), cached_with["hidden"])
        with traffic.count_received() as replicated_stats:
            split = replicated.get("hidden", need)
        with traffic.count_received() as packed_stats:
            taken = take(cache, request, None).batch
        results[rank] = dict(
            equal_per_key={k: torch.equal(taken[k], per_key[k]) for k in KEYS},
            equal_full={k: torch.equal(taken[k], full_batch(k)[need[rank].start:need[rank].stop]) for k in KEYS},
            dtypes={k: taken[k].dtype for k in KEYS}, packed_calls=dict(packed_stats.calls),
            packed_bytes=packed_stats.bytes, per_key_calls=dict(per_key_stats.calls),
            per_key_bytes=per_key_stats.bytes, recached=all(cache.entries[k][1] == need for k in KEYS),
            split_ok=torch.equal(split, full_batch("hidden")[need[rank].start:need[rank].stop]),
            split_calls=replicated_stats.total_calls)
    finally:
        dist.destroy_process_group()


def test_take_moves_every_key_in_one_all_to_all_as_the_per_key_path_would():
    results = run_ranks(_packed_worker, PACKED_WORLD)
    for rank, r in sorted(results.items()):
        assert all(r["equal_per_key"].values()), f"rank {rank}: packed differs from per key: {r['equal_per_key']}"
        assert all(r["equal_full"].values()), f"rank {rank}: wrong rows: {r['equal_full']}"
        assert r["dtypes"] == {k: dtype for k, (_, dtype, _) in KEYS.items()}
        assert r["packed_calls"] == {"all_to_all_single": 1}, f"rank {rank}: {r['packed_calls']}"
        assert r["per_key_calls"] == {"all_to_all_single": len(KEYS) - 1}  # advantages: cached in the train layout
        assert r["packed_bytes"] == r["per_key_bytes"] > 0, "packing changes no byte that travels"
        assert r["recached"], "a resharded key is cached again in the stage's layout"
        assert r["split_ok"] and r["split_calls"] == 0, "a replicated key is split locally, without a collective"
