"""The three published A3 runs of DeepSeek-V3 671B GRPO (128 cards, 512 prompts x 16) that the step-time model
(timing.py) is fitted on (the first) and checked against (the other two), each as one of our profiles with the
overrides that make it that run, the mean lengths it measured and the phase times it published.

Sources, re-derived from each (TPS per card = (prompt + response tokens) / step / 128 cards, tools/report/metrics.py):
- the reference, true weights and random init: cann-recipes-train, llm_rl/deepseek/README.md and
  docs/llm_rl/deepseek_rl_train_optimization.md §1.4.1-1.4.2 (tables and footnotes [1], [2]);
  8192 x (77.8 + 1576.6) / 859.68 / 128 = 123.16; 8192 x (75 + 3039.8) / 796.8 / 128 = 250.2.
- verl's recipe/r1_ascend (README at v0.7.0, step 2; run_deepseekv3_671b_grpo_megatron_npu.sh):
  8192 x (175.1 + 1385.0) / 1044.8 / 128 = 95.57 (its README prints 95.5).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from tools.launch import config
from tools.model.dims import Dims, dims_from_config
from tools.perf import timing

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "deepseek_r1" / "configs"
# vLLM-Ascend's options (config.ADDITIONAL_CONFIG) and its TorchAir graph options, for the overrides below
VLLM = "actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config."
TORCHAIR = "actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.torchair_graph_config."


@dataclass(frozen=True)
class Published:
    name: str
    profile: str  # the config under recipes/deepseek_r1/configs it is made from
    overrides: tuple[str, ...]  # what the run set differently, each for a reason in `why`
    why: str
    workload: timing.Workload  # mean prompt and response tokens it measured
    packed: bool  # micro-batches packed (ours, upstream verl) or padded to their longest row (the reference's)
    phases: dict[str, float]  # seconds, as published
    step_s: float
    tps_card: float
    # published phase -> the model's phases it covers (verl's `gen` timer also spans the weight sync and onload)
    covers: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def run(self) -> timing.Run:
        run = timing.run_from_config(config.load(CONFIGS / f"{self.profile}.yaml", list(self.overrides)))
        # none of them sends TensorCache's advantages once per DP rank: that is our series'
        return replace(run, opts=replace(run.opts, packed=self.packed, advantages_per_dp=False), work=self.workload)

    def dims(self) -> Dims:
        return dims_from_config(config.model_dims(config.load(CONFIGS / f"{self.profile}.yaml"))[0])

    def compared(self) -> dict[str, tuple[str, ...]]:
        """Each published phase (reward with adv) and the model phases it is compared with."""
        out = {k: self.covers.get(k, (k,)) for k in self.phases if k != "adv"}
        return {k: v for k, v in out.items() if self.phases[k] or k in self.covers}


TRUE_WEIGHT = Published(
    "reference, true weights (step 2)", "a3-128-true-weight",
    ("actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=4",
     "actor_rollout_ref.tensor_cache.enable=false",
     VLLM + "dp_sync_on_device=false",
     "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
     "actor_rollout_ref.rollout.rebalance.enable=false"),
    "the table is for 4 recompute layers (the note above it); footnote [1] enables §5.1 and §6.1-6.4 on the"
    " r1_ascend code: no TensorCache (§3), DP syncs on gloo (§6.6), no live rollout rebalance (its code stops"
    " short of the rollout); its ref (144.5 s) is TensorCache's 'before'"
    " (156.8 s, §3.2.4), not its 'after' (105.1 s). Its reshard (11.5 s) matches the random-init run's directed"
    " one (11.18 s); old_log_prob is 0, so the on-policy skip (§5.2) is on. Prefill budget 1024 (§2.2).",
    timing.Workload(77.8, 1576.6), False,
    {"rollout": 373.65, "old_log_prob": 0.0, "ref": 144.5, "reward": 5.0, "adv": 0.21, "update": 319.3,
     "reshard": 11.5, "offload": 5.5}, 859.68, 123.16)

RANDOM_INIT = Published(
    "reference, random init, forced 3K (step 5)", "a3-128-random-init",
    ("actor_rollout_ref.rollout.max_num_batched_tokens=1024",),
    "footnote [2]: every optimisation of §3-6, so TensorCache, the directed reshard and DP syncs on device (its"
    " rollout, 318.27 s, is §6.6.3's 'after', 322 s); no recompute; forced expert balance (the model assumes"
    " balanced routing everywhere). Prefill budget 1024 (§2.2).",
    timing.Workload(75.0, 3039.8), False,
    {"rollout": 318.27, "old_log_prob": 0.0, "ref": 104.7, "reward": 13.7, "adv": 0.188, "update": 328.8,
     "reshard": 11.18, "offload": 24.45}, 796.8, 250.2)

R1_ASCEND_OVERRIDES = (
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=8",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size=32",
    "actor_rollout_ref.actor.megatron.moe_tp_extend_ep=false",
    "actor_rollout_ref.actor.megatron.num_layer_list=[6,8,8,8,8,8,8,7]",
    "actor_rollout_ref.actor.megatron.sequence_parallel=false",
    "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
    "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=block",
    "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.recompute_old_log_prob=true",
    "actor_rollout_ref.tensor_cache.enable=false",
    "actor_rollout_ref.rollout.reshard.experts=gather",
    "actor_rollout_ref.rollout.reshard.tp_pp=gather",
    "actor_rollout_ref.rollout.lifecycle=sleep",
    "recipe.rollout.torchair_graph=false",
    TORCHAIR + "enable_multistream_mla=false",
    VLLM + "multistream_overlap_shared_expert=false",
    TORCHAIR + "enable_kv_nz=false",
    TORCHAIR + "graph_batch_sizes=[]",
    VLLM + "dp_sync_on_device=false",
    "actor_rollout_ref.rollout.max_num_batched_tokens=1024",
    "data.max_response_length=2048",
    "actor_rollout_ref.rollout.ignore_eos=false",
    "actor_rollout_ref.rollout.calculate_log_probs=false",
)
R1_ASCEND = Published(
    "verl recipe/r1_ascend (v0.7.0, step 2)", "a3-128-random-init",
    R1_ASCEND_OVERRIDES,
    "its script: actor and ref EP32 PP8 (TP1), layers 6,8,..,7, full block recompute of 8, log-prob micro-batches"
    " 4, rollout TP2 over 256 dies (DP128 EP256) with no TorchAir config, 1K/2K; upstream verl: no TensorCache,"
    " gather reshard, packed micro-batches, DP syncs on gloo; old_log_prob computed (105.5 s published); vLLM's"
    " weights offloaded and onloaded by its patches (the sleep-mode traffic).",
    timing.Workload(175.1, 1385.0), True,
    {"gen": 482.2, "reward": 20.4, "old_log_prob": 105.5, "ref": 92.7, "update": 342.9}, 1044.8, 95.5,
    covers={"gen": ("rollout", "reshard", "offload")})

HELD_OUT = (RANDOM_INIT, R1_ASCEND)


@lru_cache(maxsize=1)
def fit() -> timing.Fit:
    """The model's efficiencies, from the true-weight step alone."""
    return timing.calibrate(TRUE_WEIGHT.run(), TRUE_WEIGHT.dims(), TRUE_WEIGHT.phases)


def errors(pub: Published, pred: timing.Prediction) -> dict[str, tuple[float, float]]:
    """(published s, predicted s) per compared phase, and for the step."""
    out = {k: (pub.phases[k] + (pub.phases.get("adv", 0.0) if k == "reward" else 0.0),
               sum(pred.phases[p].s for p in phases)) for k, phases in pub.compared().items()}
    out["step"] = (pub.step_s, pred.step_s)
    return out
