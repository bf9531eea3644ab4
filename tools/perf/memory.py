"""Per-die memory estimate of a colocated GRPO step (pure arithmetic; preflight checks it against the device).

Two peaks matter because the three models take turns on every die:
- update: the actor's Megatron shard (bf16 params, fp32 grads, optimizer state unless swapped or offloaded),
  activations of the micro-batches in flight under 1F1B (full-recompute layers keep only their input), the ref
  shard if it is not offloaded, and a runtime reserve;
- rollout: vLLM takes gpu_memory_utilization of the die for its weights, workspace and KV cache; what Megatron
  leaves resident plus the reserve must fit in the rest.
Activation sizes follow Megatron's per-layer estimate (34 bytes x hidden per token with sequence parallelism;
flash attention, so no s^2 term), with the MLP part replaced by the routed experts' share for MoE layers. It is
an estimate for catching impossible layouts, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tools.launch.layout import Layout
from tools.model.dims import Dims

GB = 1e9
BF16, FP32 = 2, 4
ADAM_BYTES = 12            # fp32 master weights + Adam m and v
RUNTIME_RESERVE_GB = 3.0   # CANN/CUDA runtime, communicator buffers (HCCL_BUFFSIZE x groups), workspace
VLLM_WORKSPACE_GB = 2.0    # vLLM's activation peak (max_num_batched_tokens) and captured graphs


@dataclass
class Estimate:
    """GB per die, item by item, for the printed table."""

    device_gb: float
    update: dict[str, float] = field(default_factory=dict)
    update_stage: int = 0
    rollout_resident: dict[str, float] = field(default_factory=dict)
    vllm: dict[str, float] = field(default_factory=dict)

    @property
    def update_total(self) -> float:
        return sum(self.update.values())

    @property
    def rollout_outside_vllm(self) -> float:
        return sum(self.rollout_resident.values())


def stage_params(lay: Layout, dims: Dims, stage: int, layers: range) -> tuple[float, float]:
    """(dense-part params, expert params) of one die of a pipeline stage."""
    train = lay.train
    dense = 0.0
    expert = 0.0
    for layer in layers:
        dense += dims.attention_params / train.tp
        if not dims.is_moe(layer):
            dense += dims.dense_mlp_params / train.tp
        else:
            dense += dims.shared_experts * dims.expert_params / train.tp + dims.router_params
            expert += train.experts_per_rank(dims) * dims.expert_params / train.expert_tp
    if stage == 0:
        dense += dims.embedding_params / train.tp
    if stage == train.pp - 1:
        dense += dims.embedding_params / train.tp + dims.hidden
    return dense, expert


def layer_activation_bytes(lay: Layout, dims: Dims, layer: int, tokens: int) -> float:
    """Bytes one layer keeps for backward for `tokens` tokens, on one die (SP splits tokens over TP)."""
    per_die = tokens / lay.train.tp if lay.sequence_parallel else tokens
    h = dims.hidden
    if not dims.is_moe(layer):
        return 34 * h * per_die
    shared = 19 * h * per_die * dims.shared_experts / max(1, dims.shared_experts)  # shared expert like a dense MLP
    # permuted in/out, gate+up, act, down in
    routed = dims.experts_per_token * per_die * (4 * h + 6 * dims.moe_intermediate)
    return 15 * h * per_die + shared + routed


def stage_activation_bytes(lay: Layout, dims: Dims, stage: int, layers: range) -> float:
    tokens = lay.seq_len * lay.micro_batch
    per_rank = lay.sequences // max(1, lay.dp)
    in_flight = min(lay.train.pp - stage, max(1, per_rank // lay.micro_batch))
    recomputed = 0
    if lay.recompute_granularity == "full":
        recomputed = min(len(layers), lay.recompute_num_layers or len(layers))
    kept = 0.0
    for i, layer in enumerate(layers):
        full = layer_activation_bytes(lay, dims, layer, tokens)
        kept += (2 * dims.hidden * tokens / (lay.train.tp if lay.sequence_parallel else 1)) if i < recomputed else full
    working = max(layer_activation_bytes(lay, dims, layer, tokens) for layer in layers) if recomputed else 0.0
    logits = 2 * FP32 * tokens * dims.vocab / lay.train.tp if stage == lay.train.pp - 1 else 0.0
    return kept * in_flight + working + logits


def optimizer_bytes(lay: Layout, dims: Dims, dense: float, expert: float, n_layers: int) -> float:
    expert_dp = max(1, lay.dp // lay.train.ep)
    full = ADAM_BYTES * (dense / max(1, lay.dp) + expert / expert_dp)
    if lay.optimizer_offload:
        return 0.0
    if lay.swap_optimizer:
        return full / max(1, n_layers)  # swapped in one layer's worth at a time
    return full


def ref_params_per_die(lay: Layout, dims: Dims) -> float:
    ref = replace(lay, train=lay.ref)
    return max(sum(stage_params(ref, dims, s, r)) for s, r in enumerate(ref.train.stages(dims.layers)))


def vllm_weight_params(lay: Layout, dims: Dims) -> float:
    """One rollout die: attention and dense parts split by rollout TP, routed experts split by rollout EP."""
    moe = dims.moe_layers
    dense = (dims.layers * dims.attention_params + dims.dense_layers * dims.dense_mlp_params
             + moe * (dims.shared_experts * dims.expert_params) + 2 * dims.embedding_params) / lay.rollout_tp \
        + moe * dims.router_params
    return dense + moe * dims.experts / lay.rollout_ep * dims.expert_params


def estimate(lay: Layout, dims: Dims, device_gb: float) -> Estimate:
    est = Estimate(device_gb=device_gb)
    ref_gb = 0.0 if lay.ref_param_offload else BF16 * ref_params_per_die(lay, dims) / GB
    worst = None
    for stage, layers in enumerate(lay.train.stages(dims.layers)):
        if not len(layers):
            continue
        dense, expert = stage_params(lay, dims, stage, layers)
        params = dense + expert
        items = {"actor params (bf16)": BF16 * params / GB, "actor grads (fp32)": FP32 * params / GB,
                 "optimizer state on die": optimizer_bytes(lay, dims, dense, expert, len(layers)) / GB,
                 "activations (1F1B in flight)": stage_activation_bytes(lay, dims, stage, layers) / GB,
                 "ref params (bf16)": ref_gb, "runtime reserve": RUNTIME_RESERVE_GB}
        if worst is None or sum(items.values()) > sum(worst[1].values()):
            worst = (stage, items, params, dense, expert, len(layers))
    est.update_stage, est.update = worst[0], worst[1]
    params, dense, expert, n_layers = worst[2], worst[3], worst[4], worst[5]
    est.rollout_resident = {
        "actor params left on die": 0.0 if lay.param_offload else BF16 * params / GB,
        "actor grads left on die": 0.0 if lay.grad_offload else FP32 * params / GB,
        "optimizer state left on die": (0.0 if lay.swap_optimizer else
                                        optimizer_bytes(lay, dims, dense, expert, n_layers) / GB),
        "ref params left on die": ref_gb,
        "runtime reserve": RUNTIME_RESERVE_GB,
    }
    budget = lay.gpu_memory_utilization * device_gb
    weights = BF16 * vllm_weight_params(lay, dims) / GB
    est.vllm = {"budget (gpu_memory_utilization x device)": budget, "weights (bf16)": weights,
                "workspace": VLLM_WORKSPACE_GB, "kv cache budget": budget - weights - VLLM_WORKSPACE_GB,
                "kv cache needed": kv_needed_gb(lay, dims)}
    return est


def kv_needed_gb(lay: Layout, dims: Dims) -> float:
    """KV cache for every sequence of one engine at full length (one batch, no preemption)."""
    per_engine = -(-lay.sequences // max(1, lay.engines))
    return per_engine * lay.seq_len * kv_bytes_per_token(dims) / GB


def kv_bytes_per_token(dims: Dims) -> int:
    """MLA caches the compressed latent and the rope key: whole on every TP rank."""
    return dims.layers * (dims.kv_lora_rank + dims.qk_rope) * BF16
