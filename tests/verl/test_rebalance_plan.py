"""The rollout rebalancing plan (verl series): properties over random engine states, and examples."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.verl.conftest import require

plan = require("verl.workers.rollout.rebalance.plan")
EngineLoad, Move = plan.EngineLoad, plan.Move

POWERS = [1, 2, 4, 8, 16, 32, 64]
KV_CAP = 0.9


@st.composite
def engine(draw, kv: bool):
    running = draw(st.integers(0, 40))
    waiting = draw(st.integers(0, 4))
    if not kv:
        return EngineLoad(running=running, waiting=waiting)
    if draw(st.booleans()):
        seq_blocks = tuple(draw(st.lists(st.integers(1, 6), min_size=running, max_size=running)))
        used = sum(seq_blocks)
    else:
        seq_blocks, used = None, draw(st.integers(running, 6 * running))
    capacity = used + draw(st.integers(0, 120))
    return EngineLoad(running=running, waiting=waiting, used_blocks=used, capacity_blocks=capacity,
                      seq_blocks=seq_blocks)


buckets = st.lists(st.sampled_from(POWERS), min_size=1, unique=True).map(sorted)
free_engines = st.lists(engine(kv=False), min_size=1, max_size=12)
kv_engines = st.lists(engine(kv=True), min_size=1, max_size=12)
any_engines = st.one_of(free_engines, kv_engines)


def loads(engines):
    return [e.sequences for e in engines]


def count_target(engines, bucket_sizes):
    """The smallest bucket the total fits in (N * B >= total), or the even eager load past them."""
    total, n = sum(loads(engines)), len(engines)
    return next((b for b in bucket_sizes if total <= n * b), math.ceil(total / n))


def excess_lower_bound(engines, target):
    """Any plan bringing every engine to <= target moves at least each engine's excess."""
    return sum(max(0, n - target) for n in loads(engines))


@settings(deadline=None)
@given(any_engines, buckets)
def test_moves_conserve_sequences(engines, bucket_sizes):
    p = plan.plan_rebalance(engines, bucket_sizes, KV_CAP)
    before = loads(engines)
    after = list(before)
    for m in p.moves:
        assert m.src != m.dst and m.count > 0
        assert 0 <= m.waiting <= min(m.count, engines[m.src].waiting)
        after[m.src] -= m.count
        after[m.dst] += m.count
    assert after == plan.sequences_after(engines, p.moves)
    assert sum(after) == sum(before) and min(after, default=0) >= 0
    senders, receivers = {m.src for m in p.moves}, {m.dst for m in p.moves}
    assert not senders & receivers, "an engine both gives and receives"
    for src in senders:
        out = [m for m in p.moves if m.src == src]
        assert sum(m.waiting for m in out) <= engines[src].waiting
        seqs = [i for m in out for i in m.seqs]
        assert len(seqs) == len(set(seqs)) and all(0 <= i < engines[src].running for i in seqs)


@settings(deadline=None)
@given(kv_engines, buckets)
@example([EngineLoad(0, 0, 0, 0), EngineLoad(0, 2, 0, 0)], [1])  # a donor with only waiting sequences
def test_receivers_stay_within_the_kv_cap(engines, bucket_sizes):
    p = plan.plan_rebalance(engines, bucket_sizes, KV_CAP)
    incoming = {}
    for m in p.moves:
        donor = engines[m.src]
        if donor.seq_blocks is not None:
            assert len(m.seqs) == m.count - m.waiting
            assert m.blocks == sum(donor.seq_blocks[i] for i in m.seqs), "blocks travel with their sequences"
        else:
            average = math.ceil(donor.used_blocks / donor.running) if donor.running else 0  # only waiting ones
            assert m.blocks == (m.count - m.waiting) * average
        incoming[m.dst] = incoming.get(m.dst, 0) + m.blocks
    for dst, blocks in incoming.items():
        e = engines[dst]
        assert e.used_blocks <= KV_CAP * e.capacity_blocks, "a receiver above the cap was used"
        assert e.used_blocks + blocks <= KV_CAP * e.capacity_blocks <= e.capacity_blocks


@settings(deadline=None)
@given(free_engines, buckets)
def test_reaches_the_count_target_without_kv_limits(engines, bucket_sizes):
    p = plan.plan_rebalance(engines, bucket_sizes, KV_CAP)
    target = count_target(engines, bucket_sizes)
    if target < p.before:
        assert p.target == target
        assert plan.largest_bucket(plan.sequences_after(engines, p.moves), bucket_sizes) == target
    else:
        assert p.target is None and p.moves == ()


@settings(deadline=None)
@given(any_engines, buckets)
def test_reaches_the_count_target_when_kv_room_is_ample(engines, bucket_sizes):
    target = count_target(engines, bucket_sizes)
    biggest = max((max(e.seq_blocks or (math.ceil(e.used_blocks / max(e.running, 1)),)) for e in engines), default=0)
    roomy = [EngineLoad(e.running, e.waiting, e.used_blocks, e.used_blocks + 2 * (target * biggest + 1), e.seq_blocks)
             for e in engines]  # every engine under half its capacity with room for `target` of the largest
    p = plan.plan_rebalance(roomy, bucket_sizes, 0.5)
    assert p.target == (target if target < p.before else None)


@settings(deadline=None)
@given(any_engines, buckets)
def test_never_makes_the_largest_bucket_worse(engines, bucket_sizes):
    p = plan.plan_rebalance(engines, bucket_sizes, KV_CAP)
    after = plan.largest_bucket(plan.sequences_after(engines, p.moves), bucket_sizes)
    assert p.before == plan.largest_bucket(loads(engines), bucket_sizes)
    assert after == p.after
    assert after < p.before if p.moves else after == p.before


@settings(deadline=None)
@given(kv_engines, buckets)
def test_kv_limits_only_ever_raise_the_target(engines, bucket_sizes):
    limited = plan.plan_rebalance(engines, bucket_sizes, KV_CAP)
    free = plan.plan_rebalance([EngineLoad(e.running, e.waiting) for e in engines], bucket_sizes, KV_CAP)
    assert limited.after >= free.after


@settings(deadline=None)
@given(any_engines, buckets)
def test_is_deterministic(engines, bucket_sizes):
    copy = [EngineLoad(e.running, e.waiting, e.used_blocks, e.capacity_blocks, e.seq_blocks) for e in engines]
    assert plan.plan_rebalance(engines, bucket_sizes, KV_CAP) == plan.plan_rebalance(copy, list(bucket_sizes), KV_CAP)


@settings(deadline=None)
@given(any_engines, buckets)
def test_moves_only_the_excess(engines, bucket_sizes):
    p = plan.plan_rebalance(engines, bucket_sizes, KV_CAP)
    if p.target is None:
        return
    assert p.moved == excess_lower_bound(engines, p.target)
    after = plan.sequences_after(engines, p.moves)
    for m in p.moves:
        assert loads(engines)[m.src] > p.target and after[m.src] == p.target
        assert loads(engines)[m.dst] < p.target and after[m.dst] <= p.target


def running(*counts):
    return [EngineLoad(running=n) for n in counts]


@pytest.mark.parametrize("engines, bucket_sizes, target, moves", [
    # one crowded engine, three nearly drained: 8 sequences over 4 engines fit bucket 2
    (running(5, 1, 1, 1), [1, 2, 4, 8], 2, [Move(0, 1, 1), Move(0, 2, 1), Move(0, 3, 1)]),
    # each donor goes to the receiver with the most free slots (ties: lowest rank)
    (running(3, 3, 0, 0), [1, 2, 4], 2, [Move(0, 2, 1), Move(1, 3, 1)]),
    # the largest excess is served first and fills the emptiest receiver in one move
    (running(7, 0, 4, 1), [1, 2, 4, 8], 4, [Move(0, 1, 3)]),
    # 15 sequences on 4 engines need bucket 4, which is already the largest in use
    (running(4, 4, 4, 3), [1, 2, 4, 8], None, []),
    # past the largest graph: the even eager load
    (running(10, 2), [1, 2, 4], 6, [Move(0, 1, 4)]),
    # a drained engine still ends a rollout fine: one sequence left anywhere is bucket 1
    (running(1, 0, 0), [1, 2], None, []),
])
def test_examples(engines, bucket_sizes, target, moves):
    p = plan.plan_rebalance(engines, bucket_sizes)
    assert (p.target, list(p.moves)) == (target, moves)


def test_waiting_first_then_the_cheapest_running_sequences():
    donor = EngineLoad(running=4, waiting=1, used_blocks=20, capacity_blocks=100, seq_blocks=(9, 2, 7, 2))
    drained = EngineLoad(0, capacity_blocks=100)
    p = plan.plan_rebalance([donor, drained, drained], [1, 2, 4, 8])  # 5 sequences on 3 engines: bucket 2
    assert p.moves == (Move(0, 1, count=2, waiting=1, seqs=(1,), blocks=2), Move(0, 2, count=1, seqs=(3,), blocks=2))


def test_a_receiver_above_the_cap_is_skipped_and_kv_can_force_a_larger_bucket():
    full = EngineLoad(running=0, used_blocks=95, capacity_blocks=100)  # drained, but KV at 95 % (resumable)
    small = EngineLoad(running=1, used_blocks=1, capacity_blocks=10, seq_blocks=(1,))
    donor = EngineLoad(running=3, waiting=2, used_blocks=30, capacity_blocks=100, seq_blocks=(10, 5, 15))
    p = plan.plan_rebalance([donor, full, small], [1, 2, 4, 8], kv_cap=0.9)
    # bucket 2 would need 3 sequences out of the donor but only `small` receives, with 1 free slot
    assert p.target == 4 and p.moves == (Move(0, 2, count=1, waiting=1),)


def test_the_cheapest_sequence_that_does_not_fit_blocks_the_bucket():
    donor = EngineLoad(running=4, used_blocks=40, capacity_blocks=100, seq_blocks=(10, 10, 10, 10))
    receiver = EngineLoad(running=0, used_blocks=0, capacity_blocks=20)  # room floor(0.9 * 20) = 18 < 2 x 10
    p = plan.plan_rebalance([donor, receiver], [1, 2, 4], kv_cap=0.9)
    assert p.target is None and p.moves == ()  # bucket 2 needs 2 x 10 blocks on the receiver
    roomier = EngineLoad(running=0, used_blocks=0, capacity_blocks=23)  # room floor(0.9 * 23) = 20
    p = plan.plan_rebalance([donor, roomier], [1, 2, 4], kv_cap=0.9)
    assert p.target == 2 and p.moves == (Move(0, 1, count=2, seqs=(0, 1), blocks=20),)


@pytest.mark.parametrize("kwargs, words", [
    (dict(engines=running(1), buckets=[2, 1]), "strictly increasing"),
    (dict(engines=running(1), buckets=[]), "strictly increasing"),
    (dict(engines=running(1), buckets=[1], kv_cap=1.5), "kv_cap"),
    (dict(engines=[EngineLoad(running=2, seq_blocks=(1,))], buckets=[1]), "1 seq_blocks for 2 running"),
])
def test_rejects_bad_input(kwargs, words):
    with pytest.raises(ValueError, match=words):
        plan.plan_rebalance(**kwargs)
