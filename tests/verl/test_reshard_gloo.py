"""The resharding executors on real collectives: 8 processes on gloo.

Every rollout rank must end with exactly the expert tensors the all-gather path gives it (the path
the directed plan replaces), bit-exact, for several layouts including an uneven pipeline layer list
with a dense first layer; and batch rows resharded by all_to_all must equal the driver's
collect-then-split.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.verl.conftest import require, run_ranks

plan = require("verl.utils.reshard.plan")
execute = require("verl.utils.reshard.execute")

WORLD = 8
EXPERT_NUMEL = 3 * 16 * 12  # gate, up and down of a 16 x 12 expert, flattened
LAYERS = [0, 1, 1]  # stage of each layer: 1 layer on stage 0 (dense), 2 on stage 1 -- uneven
DENSE = {0}


def expert_weights(layer: int, expert: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * layer + expert)
    return torch.randn(EXPERT_NUMEL, generator=gen).to(torch.bfloat16)


def _gather_path(train, rollout, experts, layer, stage, rank):
    """The path being replaced: all-gather the stage's experts over its ETP group, then broadcast
    the layer to every rank, which keeps its rollout experts."""
    per_stage = train.world // train.pp
    etp_groups = {s: dist.new_group(list(range(s * per_stage, s * per_stage + train.etp_group)))
                  for s in range(train.pp)}
    full = torch.empty(experts, EXPERT_NUMEL, dtype=torch.bfloat16)
    if rank // per_stage == stage and rank % per_stage < train.etp_group:
        per_rank = experts // train.etp_group
        group_index = rank % per_stage
        mine = torch.stack([expert_weights(layer, e) for e in range(group_index * per_rank,
                                                                    (group_index + 1) * per_rank)])
        parts = [torch.empty_like(mine) for _ in range(train.etp_group)]
        dist.all_gather(parts, mine, group=etp_groups[stage])
        full = torch.cat(parts)
    dist.broadcast(full, src=stage * per_stage)
    return {e: full[e] for e in plan.rollout_experts(rollout, rank, experts)}


def _worker(rank, port, train_kw, rollout_kw, experts, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        train, rollout = plan.TrainLayout(**train_kw), plan.RolloutLayout(**rollout_kw)
        mismatches = []
        for layer, stage in enumerate(LAYERS):
            if layer in DENSE:
                continue
            moves = plan.expert_moves(train, rollout, stage, experts)
            owned = {m.expert for m in moves if m.src == rank}
            local = {e: expert_weights(layer, e) for e in owned}
            got = execute.reshard_experts(moves, local)
            want = _gather_path(train, rollout, experts, layer, stage, rank)
            if sorted(got) != sorted(want) or any(not torch.equal(got[e], want[e]) for e in want):
                mismatches.append(layer)
        # batch rows: rollout DP 8 -> train DP 2 replicated over TP x PP
        n = 40
        have = [plan.contiguous_share(n, WORLD, r) for r in range(WORLD)]
        need = [plan.contiguous_share(n, 2, r // 4) for r in range(WORLD)]
        full = torch.arange(n * 3, dtype=torch.float32).view(n, 3)
        rows = execute.reshard_rows(full[have[rank].start:have[rank].stop], have, need, plan.row_moves(have, need))
        rows_ok = torch.equal(rows, full[need[rank].start:need[rank].stop])
        results[rank] = (mismatches, rows_ok)
    finally:
        dist.destroy_process_group()



@pytest.mark.parametrize("train_kw, rollout_kw, experts", [
    (dict(tp=2, pp=2, ep=2, world=WORLD), dict(dp=4, tp=2), 8),
    (dict(tp=2, pp=2, ep=2, world=WORLD), dict(dp=2, tp=2, instances=2), 8),
    (dict(tp=1, pp=2, ep=2, world=WORLD), dict(dp=4, tp=2), 16),
])
def test_directed_reshard_equals_the_gather_path(train_kw, rollout_kw, experts):
    results = run_ranks(_worker, WORLD, train_kw, rollout_kw, experts)
    for rank in range(WORLD):
        mismatches, rows_ok = results[rank]
        assert mismatches == [], f"rank {rank}: layers {mismatches} differ from the gather path"
        assert rows_ok, f"rank {rank}: resharded rows differ from collect-then-split"
