"""TensorCache (verl series) on 8 gloo processes: a reshard from rollout DP 8 to train DP 2 equals the
driver's collect-then-split; matching layouts move nothing; misuse is refused with clear messages."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.verl.conftest import require, run_forked

cache_mod = require("verl.utils.reshard.tensor_cache")
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
    results = run_forked(_worker, WORLD)
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


def test_misuse_is_refused():
    cache = cache_mod.TensorCache(0)
    layout = cache_mod.layout_rows(10, 2, [0, 1])
    with pytest.raises(ValueError, match="3 rows given, the layout gives rank 0 5"):
        cache.put("x", torch.zeros(3, 2), layout)
    with pytest.raises(KeyError, match="'y' was never put on rank 0"):
        cache.get("y", layout)
    cache.put("x", torch.zeros(5, 2), layout)
    assert cache.get("x", layout) is cache.entries["x"][0]
    cache.clear()
    assert cache.entries == {}
