"""Step time of a colocated GRPO step on Atlas A3, phase by phase, next to the same phases at their physical limit.

A calibrated model, not a measurement. Every number it uses is the config's, the model's (Dims), or a field of
Constants (a datasheet or the reference's write-up, each with its source) or Fit (fitted on one published run, the
reference's true-weight step: calibrate()); tests/perf/test_timing.py predicts two other published runs without
refitting. Phases, as the reference breaks a step down (cann-recipes-train docs/llm_rl/deepseek_rl_train_optimization.md
§1.4, "the reference's doc" below):
- rollout: prefill, then the decode steps of the long tail (tools/perf/rollout_sim.py over the response-length
  distribution, per engine batch). A decode step reads the die's weights and the live KV cache from HBM, at an
  efficiency fitted once; vLLM's DP syncs and the published per-step cost of each graph feature left off come on
  top; without TorchAir graphs a step costs the published factor more.
- old_log_prob, ref, update: Megatron passes over each DP rank's micro-batches with DeepSeek-V3's FLOPs (MLA
  projections and attention, dense and shared MLPs, router, top-k routed experts, LM head). A routed expert costs
  max(FLOPs, weight bytes): with a micro-batch of one sequence it is bound by reading its weights (and, backward,
  its fp32 gradient). The DP ranks of an expert group step together (the all-to-all), so a micro-batch's dense part
  costs the longest of the group; padding (the reference pads a micro-batch to its longest row), recompute and the
  pipeline fill and drain follow from the layout. An effective fraction of peak is fitted for forward passes and one
  for the update.
- driver: what verl's single controller serialises to the workers (and collects) per stage: the TensorCache
  accounting of benchmarks/driver_payload.py, at the rate the reference's measured 57 s ref skew implies.
- reshard: what each rollout rank receives (the planner's expert moves, the full non-expert weights) at HCCS
  bandwidth, plus a fitted fixed cost (collectives, weight post-processing).
- offload: bytes between host and die per step at the host link (a fitted fraction of it); the swap optimizer's
  traffic is part of the update.
- reward: CPU scoring, fitted per response token.
The limit of a phase: decode at HBM bandwidth (weights + KV per step, no syncs), prefill and training at peak FLOPs
on the tokens themselves (no padding, recompute or bubbles), transfers at link bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from functools import lru_cache

import numpy as np

from tools.launch.config import Recipe
from tools.launch.layout import DIES_PER_CARD, Layout
from tools.model.dims import Dims
from tools.model.parallel import ParallelLayout
from tools.perf import rollout_sim
from tools.perf.memory import (
    ADAM_BYTES,
    BF16,
    FP32,
    kv_bytes_per_token,
    ref_params_per_die,
    stage_params,
    vllm_weight_params,
)

GB = 1e9
INT64 = 8  # verl's token ids, masks and positions
DOC = "the reference's doc"  # cann-recipes-train docs/llm_rl/deepseek_rl_train_optimization.md
CM384 = "Huawei CloudMatrix384 paper, arXiv:2506.12708"


def _const(default: float, unit: str, source: str):
    return field(default=default, metadata={"unit": unit, "source": source})


@dataclass(frozen=True)
class Constants:
    """Every number of the model that is neither the config's nor the model's, with its source."""

    peak_tflops: float = _const(376.0, "TFLOPS/die", f"bf16 dense: 752 per Ascend 910C package of 2 dies ({CM384})")
    hbm_gb_per_s: float = _const(1600.0, "GB/s/die", "3.2 TB/s (8 HBM2E stacks) per 910C package of 2 dies"
                                 " (TechPowerUp 2025-04, after DigiTimes)")
    hccs_gb_per_s: float = _const(196.0, "GB/s/die", f"assumed: HCCS/UB one way, ~392 GB/s per 910C package over its 2"
                                  f" dies (public summaries of {CM384} give 196-400); an A3 SuperPoD (the reference's"
                                  " cluster, §1.1) joins every die over it, across nodes")
    host_gb_per_s: float = _const(32.0, "GB/s/die", "assumed: host <-> die, PCIe 5.0 x16 (64 GB/s) per card of 2 dies")
    driver_ref_skew_s: float = _const(57.0, "s", f"{DOC} §3.2.4: the last worker starts compute_ref_log_prob 57 s"
                                      " after the first (verl's serial dispatch, 1K/3K, TP4 PP8 EP8)")
    sync_gloo_ms: float = _const(14.0, "ms", f"{DOC} §6.6.3: one vLLM DP sync on gloo at 128 A3 cards")
    sync_device_ms: float = _const(3.0, "ms", f"{DOC} §6.6.3: the same sync on HCCL (\"within 3 ms\")")
    syncs_per_step: float = _const(2.0, "per step", f"{DOC} §6.6.1: has_unfinished_requests and the forward"
                                   " metadata across DP")
    eager_slowdown: float = _const(2.0, "x", f"{DOC} §6.1.3: TorchAir graph mode doubles decode throughput")
    multistream_ms: float = _const(6.0, "ms/step", f"{DOC} §6.2.3: MLA + MoE multistream, TPOT -6 ms")
    kv_nz_ms: float = _const(1.0, "ms/step", f"{DOC} §6.4.3: KV cache in NZ, TPOT > 1 ms less at 3K")
    view_transpose_ms: float = _const(0.175, "ms/MoE layer", f"{DOC} §6.5.1: TorchAir's view optimisation leaves a"
                                      " Transpose of 175 us per MoE layer at one expert per die")
    main_grad_bytes: float = _const(8.0, "B/param", "Megatron's fp32 main_grad, read and written by the weight"
                                    " gradient of every micro-batch")


@dataclass(frozen=True)
class Fit:
    """What no datasheet gives: calibrate() sets each from the phase of one published run named here."""

    decode_eff: float = _const(math.nan, "of HBM BW", "fitted: rollout")
    forward_eff: float = _const(math.nan, "of peak", "fitted: ref (less its driver skew); also prefill")
    train_eff: float = _const(math.nan, "of peak", "fitted: update (less its driver skew and optimizer swap)")
    driver_gb_per_s: float = _const(math.nan, "GB/s", "derived: ref-stage bytes / driver_ref_skew_s")
    reshard_fixed_s: float = _const(math.nan, "s", "fitted: reshard (less its bytes at HCCS bandwidth)")
    host_eff: float = _const(math.nan, "of host BW", "fitted: offload")
    reward_us_per_token: float = _const(math.nan, "us/token", "fitted: reward + adv, per response token")


CONSTANTS = Constants()


@dataclass(frozen=True)
class Options:
    """What the config switches that the step time depends on (options())."""

    tensor_cache: bool = False  # actor_rollout_ref.tensor_cache.enable
    reshard_experts: str = "gather"  # rollout.reshard.experts: gather | directed
    lifecycle: str = "sleep"  # rollout.lifecycle: sleep | manual
    torchair: bool = False  # additional_config.torchair_graph_config.enabled
    multistream: bool = False  # enable_multistream_mla and multistream_overlap_shared_expert
    kv_nz: bool = False
    view_optimize: bool = True
    graph_batch_sizes: tuple[int, ...] = ()
    dp_sync_on_device: bool = False
    calculate_log_probs: bool = False  # the rollout returns log-probs: one more column through the driver
    # rollout.rebalance.enable: modelled at its limit, free moves at every step (rollout_sim.pooled_ms);
    # benchmarks/rollout_sim.py puts our planner within 1% of it, checking every 64 steps and paying the KV copies
    rebalance: bool = False
    # Not keys. Our verl series packs each micro-batch's sequences (model_forward.py pack_seqs=True); the
    # reference's model_forward.py pads every row to the micro-batch's longest (pack_seqs=False). Our series sends
    # TensorCache's advantages once per DP rank, which broadcasts them to its TP x PP replicas on the devices; the
    # reference's TensorCache sends every replica a copy.
    packed: bool = True
    advantages_per_dp: bool = True


@dataclass(frozen=True)
class Workload:
    prompt_tokens: float  # mean prompt tokens
    response_tokens: float  # mean response tokens


@dataclass(frozen=True)
class Run:
    lay: Layout
    opts: Options
    work: Workload

    @property
    def tokens(self) -> float:
        return self.lay.sequences * (self.work.prompt_tokens + self.work.response_tokens)


def options(recipe: Recipe) -> Options:
    t, r, engine = recipe.engine.torchair, recipe.rollout, recipe.engine
    return Options(tensor_cache=r.tensor_cache, reshard_experts=r.reshard_experts, lifecycle=r.lifecycle,
                   torchair=t.enabled, multistream=t.enable_multistream_mla and engine.multistream_shared_experts,
                   kv_nz=t.enable_kv_nz, view_optimize=t.enable_view_optimize, graph_batch_sizes=t.graph_batch_sizes,
                   dp_sync_on_device=recipe.engine.dp_sync_on_device, calculate_log_probs=r.calculate_log_probs,
                   rebalance=r.rebalance)


def run_from_config(recipe: Recipe) -> Run:
    """The run a config describes; with ignore_eos every response is max_response_length long."""
    lay, timing = recipe.layout, recipe.settings.timing
    response = lay.response_len if recipe.rollout.ignore_eos else float(timing.response_tokens)
    return Run(lay, options(recipe), Workload(float(timing.prompt_tokens), response))


# ---------------------------------------------------------------- the model's arithmetic


def dense_params(dims: Dims, layer: int) -> int:
    """Parameters every token of a layer meets: MLA, then the dense MLP or the shared experts and the router."""
    mlp = dims.dense_mlp_params if not dims.is_moe(layer) else \
        dims.shared_experts * dims.expert_params + dims.router_params
    return dims.attention_params + mlp


def attention_flops_per_pair(dims: Dims) -> int:
    """Q.K and P.V of one (query, key) pair of one layer, every head (MLA as trained, not absorbed)."""
    return 2 * dims.heads * (dims.qk_head + dims.v_head)


def forward_flops(dims: Dims, tokens: float, pairs: float) -> float:
    """Forward FLOPs of `tokens` tokens (and `pairs` causal attention pairs) through the whole model."""
    linear = sum(dense_params(dims, i) for i in range(dims.layers)) + dims.moe_layers * dims.experts_per_token \
        * dims.expert_params + dims.embedding_params  # the LM head
    return 2 * linear * tokens + dims.layers * attention_flops_per_pair(dims) * pairs


@lru_cache(maxsize=16)
def _lengths(prompts: int, n: int, mean: float, cap: int) -> np.ndarray:
    s = rollout_sim.Scenario("batch", 1, prompts, n, mean, cap, max_num_seqs=prompts * n)
    return rollout_sim.response_lengths(s, np.random.default_rng(0))


def response_lengths(run: Run) -> np.ndarray:
    """Every response of a step (prompt-major), from the simulator's long-tailed distribution at the workload's
    mean; all max_response_length when that is the mean (forced lengths)."""
    lay = run.lay
    return _lengths(lay.train_batch, lay.n, min(run.work.response_tokens, lay.response_len), lay.response_len)


@dataclass(frozen=True)
class Phase:
    parts: dict[str, float]  # seconds by part
    limit: float  # the phase at its physical limit (s)

    @property
    def s(self) -> float:
        return sum(self.parts.values())


# ---------------------------------------------------------------- rollout


@lru_cache(maxsize=64)
def decode_instances(run: Run, dims: Dims, c: Constants) -> list[tuple[float, int]]:
    """Per rollout instance: (ms its decode steps take at HBM bandwidth, decode steps)."""
    lay, opts = run.lay, run.opts
    weights = BF16 * vllm_weight_params(lay, dims)
    kv_per_token = kv_bytes_per_token(dims)  # the latent KV: whole on both TP ranks of an engine

    def hbm_ms(bucket: int, kv_tokens: float) -> float:
        return 1e3 * (weights + kv_tokens * kv_per_token) / (c.hbm_gb_per_s * GB) if bucket else 0.0

    buckets = (opts.graph_batch_sizes or (1, lay.max_num_seqs)) if opts.torchair else ()
    prompts = lay.train_batch // lay.rollout_instances
    lengths = response_lengths(run)
    out = []
    for i in range(lay.rollout_instances):
        s = rollout_sim.Scenario(f"instance {i}", lay.rollout_dp, prompts, lay.n, run.work.response_tokens,
                                 lay.response_len, lay.max_num_seqs, round(run.work.prompt_tokens), buckets=buckets)
        mine = lengths[i * prompts * lay.n:(i + 1) * prompts * lay.n]
        if opts.rebalance:
            out.append(rollout_sim.pooled_ms(s, mine, hbm_ms))
            continue
        rollout = rollout_sim.Rollout(s, mine)
        out.append((rollout_sim.decode(rollout, hbm_ms), rollout.now))
    return out


def step_overheads_ms(run: Run, dims: Dims, c: Constants) -> tuple[float, float, float]:
    """(graph features left off, per step; slowdown factor without graphs; DP syncs, per step), in ms."""
    lay, opts = run.lay, run.opts
    off = (0.0 if opts.multistream else c.multistream_ms) + (0.0 if opts.kv_nz else c.kv_nz_ms)
    if opts.torchair and opts.view_optimize and dims.experts // lay.rollout_ep == 1:
        off += c.view_transpose_ms * dims.moe_layers
    sync = c.syncs_per_step * (c.sync_device_ms if opts.dp_sync_on_device else c.sync_gloo_ms) \
        if lay.rollout_dp > 1 else 0.0
    return off, 1.0 if opts.torchair else c.eager_slowdown, sync


def decode_s(run: Run, dims: Dims, c: Constants, decode_eff: float) -> float:
    off, slowdown, sync = step_overheads_ms(run, dims, c)
    return max(slowdown * (hbm / decode_eff + steps * off) + steps * sync
               for hbm, steps in decode_instances(run, dims, c)) / 1e3


def prefill_flops_per_die(run: Run, dims: Dims) -> float:
    p = run.work.prompt_tokens
    return run.lay.sequences * forward_flops(dims, p, p * (p + 1) / 2) / run.lay.world


def prefill_s(run: Run, dims: Dims, c: Constants, forward_eff: float) -> float:
    """Prompt FLOPs at the forward efficiency, and a DP sync per chunk of max_num_batched_tokens."""
    lay = run.lay
    chunks = math.ceil(lay.sequences / lay.engines * run.work.prompt_tokens / lay.max_num_batched_tokens)
    return prefill_flops_per_die(run, dims) / (c.peak_tflops * 1e12 * forward_eff) \
        + chunks * step_overheads_ms(run, dims, c)[2] / 1e3


def rollout(run: Run, dims: Dims, c: Constants, fit: Fit) -> Phase:
    limit = max(hbm for hbm, _ in decode_instances(run, dims, c)) / 1e3 \
        + prefill_flops_per_die(run, dims) / (c.peak_tflops * 1e12)
    return Phase({"prefill": prefill_s(run, dims, c, fit.forward_eff), "decode": decode_s(run, dims, c, fit.decode_eff),
                  "driver": driver_s(run, "rollout", fit)}, limit + driver_limit_s(run, "rollout", c))


# ---------------------------------------------------------------- Megatron passes


def micro_batches(run: Run, micro: int, packed: bool) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and causal attention pairs of each micro-batch, [DP rank, micro-batch]: each DP rank takes its
    contiguous share of the batch (verl's split), padded to the longest row unless packed."""
    lay = run.lay
    seqs = run.work.prompt_tokens + response_lengths(run)
    per_rank = lay.sequences // lay.dp
    m = per_rank // micro
    rows = seqs[:lay.dp * per_rank].reshape(lay.dp, per_rank)[:, :m * micro].reshape(lay.dp, m, micro)
    if not packed:
        rows = np.broadcast_to(rows.max(axis=-1, keepdims=True), rows.shape)
    return rows.sum(-1), (rows * (rows + 1) / 2).sum(-1)


def stage_seconds(train: ParallelLayout, dims: Dims, c: Constants, layers: range, tokens: np.ndarray,
                  pairs: np.ndarray, backward: bool, last: bool) -> np.ndarray:
    """Seconds of one stage's layers for each micro-batch [group, rank in group, micro-batch] -> [group, micro]:
    the dense part costs the longest rank of the expert group, the routed experts their group's tokens."""
    times = 3.0 if backward else 1.0  # forward + dgrad + wgrad
    dense = sum(dense_params(dims, i) for i in layers) + (dims.embedding_params if last else 0)
    flops = times * (2 * dense * tokens + len(layers) * attention_flops_per_pair(dims) * pairs) / train.tp
    dense_s = (flops / (c.peak_tflops * 1e12)).max(axis=1)
    moe = sum(dims.is_moe(i) for i in layers)
    per_expert = dims.experts_per_token * tokens.sum(axis=1) / dims.experts  # balanced routing
    weight_bytes = dims.expert_params * (BF16 + (BF16 + c.main_grad_bytes if backward else 0))
    expert_s = np.maximum(times * 2 * per_expert * dims.expert_params / (c.peak_tflops * 1e12),
                          weight_bytes / (c.hbm_gb_per_s * GB))
    return dense_s + moe * train.experts_per_rank(dims) / train.expert_tp * expert_s


def pass_at_peak_s(run: Run, dims: Dims, c: Constants, train: ParallelLayout, micro: int, backward: bool,
                   recompute: int = 0, flushes: int = 1) -> float:
    """One Megatron pass over the batch at peak FLOPs and HBM bandwidth: per micro-batch the slowest stage (with
    `recompute` layers of each stage run forward again), plus the fill and drain of the pipeline per flush."""
    tokens, pairs = micro_batches(run, micro, run.opts.packed)
    coupled = max(1, min(train.ep, run.lay.dp))  # DP ranks whose micro-batches meet in the experts' all-to-all
    tokens = tokens.reshape(-1, coupled, tokens.shape[-1])
    pairs = pairs.reshape(-1, coupled, pairs.shape[-1])
    stages = train.stages(dims.layers)
    slowest = None
    for s, layers in enumerate(stages):
        last = s == len(stages) - 1
        t = stage_seconds(train, dims, c, layers, tokens, pairs, False, last)
        if backward:
            t = t + stage_seconds(train, dims, c, layers, tokens, pairs, True, last)
            t = t + stage_seconds(train, dims, c, layers[:recompute], tokens, pairs, False, False)
        slowest = t if slowest is None else np.maximum(slowest, t)
    per_flush = slowest.shape[1] // flushes
    bubble = (len(stages) - 1) * slowest.mean(axis=1) * flushes
    return float((slowest[:, :per_flush * flushes].sum(axis=1) + bubble).max())


def pass_limit_s(run: Run, dims: Dims, c: Constants, backward: bool) -> float:
    """The pass at peak FLOPs on the tokens themselves: no padding, recompute, bubbles or weight-bound experts."""
    seqs = run.work.prompt_tokens + response_lengths(run)
    flops = forward_flops(dims, float(seqs.sum()), float((seqs * (seqs + 1) / 2).sum()))
    return (3.0 if backward else 1.0) * flops / (run.lay.world * c.peak_tflops * 1e12)


def recompute_layers(lay: Layout) -> int:
    if lay.recompute_granularity != "full":
        return 0
    return 10**6 if lay.recompute_method == "uniform" else int(lay.recompute_num_layers or 0)


def ref(run: Run, dims: Dims, c: Constants, fit: Fit) -> Phase:
    lay = run.lay
    if not (lay.use_kl_loss or lay.use_kl_in_reward):
        return Phase({}, 0.0)
    compute = pass_at_peak_s(run, dims, c, lay.ref, lay.ref_micro_batch or lay.micro_batch, False) / fit.forward_eff
    return Phase({"compute": compute, "driver": driver_s(run, "ref", fit)},
                 pass_limit_s(run, dims, c, False) + driver_limit_s(run, "ref", c))


def old_log_prob(run: Run, dims: Dims, c: Constants, fit: Fit) -> Phase:
    lay = run.lay
    if not lay.recompute_old_log_prob:
        return Phase({}, 0.0)
    micro = lay.rollout_logprob_micro_batch or lay.micro_batch
    compute = pass_at_peak_s(run, dims, c, lay.train, micro, False) / fit.forward_eff
    return Phase({"compute": compute, "driver": driver_s(run, "old_log_prob", fit)},
                 pass_limit_s(run, dims, c, False) + driver_limit_s(run, "old_log_prob", c))


def update(run: Run, dims: Dims, c: Constants, fit: Fit) -> Phase:
    lay = run.lay
    flushes = max(1, lay.train_batch // lay.mini_batch)  # the pipeline fills and drains once per mini-batch
    compute = pass_at_peak_s(run, dims, c, lay.train, lay.micro_batch, True, recompute_layers(lay), flushes)
    swap = optimizer_swap_bytes(run, dims) / (c.host_gb_per_s * GB)
    return Phase({"compute": compute * lay.ppo_epochs / fit.train_eff, "optimizer swap": swap / fit.host_eff,
                  "driver": driver_s(run, "update", fit)},
                 lay.ppo_epochs * pass_limit_s(run, dims, c, True) + swap + driver_limit_s(run, "update", c))


# ---------------------------------------------------------------- transfers


def driver_bytes(run: Run, tensor_cache: bool | None = None) -> dict[str, tuple[float, float]]:
    """(Bytes sent, bytes collected) by verl's single controller per stage (the tensor list of
    benchmarks/driver_payload.py, which replays verl 0.4.0's fit loop): a Megatron call sends the whole batch to
    each of the TP x PP workers of every DP rank; the rollout sends each worker its own prompts. TensorCache keeps
    the batch on the workers: prompts in, responses and masks back, advantages in, once per DP rank or to every
    replica (Options.advantages_per_dp). Meta data and cache requests (kilobytes per worker) are left out."""
    lay, opts = run.lay, run.opts
    p, r, rows, replicas = lay.prompt_len, lay.response_len, lay.sequences, lay.train.model_parallel
    prompts_in = lay.train_batch * 3 * INT64 * p  # input_ids, attention_mask, position_ids
    if opts.tensor_cache if tensor_cache is None else tensor_cache:
        return {"rollout": (prompts_in, rows * INT64 * (r + p + r)), "old_log_prob": (0.0, 0.0), "ref": (0.0, 0.0),
                "update": (rows * FP32 * r * (1 if opts.advantages_per_dp else replicas), 0.0)}
    row = INT64 * (p + r + 3 * (p + r)) + (FP32 * r if opts.calculate_log_probs else 0)  # what the rollout returns
    out = {"rollout": (prompts_in, rows * row)}
    row += INT64 * r  # response_mask
    if lay.recompute_old_log_prob:
        out["old_log_prob"] = (rows * row * replicas, rows * 2 * FP32 * r)  # old_log_probs and entropys back
        row += FP32 * r
    out["ref"] = (rows * row * replicas, rows * FP32 * r)
    row += FP32 * r + 4 * FP32 * r  # ref_log_prob; token_level_scores and _rewards, advantages, returns
    out["update"] = (rows * row * replicas, 0.0)
    return out


def driver_s(run: Run, stage: str, fit: Fit) -> float:
    return sum(driver_bytes(run).get(stage, (0.0, 0.0))) / (fit.driver_gb_per_s * GB)


def driver_limit_s(run: Run, stage: str, c: Constants) -> float:
    """What must cross (TensorCache's flow) at the host link."""
    return sum(driver_bytes(run, tensor_cache=True).get(stage, (0.0, 0.0))) / (c.host_gb_per_s * GB)


def reshard_bytes(run: Run, dims: Dims) -> tuple[float, float]:
    """(Bytes the busiest rollout rank receives, the least it could): the planner's routed-expert moves of our verl
    series (each expert only to its rollout owners, or verl's all-gather over the expert group) and the full
    non-expert weights, which both paths deliver to every rank."""
    from verl.utils.reshard.plan import RolloutLayout, TrainLayout, expert_traffic

    lay, t = run.lay, run.lay.train
    train = TrainLayout(t.tp, t.pp, t.ep, lay.world, t.extend_ep)
    serving = RolloutLayout(dp=lay.rollout_dp, tp=lay.rollout_tp, instances=lay.rollout_instances)
    if run.opts.reshard_experts == "directed":
        experts = expert_traffic(train, serving, dims.experts).directed_recv_max
    else:  # the planner's all-gather count, which needs no directed plan (nor moe_tp_extend_ep)
        experts = dims.experts - dims.experts // train.etp_group
    per_expert = BF16 * dims.expert_params * dims.moe_layers
    non_expert = BF16 * (dims.total_params() - dims.moe_layers * dims.experts * dims.expert_params)
    return non_expert + experts * per_expert, non_expert + dims.experts // serving.ep * per_expert


def reshard(run: Run, dims: Dims, c: Constants, fit: Fit) -> Phase:
    received, least = reshard_bytes(run, dims)
    link = c.hccs_gb_per_s * GB
    return Phase({"fixed": fit.reshard_fixed_s, "bytes": received / link}, least / link)


def actor_params_per_die(lay: Layout, dims: Dims) -> float:
    return max(sum(stage_params(lay, dims, s, layers)) for s, layers in enumerate(lay.train.stages(dims.layers)))


def host_bytes(run: Run, dims: Dims, lifecycle: str | None = None) -> float:
    """Bytes per die between host and device per step. Manual lifecycle (the reference's order): actor params stay
    for the reshard and leave after it, grads leave after the update, both return before the next; the ref's
    params come in before the ref (its host copy stays, so leaving is a free). With vLLM's sleep mode the actor's
    params also leave after the update and return for the reshard, and vLLM's weights leave and return."""
    lay = run.lay
    actor = actor_params_per_die(lay, dims)
    out = (2 * BF16 * actor if lay.param_offload else 0.0) + (2 * FP32 * actor if lay.grad_offload else 0.0)
    out += BF16 * ref_params_per_die(lay, dims) if lay.ref_param_offload else 0.0
    if (lifecycle or run.opts.lifecycle) != "manual":
        out += 2 * BF16 * actor + 2 * BF16 * vllm_weight_params(lay, dims)
    return out


def optimizer_swap_bytes(run: Run, dims: Dims) -> float:
    """The optimizer state in and out of the die once per step, when swapped (MindSpeed) or offloaded (verl)."""
    lay = run.lay
    moved = lay.swap_optimizer or lay.optimizer_offload
    return 2 * ADAM_BYTES * actor_params_per_die(lay, dims) if moved else 0.0


def offload(run: Run, dims: Dims, c: Constants, fit: Fit) -> Phase:
    link = c.host_gb_per_s * GB
    return Phase({"host link": host_bytes(run, dims) / (link * fit.host_eff)}, host_bytes(run, dims, "manual") / link)


def reward(run: Run, fit: Fit) -> Phase:
    """CPU scoring and advantages: no physical limit is modelled (the limit is the prediction)."""
    s = fit.reward_us_per_token * 1e-6 * run.lay.sequences * run.work.response_tokens
    return Phase({"cpu": s}, s)


# ---------------------------------------------------------------- the step


@dataclass(frozen=True)
class Prediction:
    phases: dict[str, Phase]  # in step order
    tokens: float  # prompt + response tokens of the step
    cards: int
    dies_per_card: int

    @property
    def step_s(self) -> float:
        return sum(p.s for p in self.phases.values())

    @property
    def limit_s(self) -> float:
        return sum(p.limit for p in self.phases.values())

    @property
    def tps_card(self) -> float:
        return self.tokens / (self.step_s * self.cards)

    @property
    def tps_die(self) -> float:
        return self.tps_card / self.dies_per_card

    @property
    def limit_tps_card(self) -> float:
        return self.tokens / (self.limit_s * self.cards)

    @property
    def dominant(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k].s)

    @property
    def largest_gap(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k].s - self.phases[k].limit)


def predict(run: Run, dims: Dims, fit: Fit, c: Constants = CONSTANTS) -> Prediction:
    phases = {"rollout": rollout(run, dims, c, fit), "old_log_prob": old_log_prob(run, dims, c, fit),
              "ref": ref(run, dims, c, fit), "reward": reward(run, fit), "update": update(run, dims, c, fit),
              "reshard": reshard(run, dims, c, fit), "offload": offload(run, dims, c, fit)}
    return Prediction(phases, run.tokens, run.lay.cards, DIES_PER_CARD.get(run.lay.accelerator, 1))


def calibrate(run: Run, dims: Dims, published: dict[str, float], c: Constants = CONSTANTS) -> Fit:
    """The Fit that reproduces a published step's rollout, ref, update, reshard, offload and reward + adv phases
    (each phase's own efficiency; the driver rate from the published ref skew, not from these phases)."""
    lay = run.lay
    rate = driver_bytes(run)["ref"][0] / c.driver_ref_skew_s / GB  # the skew is the dispatch: bytes sent
    half = Fit(driver_gb_per_s=rate)  # what the driver parts need
    reward_us = 1e6 * (published["reward"] + published.get("adv", 0.0)) / (lay.sequences * run.work.response_tokens)
    host_eff = host_bytes(run, dims) / (c.host_gb_per_s * GB) / published["offload"]
    reshard_fixed = published["reshard"] - reshard_bytes(run, dims)[0] / (c.hccs_gb_per_s * GB)
    forward = published["ref"] - driver_s(run, "ref", half)
    forward_eff = pass_at_peak_s(run, dims, c, lay.ref, lay.ref_micro_batch or lay.micro_batch, False) / forward
    swap = optimizer_swap_bytes(run, dims) / (c.host_gb_per_s * GB) / host_eff
    flushes = max(1, lay.train_batch // lay.mini_batch)
    train = published["update"] - driver_s(run, "update", half) - swap
    train_eff = lay.ppo_epochs * pass_at_peak_s(run, dims, c, lay.train, lay.micro_batch, True,
                                                recompute_layers(lay), flushes) / train
    # rollout = driver + prefill + max over instances of slowdown x (hbm / eff + steps x off) + steps x sync
    decode = 1e3 * (published["rollout"] - driver_s(run, "rollout", half) - prefill_s(run, dims, c, forward_eff))
    off, slowdown, sync = step_overheads_ms(run, dims, c)
    hbm, steps = max(decode_instances(run, dims, c))
    decode_eff = hbm / ((decode - steps * sync) / slowdown - steps * off)
    return Fit(decode_eff, forward_eff, train_eff, rate, reshard_fixed, host_eff, reward_us)


# ---------------------------------------------------------------- what the dry run prints


def table(fit: Fit, c: Constants = CONSTANTS) -> list[tuple[str, float, str, str]]:
    """Every constant of the model: (name, value, unit, source)."""
    return [(f.name, getattr(obj, f.name), f.metadata["unit"], f.metadata["source"])
            for obj in (c, fit) for f in fields(obj)]


def render(pred: Prediction, title: str) -> str:
    rows = [(name, p) for name, p in pred.phases.items() if p.s or p.limit]
    lines = [title, f"  {'phase':<13} {'s':>8} {'limit s':>8} {'speed':>7}  of which (speed: the limit's time / the"
                    " predicted)"]
    for name, p in rows:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in p.parts.items() if v)
        lines.append(f"  {name:<13} {p.s:8.1f} {p.limit:8.1f} {p.limit / p.s if p.s else 1:7.0%}  {parts}")
    lines.append(f"  {'step':<13} {pred.step_s:8.1f} {pred.limit_s:8.1f} {pred.limit_s / pred.step_s:7.0%}")
    dom, gap = pred.phases[pred.dominant], pred.phases[pred.largest_gap]
    lines.append(f"  TPS per card {pred.tps_card:.1f} (limit {pred.limit_tps_card:.1f}), per die {pred.tps_die:.1f};"
                 f" dominant: {pred.dominant} ({dom.s / pred.step_s:.0%} of the step); largest gap to its limit:"
                 f" {pred.largest_gap} ({gap.s - gap.limit:.0f} s)")
    return "\n".join(lines)


def render_delta(base: Prediction, other: Prediction, title: str) -> str:
    lines = [title, f"  {'phase':<13} {'base s':>8} {'what-if s':>9} {'delta s':>8}"]
    for name in base.phases:
        b, o = base.phases[name].s, other.phases[name].s
        if b or o:
            lines.append(f"  {name:<13} {b:8.1f} {o:9.1f} {o - b:+8.1f}")
    lines.append(f"  {'step':<13} {base.step_s:8.1f} {other.step_s:9.1f} {other.step_s - base.step_s:+8.1f}"
                 f" ({other.step_s / base.step_s - 1:+.1%})")
    lines.append(f"  TPS per card {base.tps_card:.1f} -> {other.tps_card:.1f}")
    return "\n".join(lines)
