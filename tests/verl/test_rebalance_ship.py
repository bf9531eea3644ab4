"""Rollout rebalance with KV blocks: 4 processes on gloo, each with a stub engine that holds a real
paged KV cache (bfloat16 tensors per layer, fixed-size blocks, a free list).

The stub's next token is a checksum of the KV it reads from the request's blocks, so a request
decodes the same tokens wherever it runs only if its KV arrived intact. With kv_transfer="ship" the
receiver must not recompute any KV of a moved running request, and the blocks it receives must be
bit for bit those the donor exported; with "reprefill" it recomputes them from the token ids. In both
modes every request finishes exactly once, back on its source rank, in order, tokens intact.
The unit tests of the KV shipping (2 ranks, blocks bit for bit, the refusals) are the verl fork's
tests/workers/rollout/rebalance/test_migrate_ship.py.
"""

from __future__ import annotations

import math
import os
from collections import deque

import pytest
import torch
import torch.distributed as dist

from tests.gloo import run_processes
from tests.verl.conftest import require

migrate = require("verl.workers.rollout.rebalance.migrate")
plan = require("verl.workers.rollout.rebalance.plan")

WORLD = 4
PROMPTS, SAMPLES = 3, 4  # per rank
MAX_RUNNING, BLOCK, LAYERS, WIDTH, NUM_BLOCKS = 4, 4, 2, 8, 96
BUCKETS = [1, 2, 4]
CHECK_EVERY = 3


def target_length(rank: int, prompt: int, sample: int) -> int:
    return 24 + 5 * prompt + sample if rank == 0 else 2 + (prompt + sample) % 4


def requests_of(rank: int) -> list[migrate.RequestState]:
    return [migrate.RequestState(request_id=f"r{rank}p{p}s{s}", prompt_token_ids=[rank, p, 7, s, 11],
                                 output_token_ids=[], sampling_params={"max_tokens": target_length(rank, p, s)},
                                 source_rank=rank, prompt_index=p, sample_index=s)
            for p in range(PROMPTS) for s in range(SAMPLES)]


def kv_of(layer: int, token: int, position: int) -> torch.Tensor:
    """The KV a layer writes for `token` at `position` (what a forward pass would compute)."""
    g = torch.Generator().manual_seed(layer * 1_000_003 + token * 7919 + position)
    return torch.randn(WIDTH, generator=g).to(torch.bfloat16)


class KVStubEngine:
    """A paged-KV engine in miniature. step(): compute the KV of every running request's tokens not
    yet computed (prefill, or one token when decoding), then sample a token from the KV read back
    from its blocks. KV tensors: [NUM_BLOCKS, BLOCK, WIDTH] per layer."""

    def __init__(self, requests):
        self.kv = [torch.zeros(NUM_BLOCKS, BLOCK, WIDTH, dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.free = deque(range(NUM_BLOCKS))
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.waiting = deque(requests)
        self.running: dict[str, migrate.RequestState] = {}
        self.finished: list[migrate.RequestState] = []
        self.recomputed_after_move = 0  # KV positions a moved request recomputed beyond its pending token
        self.moved_in: list[str] = []  # arrivals with output tokens (a request may move twice)
        self.exported: dict[str, list[bytes]] = {}  # request -> bytes of each layer's exported blocks
        self.received: dict[str, list[bytes]] = {}
        self.admit()

    def admit(self):
        while self.waiting and len(self.running) < MAX_RUNNING:
            state = self.waiting.popleft()
            self.running[state.request_id] = state
            self.blocks.setdefault(state.request_id, [])
            self.computed.setdefault(state.request_id, 0)

    def _grow(self, rid: str, tokens: int):
        while len(self.blocks[rid]) * BLOCK < tokens:
            self.blocks[rid].append(self.free.popleft())

    def step(self):
        for rid, state in list(self.running.items()):
            tokens = state.prompt_token_ids + state.output_token_ids
            self._grow(rid, len(tokens))
            for pos in range(self.computed[rid], len(tokens)):
                block, slot = self.blocks[rid][pos // BLOCK], pos % BLOCK
                for layer in range(LAYERS):
                    self.kv[layer][block, slot] = kv_of(layer, tokens[pos], pos)
            if rid in self.moved_in:
                self.recomputed_after_move += max(0, len(tokens) - self.computed[rid] - 1)
            self.computed[rid] = len(tokens)
            state.output_token_ids.append(self.sample(rid, len(tokens)))
            if len(state.output_token_ids) >= state.sampling_params["max_tokens"]:
                state.finished = True
                self.finished.append(self.running.pop(rid))
                self._release(rid)
        self.admit()

    def sample(self, rid: str, length: int) -> int:
        """A checksum of every KV value the request holds: any flipped bit changes the token."""
        ids = torch.tensor(self.blocks[rid])
        total = 0
        for layer in range(LAYERS):
            held = self.kv[layer].index_select(0, ids).reshape(-1, WIDTH)[:length]
            bits = held.view(torch.int16).to(torch.int64).reshape(-1)
            total += int((bits * torch.arange(1, bits.numel() + 1)).sum())
        return total % 50_000

    def _release(self, rid: str):
        self.free.extend(self.blocks.pop(rid))
        self.computed.pop(rid)

    # MigratableEngine
    def export_request(self, request_id):
        state = self.running.get(request_id) or next(s for s in self.waiting if s.request_id == request_id)
        copy = migrate.decode(migrate.encode([state]))[0]
        copy.num_computed_tokens = self.computed.get(request_id, 0)
        return copy

    def export_kv(self, request_id):
        used = math.ceil(self.computed[request_id] / BLOCK)
        ids = torch.tensor(self.blocks[request_id][:used])
        kv = [layer.index_select(0, ids) for layer in self.kv]
        self.exported[request_id] = [t.view(torch.int16).numpy().tobytes() for t in kv]
        return kv

    def abort_request(self, request_id):
        if self.running.pop(request_id, None) is None:
            self.waiting.remove(next(s for s in self.waiting if s.request_id == request_id))
        if request_id in self.blocks:
            self._release(request_id)

    def add_request(self, state, kv=None):
        rid = state.request_id
        if state.output_token_ids:
            self.moved_in.append(rid)
        self.blocks[rid], self.computed[rid] = [], 0
        if kv is not None:
            self.received[rid] = [t.view(torch.int16).numpy().tobytes() for t in kv]
            self._grow(rid, state.num_computed_tokens)
            ids = torch.tensor(self.blocks[rid])
            for layer, tensor in zip(self.kv, kv, strict=True):
                layer.index_copy_(0, ids, tensor)
            self.computed[rid] = state.num_computed_tokens
        self.waiting.append(state)
        self.admit()

    def report(self):
        running = list(self.running.values())
        blocks = tuple(len(self.blocks[s.request_id]) for s in running)
        load = plan.EngineLoad(running=len(running), waiting=len(self.waiting),
                               used_blocks=NUM_BLOCKS - len(self.free), capacity_blocks=NUM_BLOCKS,
                               seq_blocks=blocks)
        return migrate.LoadReport(load, tuple(s.request_id for s in self.waiting),
                                  tuple(s.request_id for s in running))


def run_alone(requests) -> dict[str, list[int]]:
    """The tokens every request decodes on one engine, never moved: the reference."""
    engine = KVStubEngine(requests)
    while engine.running or engine.waiting:
        engine.step()
    return {s.request_id: s.output_token_ids for s in engine.finished}


def _worker(rank, port, mode, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        engine, received, steps = KVStubEngine(requests_of(rank)), 0, 0
        while True:
            left = torch.tensor([len(engine.running) + len(engine.waiting)])
            dist.all_reduce(left)
            if not int(left):
                break
            engine.step()
            steps += 1
            if steps % CHECK_EVERY == 0:
                report = engine.report()
                moves = migrate.gather_and_plan(report, BUCKETS)
                received += migrate.rebalance(engine, moves, report, kv_transfer=mode)
        mine = migrate.recover(engine.finished)
        results[rank] = dict(
            mine=[(s.request_id, s.source_rank, s.prompt_index, s.sample_index, s.output_token_ids) for s in mine],
            decoded_here=[s.request_id for s in engine.finished], received=received,
            moved_in=sorted(engine.moved_in), recomputed=engine.recomputed_after_move,
            exported=engine.exported, got=engine.received, free=len(engine.free))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=["ship", "reprefill"])
def outcome(request):
    # spawn: a fork of this pytest process, after the vLLM engines of other tests ran in it, could abort
    return request.param, run_processes(_worker, WORLD, request.param)


def test_every_request_finishes_once_at_home_in_order_with_the_tokens_of_an_unmoved_run(outcome):
    mode, results = outcome
    decoded = sorted(rid for r in range(WORLD) for rid in results[r]["decoded_here"])
    assert decoded == sorted(s.request_id for r in range(WORLD) for s in requests_of(r)), "each finishes once"
    moved_in = [rid for r in range(WORLD) for rid in results[r]["moved_in"]]
    assert moved_in, "no request moved mid-decode: the test proves nothing"
    for rank in range(WORLD):
        want = requests_of(rank)
        reference = run_alone(requests_of(rank))
        got = results[rank]["mine"]
        assert [g[0] for g in got] == [w.request_id for w in want], f"rank {rank}: not its requests in order"
        for (rid, source, p, s, tokens), w in zip(got, want, strict=True):
            assert (source, p, s) == (rank, w.prompt_index, w.sample_index)
            assert len(tokens) == w.sampling_params["max_tokens"]
            assert tokens == reference[rid], f"{mode}: {rid} decoded other tokens than unmoved"
        assert results[rank]["free"] == NUM_BLOCKS, f"rank {rank}: KV blocks leaked"


def test_ship_sends_the_blocks_bit_exact_and_the_receiver_recomputes_nothing(outcome):
    mode, results = outcome
    exported = {rid: b for r in range(WORLD) for rid, b in results[r]["exported"].items()}
    got = {rid: b for r in range(WORLD) for rid, b in results[r]["got"].items()}
    recomputed = sum(results[r]["recomputed"] for r in range(WORLD))
    if mode == "reprefill":
        assert not exported and not got, "re-prefill must not export or ship KV"
        assert recomputed > 0, "re-prefill recomputes the moved requests' KV"
        return
    assert got and set(got) == set(exported), "every exported request's blocks arrived, and only those"
    assert all(got[rid] == exported[rid] for rid in got), "shipped blocks differ from the exported ones"
    assert recomputed == 0, "a receiver recomputed KV that was shipped"
