"""The rollout rebalance, live (verl series: rebalance/loop.py over the planner, the KV shipping and the vLLM v1
adapter). Two gloo processes each build vLLM 0.11.0's V1 CPU engine on a tiny random Llama (real weights, so
that greedy decoding has clear winners) and run the same skewed rollout five times under greedy decoding:

* off: the engines step in lockstep and nothing moves (the reference);
* on: every 2 steps the engines share their loads, and sequences move with their KV blocks;
* generate: the same through RebalancingGenerate, the drop-in for LLM.generate that vLLMRollout calls;
* broken: on, with the receiver writing each shipped token's KV one slot along (a wrong slot mapping);
* failed: on, with every receive failing half-way.

Rank 0 gets the long answers (6 prompts, 24 tokens each, 4 sequences at a time), rank 1 two short ones. Checked:
moves happen, running sequences among them (KV bytes shipped), every sample's tokens equal the unmoved run's,
its log-probs come from the engine that sampled each token (and match the unmoved run's), the makespan in steps
shrinks, and no engine keeps a block; and the broken run's samples differ, so the equality check sees a bad KV
move. A fourth run makes every receive fail half-way (after its blocks were allocated and written): the
sequences stay on their donor and complete with the unmoved tokens, the receivers free the blocks, and the
figures count the failed moves (the log says which).
"""

from __future__ import annotations

import pytest

from tests.gloo import run_processes
from tests.verl.conftest import require
from tests.vllm_cpu import engine_rank, tiny_engine
from tools.weights.tiny_llama import make_tiny_llama

require("vllm.v1.worker.cpu_worker")
loop = require("verl.workers.rollout.rebalance.loop")
settings_module = require("verl.workers.rollout.rebalance.settings")

WORLD = 2
LONG, SHORT, LONG_PROMPTS, SHORT_PROMPTS = 24, 3, 6, 2
MAX_SEQS = 4


def prompts_of(rank: int) -> tuple[list[list[int]], list[int]]:
    """Rank 0: the long answers; rank 1: short ones (distinct prompts, so every sample has its own tokens)."""
    count, length = (LONG_PROMPTS, LONG) if rank == 0 else (SHORT_PROMPTS, SHORT)
    return [[3 + rank, 10 + p, 20 + 2 * p, 40 + rank + p] for p in range(count)], [length] * count


def wrong_slot(vllm_engine) -> None:
    """Break the KV shipping on purpose: the receiver writes each shipped token's KV one token slot along."""
    original = vllm_engine.VllmMigratableEngine._load

    def load(self, req, state, kv):
        shifted = []
        for tensor, dim in zip(kv, self.block_dims, strict=True):
            moved = tensor.movedim(dim, 0)  # [blocks, ...]: one block's tokens lie along what follows
            flat = moved.reshape(moved.shape[0], self.block_size, -1) if moved[0].numel() % self.block_size == 0 \
                else moved.reshape(moved.shape[0], -1, 1)
            flat = flat.reshape(-1, flat.shape[-1]).roll(1, dims=0).reshape(moved.shape)
            shifted.append(flat.movedim(0, dim).contiguous())
        return original(self, req, state, shifted)

    vllm_engine.VllmMigratableEngine._load = load


def fail_every_receive(vllm_engine) -> None:
    """Every add on a receiver fails once the request is in its scheduler (with KV: blocks allocated and written)."""
    original = vllm_engine.VllmMigratableEngine.add_request

    def add_request(self, state, kv=None):
        original(self, state, kv)
        raise RuntimeError("injected: the receiver failed after adding the request")

    vllm_engine.VllmMigratableEngine.add_request = add_request


def _worker(rank, port, path, runs, results):
    with engine_rank(rank, port, WORLD):
        from verl.workers.rollout.rebalance import vllm_engine
        from vllm import SamplingParams

        llm = tiny_engine(path, max_len=64, max_seqs=MAX_SEQS)
        prompts, lengths = prompts_of(rank)
        params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=0, ignore_eos=True) for n in lengths]
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        out = {"free_blocks": pool.get_num_free_blocks()}
        for name, enable, breakage in runs:
            if name == "generate":  # what vLLMRollout.generate_sequences calls and reads, rebalance on
                settings = settings_module.RebalanceSettings(enable=True, check_every=2, kv_transfer="ship")
                generate = loop.RebalancingGenerate(llm, settings)
                outputs = generate(prompts=[{"prompt_token_ids": p} for p in prompts], sampling_params=params[0],
                                   lora_request=None, use_tqdm=False)
                read = [o.outputs[0] for o in outputs]  # n=1
                out[name] = {"samples": [{"prompt_index": i, "sample_index": 0, "token_ids": list(r.token_ids),
                                          "logprobs": [lp[t].logprob for t, lp in zip(r.token_ids, r.logprobs,
                                                                                     strict=True)]}
                                         for i, r in enumerate(read)],
                             "figures": {"moved": generate.last_figures.moved}}
                continue
            if breakage:
                {"wrong_slot": wrong_slot, "fail_receive": fail_every_receive}[breakage](vllm_engine)
            settings = settings_module.RebalanceSettings(enable=enable, check_every=2, trigger="imbalance",
                                                         min_imbalance=2, kv_transfer="ship")
            samples, figures = loop.generate(llm, prompts, params, settings)
            out[name] = {"samples": [vars(s) for s in samples],
                         "figures": {k: v for k, v in vars(figures).items() if k != "checks"},
                         "checks": [vars(c) for c in figures.checks], "free_blocks": pool.get_num_free_blocks()}
        results[rank] = out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    make_tiny_llama(path)
    return path


def by_sample(results, run):
    return {(rank, s["prompt_index"], s["sample_index"]): s for rank in range(WORLD)
            for s in results[rank][run]["samples"]}


def mismatches(results, run, reference="off", atol=0.05) -> list:
    """Samples of `run` whose tokens (or log-probs, beyond bf16 noise) differ from the reference run's."""
    ref, got = by_sample(results, reference), by_sample(results, run)
    assert ref.keys() == got.keys(), "a sample went missing or came home to the wrong rank"
    bad = []
    for key, want in ref.items():
        have = got[key]
        if have["token_ids"] != want["token_ids"]:
            bad.append((key, "tokens"))
        elif any(abs(a - b) > atol for a, b in zip(have["logprobs"], want["logprobs"], strict=True)):
            bad.append((key, "logprobs"))
    return bad


@pytest.fixture(scope="module")
def live(tiny):
    return run_processes(_worker, WORLD, tiny, [("off", False, None), ("on", True, None), ("generate", True, None),
                                                  ("broken", True, "wrong_slot"), ("failed", True, "fail_receive")])


@pytest.mark.slow
def test_moved_sequences_continue_with_the_tokens_and_log_probs_of_the_unmoved_run(live):
    on = live[0]["on"]["figures"]
    assert on["moved"] > 0, live[0]["on"]["checks"]
    assert sum(live[r]["on"]["figures"]["kv_bytes_sent"] for r in range(WORLD)) > 0, "no running sequence moved"
    assert all(live[r]["off"]["figures"]["moved"] == 0 for r in range(WORLD))
    off, got = by_sample(live, "off"), by_sample(live, "on")
    for key, sample in got.items():
        want = LONG if key[0] == 0 else SHORT
        assert len(sample["token_ids"]) == len(sample["logprobs"]) == len(sample["producers"]) == want, key
    moved = [key for key, s in got.items() if len(set(s["producers"])) > 1]
    assert moved, "no sample was decoded on two engines"
    assert mismatches(live, "on") == []
    # the producer of each token is the rank that sampled it: unmoved samples only their own rank
    assert all(set(off[key]["producers"]) == {key[0]} for key in off)
    assert live[0]["on"]["figures"]["steps"] < live[0]["off"]["figures"]["steps"], "the makespan did not shrink"
    # its yardsticks: rank 0's 6 x 24 tokens on 4 slots take 36 steps unmoved; no placement beats the longest, 24
    for run in ("off", "on"):
        f = live[0][run]["figures"]
        assert (f["largest_load_steps"], f["lower_bound_steps"]) == (36, LONG), run
        assert f["lower_bound_steps"] <= f["steps"], run
    for run in ("off", "on"):
        print(run, [{k: live[r][run]["figures"][k] for k in ("steps", "busy_steps", "tokens", "moved", "kv_bytes_sent")}
                    for r in range(WORLD)])
    for rank in range(WORLD):
        assert live[rank]["on"]["free_blocks"] == live[rank]["free_blocks"], "a donor or receiver kept blocks"


@pytest.mark.slow
def test_a_wrong_kv_slot_mapping_is_caught_by_the_equality_check(live):
    assert live[0]["broken"]["figures"]["moved"] > 0
    bad = mismatches(live, "broken")
    assert bad, "KV written to the wrong slots went unnoticed"
    # only sequences that resumed on shipped KV can differ; the unmoved ones still match
    got = by_sample(live, "broken")
    assert all(len(set(got[key]["producers"])) > 1 for key, _ in bad)
    print("wrong-slot mismatches:", bad)


@pytest.mark.slow
def test_a_move_that_fails_half_way_leaves_the_sequence_on_its_donor_and_says_so(live):
    failed = [live[r]["failed"]["figures"] for r in range(WORLD)]
    assert sum(f["failed"] for f in failed) > 0, "no move was attempted"
    assert all(f["moved"] == 0 for f in failed)
    got = by_sample(live, "failed")
    assert all(set(s["producers"]) == {key[0]} for key, s in got.items()), "a sample left its donor"
    assert mismatches(live, "failed") == []
    for rank in range(WORLD):  # the receivers freed the blocks they had allocated for the failed adds
        assert live[rank]["failed"]["free_blocks"] == live[rank]["free_blocks"]


@pytest.mark.slow
def test_the_rollout_s_generate_hook_returns_what_generate_sequences_reads(live):
    assert live[0]["generate"]["figures"]["moved"] > 0
    assert mismatches(live, "generate") == []
