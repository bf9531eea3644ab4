"""The resharding planner (verl series): directed expert moves and batch row moves, pure Python."""

from __future__ import annotations

import pytest

from tests.verl.conftest import require

plan = require("verl.utils.reshard.plan")

LAYOUTS = [  # (train, rollout, experts)
    (dict(tp=2, pp=2, ep=2, world=8), dict(dp=4, tp=2), 8),
    (dict(tp=2, pp=2, ep=2, world=8), dict(dp=2, tp=2, instances=2), 8),
    (dict(tp=1, pp=2, ep=2, world=8), dict(dp=4, tp=2), 16),  # two expert replicas per stage
    (dict(tp=4, pp=8, ep=8, world=256), dict(dp=64, tp=2, instances=2), 256),  # A3 true-weight
    (dict(tp=4, pp=8, ep=8, world=256), dict(dp=128, tp=2), 256),  # A3 random-init
]


@pytest.mark.parametrize("train, rollout, experts", LAYOUTS)
def test_every_rollout_rank_gets_exactly_its_experts_from_an_owner(train, rollout, experts):
    t, r = plan.TrainLayout(**train), plan.RolloutLayout(**rollout)
    for stage in range(t.pp):
        moves = plan.expert_moves(t, r, stage, experts)
        got = {rank: sorted(m.expert for m in moves if m.dst == rank) for rank in range(r.world)}
        for rank in range(r.world):
            assert got[rank] == plan.rollout_experts(r, rank, experts)
        for move in moves:
            assert move.src in plan.train_owners(t, stage, move.expert, experts)
            assert move.src // (t.world // t.pp) == stage, "only ranks of the layer's stage send"


@pytest.mark.parametrize("train, rollout, experts", LAYOUTS)
def test_directed_plan_receives_the_minimum(train, rollout, experts):
    traffic = plan.expert_traffic(plan.TrainLayout(**train), plan.RolloutLayout(**rollout), experts)
    assert traffic.directed_recv_max == traffic.minimum


def test_a3_random_init_reproduces_the_reference_reduction():
    traffic = plan.expert_traffic(plan.TrainLayout(tp=4, pp=8, ep=8, world=256), plan.RolloutLayout(dp=128, tp=2),
                                  256)
    assert traffic.minimum == 1 and traffic.gather_peak == 256
    assert round(1 - traffic.minimum / traffic.gather_peak, 4) == 0.9961  # the reference's 99.6 %


def test_alltoall_tables_are_consistent():
    t, r = plan.TrainLayout(tp=2, pp=2, ep=2, world=8), plan.RolloutLayout(dp=4, tp=2)
    moves = plan.expert_moves(t, r, 1, 8)
    tables = [plan.alltoall_tables(moves, rank, 8) for rank in range(8)]
    for a in range(8):
        for b in range(8):
            assert tables[a][0][b] == tables[b][1][a]


@pytest.mark.parametrize("train, rollout, experts, words", [
    (dict(tp=2, pp=2, ep=2, world=8), dict(dp=2, tp=2), 8, "train world 8 != rollout world 4"),
    (dict(tp=2, pp=2, ep=2, world=8, tp_extend_ep=False), dict(dp=4, tp=2), 8, "needs moe_tp_extend_ep"),
    (dict(tp=1, pp=1, ep=3, world=6), dict(dp=2, tp=1, instances=3), 6,
     "rollout EP 2 and the train ETP group 3: neither divides the other"),
    (dict(tp=2, pp=2, ep=2, world=8), dict(dp=4, tp=2), 10, "10 experts not divisible by the train ETP group 4"),
])
def test_layouts_without_a_directed_plan_are_refused(train, rollout, experts, words):
    with pytest.raises(plan.ReshardLayoutError, match=words) as err:
        plan.expert_moves(plan.TrainLayout(**train), plan.RolloutLayout(**rollout), 0, experts)
    assert "all-gather expert path" in str(err.value)


def test_one_rank_engines_get_every_expert_once_from_the_train_group():
    """The CPU smoke's layout: experts split over a stage's TP x EP = 2 ranks, rollout engines of one rank (EP1)."""
    train, rollout = plan.TrainLayout(tp=2, pp=2, ep=1, world=4), plan.RolloutLayout(dp=1, tp=1, instances=4)
    for stage in range(2):
        moves = plan.expert_moves(train, rollout, stage, 8)
        for dst in range(4):
            assert sorted(m.expert for m in moves if m.dst == dst) == list(range(8)), (stage, dst)
        assert {m.src for m in moves} <= {train.rank(tp, 0, 0, stage) for tp in range(2)}


def test_row_moves_cover_every_need_and_skip_rows_already_there():
    n = 24
    have = [plan.contiguous_share(n, 8, r) for r in range(8)]  # rollout DP 8
    need = [plan.contiguous_share(n, 2, r // 4) for r in range(8)]  # train DP 2, replicated over 4 ranks
    moves = plan.row_moves(have, need)
    for dst in range(8):
        got = sorted(i for s, d, span in moves if d == dst for i in span) + [i for i in have[dst] if i in need[dst]]
        assert sorted(got) == list(need[dst])
    assert all(not set(span) & set(have[d]) for _, d, span in moves)
    assert plan.row_moves(have, have) == [], "matching layouts move nothing"
