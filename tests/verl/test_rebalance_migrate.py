"""Rollout rebalance on real collectives: 4 processes on gloo, each with a stub engine.

Rank 0 gets the long requests, so the plan moves requests (waiting and running) off it while the
others drain. At the end every request must have finished exactly once, be back on its source
rank in (prompt, sample) order, and carry all its token ids, wherever it was decoded.
"""

from __future__ import annotations

import math
import os
from collections import deque

import torch
import torch.distributed as dist

from tests.verl.conftest import require, run_ranks

migrate = require("verl.workers.rollout.rebalance.migrate")
plan = require("verl.workers.rollout.rebalance.plan")

WORLD = 4
PROMPTS, SAMPLES = 3, 4  # per rank
MAX_RUNNING, BLOCK = 4, 4
BUCKETS = [1, 2, 4]
CHECK_EVERY = 3


def token(request_id: str, position: int) -> int:
    """The token a request decodes at `position`: the same on whichever engine decodes it."""
    return sum(map(ord, request_id)) * 1000 + position


def target_length(rank: int, prompt: int, sample: int) -> int:
    return 30 + 7 * prompt + sample if rank == 0 else 2 + (prompt + sample) % 4


def requests_of(rank: int) -> list[migrate.RequestState]:
    return [migrate.RequestState(request_id=f"r{rank}p{p}s{s}", prompt_token_ids=[rank, p, 7],
                                 output_token_ids=[], sampling_params={"max_tokens": target_length(rank, p, s),
                                                                       "temperature": 1.0},
                                 source_rank=rank, prompt_index=p, sample_index=s)
            for p in range(PROMPTS) for s in range(SAMPLES)]


class StubEngine:
    """Holds requests; step() decodes one token per running request and finishes those at length."""

    def __init__(self, requests):
        self.waiting = deque(requests)
        self.running: dict[str, migrate.RequestState] = {}
        self.finished: list[migrate.RequestState] = []
        self.resumed = 0  # received mid-decode (with output tokens)
        self.admit()

    def admit(self):
        while self.waiting and len(self.running) < MAX_RUNNING:
            state = self.waiting.popleft()
            self.running[state.request_id] = state

    def step(self):
        for rid, state in list(self.running.items()):
            state.output_token_ids.append(token(rid, len(state.output_token_ids)))
            if len(state.output_token_ids) >= state.sampling_params["max_tokens"]:
                state.finished = True
                self.finished.append(self.running.pop(rid))
        self.admit()

    def export_request(self, request_id):
        state = self.running.get(request_id) or next(s for s in self.waiting if s.request_id == request_id)
        return migrate.decode(migrate.encode([state]))[0]  # a copy, as an engine's export would be

    def abort_request(self, request_id):
        if self.running.pop(request_id, None) is None:
            self.waiting.remove(next(s for s in self.waiting if s.request_id == request_id))

    def add_request(self, state):
        self.resumed += bool(state.output_token_ids)
        self.waiting.append(state)
        self.admit()

    def report(self):
        running = list(self.running.values())
        blocks = tuple(math.ceil((len(s.prompt_token_ids) + len(s.output_token_ids)) / BLOCK) for s in running)
        load = plan.EngineLoad(running=len(running), waiting=len(self.waiting), used_blocks=sum(blocks),
                               capacity_blocks=200, seq_blocks=blocks)
        return migrate.LoadReport(load, tuple(s.request_id for s in self.waiting),
                                  tuple(s.request_id for s in running))


def left_everywhere(engine) -> int:
    left = torch.tensor([len(engine.running) + len(engine.waiting)])
    dist.all_reduce(left)
    return int(left)


def _worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        engine, received, steps = StubEngine(requests_of(rank)), 0, 0
        while left_everywhere(engine):
            engine.step()
            steps += 1
            if steps % CHECK_EVERY == 0:
                report = engine.report()
                received += migrate.rebalance(engine, migrate.gather_and_plan(report, BUCKETS), report)
        decoded_here = [s.request_id for s in engine.finished]
        mine = migrate.recover(engine.finished)
        results[rank] = ([(s.request_id, s.source_rank, s.prompt_index, s.sample_index, s.output_token_ids,
                           s.prompt_token_ids, s.finished) for s in mine], decoded_here, received, steps,
                         engine.resumed)
    finally:
        dist.destroy_process_group()



def _run() -> dict:
    return run_ranks(_worker, WORLD)


def test_every_request_finishes_once_and_returns_home_in_order_with_its_tokens():
    results = _run()
    decoded_anywhere = [rid for rank in range(WORLD) for rid in results[rank][1]]
    assert sorted(decoded_anywhere) == sorted(r.request_id for rank in range(WORLD) for r in requests_of(rank)), \
        "every request finishes exactly once"
    assert sum(results[rank][2] for rank in range(WORLD)) > 0, "the plan moved nothing: the test proves nothing"
    assert sum(results[rank][4] for rank in range(WORLD)) > 0, "no request moved mid-decode"
    migrated = [rid for rank in range(1, WORLD) for rid in results[rank][1] if rid.startswith("r0")]
    assert migrated, "no request of the crowded rank 0 was decoded elsewhere"
    for rank in range(WORLD):
        got = results[rank][0]
        want = requests_of(rank)
        assert [g[0] for g in got] == [w.request_id for w in want], f"rank {rank}: not its requests in order"
        for (rid, source, p, s, out, prompt, finished), w in zip(got, want, strict=True):
            assert (source, p, s, prompt, finished) == (rank, w.prompt_index, w.sample_index, w.prompt_token_ids, True)
            assert out == [token(rid, i) for i in range(w.sampling_params["max_tokens"])], f"{rid}: tokens differ"


def test_rebalancing_shortens_the_rollout():
    """Lockstep steps until all finish: fewer with the migrations than rank 0 alone would need."""
    results = _run()
    alone = StubEngine(requests_of(0))
    steps = 0
    while alone.running or alone.waiting:
        alone.step()
        steps += 1
    assert results[0][3] < steps
