"""The vLLM adapter of the rollout rebalance against vLLM 0.11.0's real v1 Scheduler, Request and
KVCacheManager (built on CPU from a stub config), on 2 gloo processes.

What is real: vLLM's scheduling (waiting/running queues, chunked prefill, the KV cache manager
with prefix caching, block allocation and freeing, stop checks) and our adapter and migration. What
is a stub: the model runner. Like vLLM's GPU runner it learns a request from NewRequestData (prompt
token ids, block ids, num_computed_tokens), computes the KV of the scheduled positions into paged
bfloat16 caches shaped like FlashAttention's [2, blocks, block_size, heads, head_size] and samples
the next token, here a checksum of all the KV the request holds. So a moved request decodes the
same tokens as it would have unmoved only if its tokens and KV arrived intact.

Not tested here (needs a device): a real model runner attending over received blocks, vLLM-Ascend's
MLA cache layout, and verl's rollout loop calling rebalance between engine steps.
The adapter's unit tests (what export carries, add, the refusals) are the verl fork's
tests/workers/rollout/rebalance/test_vllm_engine.py.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests import stack
from tests.verl.conftest import require, run_ranks

migrate = require("verl.workers.rollout.rebalance.migrate")
vllm_engine = require("verl.workers.rollout.rebalance.vllm_engine")
stack.require("vllm.v1.core.sched.scheduler", "vLLM 0.11.0 (v1 engine) not installed")

from vllm.config import CacheConfig, SchedulerConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

WORLD = 2
PROMPTS, SAMPLES = 2, 3
BLOCK, NUM_BLOCKS, HEADS, HEAD, LAYERS = 4, 80, 2, 4, 2
MAX_SEQS, MAX_LEN, CHUNK = 4, 256, 16  # CHUNK: token budget per step, so long prompts prefill in chunks
BUCKETS = [1, 2, 4]
CHECK_EVERY = 3
FREE = NUM_BLOCKS - 1  # vLLM's block pool keeps one null block


def block_hasher():
    """What EngineCore gives each request when prefix caching is on (vLLM 0.11): its full blocks' hashes."""
    sha256 = get_hash_fn_by_name("sha256")
    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK, sha256)


HASHER = block_hasher()


def make_scheduler() -> Scheduler:
    sched = SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=CHUNK, max_model_len=MAX_LEN,
                            enable_chunked_prefill=True)
    cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, swap_space=0, cache_dtype="auto",
                        enable_prefix_caching=True)
    cache.num_gpu_blocks = NUM_BLOCKS
    parallel = SimpleNamespace(data_parallel_rank=0, decode_context_parallel_size=1, pipeline_parallel_size=1)
    config = SimpleNamespace(scheduler_config=sched, cache_config=cache, lora_config=None, kv_transfer_config=None,
                             kv_events_config=None, parallel_config=parallel, speculative_config=None,
                             model_config=SimpleNamespace(is_multimodal_model=False, is_encoder_decoder=False))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)
    kv_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}" for i in range(LAYERS)], spec)])
    structured = SimpleNamespace(grammar_bitmask=lambda *a: None, should_advance=lambda r: False)  # none in RL
    return Scheduler(config, kv_config, structured)


def kv_of(layer: int, token: int, position: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(layer * 1_000_003 + token * 7919 + position)
    return torch.randn(2, HEADS, HEAD, generator=g).to(torch.bfloat16)


class StubRunner:
    """Keeps what vLLM's runner keeps per request (its token ids, block ids) and a paged KV cache."""

    def __init__(self):
        self.kv_caches = [torch.zeros(2, NUM_BLOCKS, BLOCK, HEADS, HEAD, dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.reqs: dict[str, tuple[list[int], list[int]]] = {}
        self.computed_positions: dict[str, int] = {}

    def execute(self, out) -> ModelRunnerOutput:
        for rid in out.finished_req_ids:
            self.reqs.pop(rid, None)
        start = {}
        for new in out.scheduled_new_reqs:
            self.reqs[new.req_id] = (list(new.prompt_token_ids), list(new.block_ids[0]))
            start[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs  # vLLM 0.11: one list per field
        assert not any(cached.resumed_from_preemption), "the test sizes the cache so that nothing is preempted"
        for rid, new_blocks, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens,
                                             strict=True):
            self.reqs[rid][1].extend(new_blocks[0] if new_blocks else [])
            start[rid] = computed
        ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            tokens, blocks = self.reqs[rid]
            for pos in range(start[rid], start[rid] + n):
                for layer, cache in enumerate(self.kv_caches):
                    cache[:, blocks[pos // BLOCK], pos % BLOCK] = kv_of(layer, tokens[pos], pos)
            self.computed_positions[rid] = self.computed_positions.get(rid, 0) + n
            ids.append(rid)
            if start[rid] + n == len(tokens):
                token = self.sample(blocks, len(tokens))
                tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])  # a prefill chunk: nothing sampled yet
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                 pooler_output=[])

    def sample(self, blocks: list[int], length: int) -> int:
        total = 0
        for cache in self.kv_caches:
            held = cache[:, torch.tensor(blocks)].reshape(2, -1, HEADS, HEAD)[:, :length]
            bits = held.contiguous().view(torch.int16).to(torch.int64).reshape(-1)
            total += int((bits * torch.arange(1, bits.numel() + 1)).sum())
        return total % 50_000


class Recording(vllm_engine.VllmMigratableEngine):
    """The adapter, recording the bytes of the blocks it exports and receives."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exported, self.received, self.resumed = {}, {}, []
        self.pending: dict[str, int] = {}  # resumed, not yet scheduled: its num_computed_tokens

    def export_kv(self, request_id):
        kv = super().export_kv(request_id)
        self.exported[request_id] = [t.view(torch.int16).numpy().tobytes() for t in kv]
        return kv

    def add_request(self, state, kv=None):
        if kv is not None:
            self.received[state.request_id] = [t.view(torch.int16).numpy().tobytes() for t in kv]
        resumed = super().add_request(state, kv)
        if resumed:
            self.pending[state.request_id] = state.num_computed_tokens
        return resumed


class Engine:
    """One DP engine: the real scheduler, the stub runner, the adapter; collects finished outputs."""

    def __init__(self, rank: int, requests):
        self.scheduler, self.runner = make_scheduler(), StubRunner()
        self.adapter = Recording(self.scheduler, self.runner.kv_caches, block_hasher=HASHER)
        self.new_tokens: dict[str, list[int]] = {}
        self.finished: list[migrate.RequestState] = []
        for req, (p, s) in requests:
            self.scheduler.add_request(req)
            self.adapter.track(req.request_id, rank, p, s)

    def step(self, out=None):
        out = out if out is not None else self.scheduler.schedule()
        for new in out.scheduled_new_reqs:  # what the runner is told about a request resumed on shipped KV
            if new.req_id in self.adapter.pending:
                self.adapter.resumed.append((new.req_id, self.adapter.pending.pop(new.req_id),
                                             new.num_computed_tokens, out.num_scheduled_tokens[new.req_id]))
        results = self.scheduler.update_from_output(out, self.runner.execute(out))
        for output in (o for eco in results.values() for o in eco.outputs):
            rid = output.request_id
            self.new_tokens.setdefault(rid, []).extend(output.new_token_ids)
            if output.finish_reason is not None:
                source, p, s = self.adapter.origin[rid]
                tokens = self.adapter.earlier_output(rid) + self.new_tokens.pop(rid)
                self.finished.append(migrate.RequestState(rid, [], tokens, {}, source, p, s, finished=True))
                self.adapter.forget(rid)

    def after_migration(self):
        for rid in [r for r in self.new_tokens if r not in self.scheduler.requests]:
            del self.new_tokens[rid]  # moved away: its tokens travel in its state

    def left(self) -> int:
        return self.scheduler.get_num_unfinished_requests()


def requests_of(rank: int):
    out = []
    for p in range(PROMPTS):
        prompt = [100 + rank * 10 + p] * (5 + 9 * p)  # the second prompt spans chunks
        for s in range(SAMPLES):
            max_tokens = 30 + 6 * p + s if rank == 0 else 2 + s
            params = SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=50, top_p=0.9)
            out.append((Request(f"r{rank}p{p}s{s}", prompt, params, None, None, block_hasher=HASHER), (p, s)))
    return out


def run_alone(rank: int) -> dict[str, list[int]]:
    engine = Engine(rank, requests_of(rank))
    while engine.left():
        engine.step()
    return {s.request_id: s.output_token_ids for s in engine.finished}


def _worker(rank, port, mode, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        engine, steps, received = Engine(rank, requests_of(rank)), 0, 0
        while True:
            left = torch.tensor([engine.left()])
            dist.all_reduce(left)
            if not int(left):
                break
            engine.step()
            steps += 1
            if steps % CHECK_EVERY == 0:
                report = engine.adapter.report()
                moves = migrate.gather_and_plan(report, BUCKETS)
                received += migrate.rebalance(engine.adapter, moves, report, kv_transfer=mode)
                engine.after_migration()
        mine = migrate.recover(engine.finished)
        a = engine.adapter
        moved_in = sorted({rid for rid in engine.runner.computed_positions if not rid.startswith(f"r{rank}")})
        results[rank] = dict(
            mine=[(s.request_id, s.source_rank, s.prompt_index, s.sample_index, s.output_token_ids) for s in mine],
            decoded_here=[s.request_id for s in engine.finished], received=received, exported=a.exported,
            got=a.received, resumed=a.resumed, moved_in=moved_in,
            free=engine.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=["ship", "reprefill"])
def outcome(request):
    return request.param, run_ranks(_worker, WORLD, request.param)


def test_moved_requests_finish_once_at_home_in_order_with_unmoved_tokens(outcome):
    mode, results = outcome
    decoded = sorted(rid for r in range(WORLD) for rid in results[r]["decoded_here"])
    assert decoded == sorted(req.request_id for r in range(WORLD) for req, _ in requests_of(r))
    assert results[1]["moved_in"], "nothing moved from the crowded rank 0: the test proves nothing"
    for rank in range(WORLD):
        reference = run_alone(rank)
        got = results[rank]["mine"]
        want = [(req.request_id, rank, p, s) for req, (p, s) in requests_of(rank)]
        assert [g[:4] for g in got] == want, f"rank {rank}: not its requests, in order"
        for rid, *_, tokens in got:
            assert tokens == reference[rid], f"{mode}: {rid} decoded other tokens than unmoved"
        assert results[rank]["free"] == FREE, f"rank {rank}: KV blocks leaked"


def test_ship_resumes_on_the_shipped_blocks_bit_exact(outcome):
    mode, results = outcome
    exported = {k: v for r in range(WORLD) for k, v in results[r]["exported"].items()}
    got = {k: v for r in range(WORLD) for k, v in results[r]["got"].items()}
    resumed = [rid for r in range(WORLD) for rid in results[r]["resumed"]]
    if mode == "reprefill":
        assert not exported and not got and not resumed
        return
    assert resumed, "no request resumed on shipped KV"
    assert set(got) == set(exported) and all(got[k] == exported[k] for k in got), "blocks changed in transit"
    for rid, shipped, told, scheduled in resumed:  # the runner starts after the shipped tokens, computes one
        assert (told, scheduled) == (shipped, 1), f"{rid}: the receiver recomputed shipped KV"


def test_export_and_add_between_two_schedulers_without_collectives():
    """One request decoded a few steps on engine A, moved with its KV to engine B: B schedules only
    the pending token, with the shipped blocks, and then decodes what A would have."""
    reference = run_alone(1)
    a, b = Engine(1, requests_of(1)[5:]), Engine(1, [])
    (req, _), = requests_of(1)[5:]
    rid = req.request_id
    for _ in range(2):
        a.step()
    state = a.adapter.export_request(rid)
    kv = a.adapter.export_kv(rid)
    assert state.num_computed_tokens == len(state.prompt_token_ids) + len(state.output_token_ids) - 1
    assert [t.shape[1] for t in kv] == [-(-state.num_computed_tokens // BLOCK)] * LAYERS
    a.adapter.abort_request(rid)
    assert a.left() == 0 and a.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == FREE
    state = migrate.decode(migrate.encode([state]))[0]  # as it travels
    assert b.adapter.add_request(state, kv=kv)
    out = b.scheduler.schedule()
    assert out.num_scheduled_tokens == {rid: 1}
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == state.num_computed_tokens
    assert new.prompt_token_ids == state.prompt_token_ids + state.output_token_ids
    b.step(out)
    while b.left():
        b.step()
    assert b.finished[0].output_token_ids == reference[rid]
