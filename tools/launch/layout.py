"""The numbers of a run, read once from a config into a plain dataclass (preflight, memory and the plan use it).

The actor's and the ref's Megatron layouts are tools.model's ParallelLayout, one per block; the rest is the run's:
the cluster, the rollout engines, offloading, recompute and the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from tools.launch.config import recipe_settings, value
from tools.launch.keys import AM, RM, RR, A, R
from tools.model.parallel import ParallelLayout

# Device memory per die/GPU in GB (10^9 bytes) and the Ray resource that counts devices.
DEVICE_MEMORY_GB = {"a3": 64.0, "h200": 141.0}
RAY_RESOURCE = {"a3": "NPU", "h200": "GPU", "cpu": None}
DIES_PER_CARD = {"a3": 2, "h200": 1, "cpu": 1}


@dataclass(frozen=True)
class Checkpoints:
    """A run's checkpoint settings (recipe.checkpoints and verl's trainer keys), read once by layout.from_config."""

    save_freq: int  # trainer.save_freq: steps between saves; <= 0: no saves
    keep: int | None  # trainer.max_actor_ckpt_to_keep: the newest K kept; None (or <= 0): every one
    dir: str | None  # recipe.checkpoints.dir: a directory every node mounts; None: <run dir>/checkpoints
    write_gb_per_s: float  # recipe.checkpoints.write_gb_per_s
    step_s: float | None  # recipe.checkpoints.step_s: the step time the cadence was chosen for
    contents: tuple[str, ...]  # actor_rollout_ref.actor.checkpoint.contents

    @property
    def saves(self) -> bool:
        return self.save_freq > 0

    @property
    def bounded(self) -> bool:
        return self.keep is not None and self.keep > 0


@dataclass(frozen=True)
class Layout:
    nodes: int
    devices_per_node: int
    accelerator: str
    # actor (Megatron)
    train: ParallelLayout
    sequence_parallel: bool
    swap_optimizer: bool
    optimizer_offload: bool
    param_offload: bool
    grad_offload: bool
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None
    # ref (Megatron)
    ref: ParallelLayout
    ref_param_offload: bool
    # rollout (vLLM)
    rollout_tp: int
    rollout_dp: int
    rollout_instances: int
    rollout_ep: int
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    max_model_len: int | None
    enforce_eager: bool
    free_cache_engine: bool
    # batch
    train_batch: int
    n: int
    mini_batch: int
    micro_batch: int
    ref_micro_batch: int | None
    rollout_logprob_micro_batch: int | None
    prompt_len: int
    response_len: int
    ppo_epochs: int
    recompute_old_log_prob: bool
    adv_estimator: str
    use_kl_loss: bool
    use_kl_in_reward: bool
    trainer_nnodes: int
    trainer_devices: int
    checkpoints: Checkpoints
    rollout_name: str = "vllm"  # verl's rollout.name: vllm (engines with EP) or hf (each rank holds the whole model)

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def dp(self) -> int:
        return self.world // self.train.model_parallel if self.train.model_parallel else 0

    @property
    def sequences(self) -> int:
        return self.train_batch * self.n

    @property
    def engines(self) -> int:
        return self.rollout_dp * self.rollout_instances

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def cards(self) -> int:
        return self.world // DIES_PER_CARD.get(self.accelerator, 1)


def _tuple(v) -> tuple[int, ...] | None:
    return tuple(int(x) for x in v) if v else None


def parallel_layout(cfg: DictConfig, block: str) -> ParallelLayout:
    """The Megatron layout a block (AM or RM) of a recipe config sets."""
    v = lambda key, default=None: value(cfg, block + key, default)  # noqa: E731
    return ParallelLayout(tp=int(v("tensor_model_parallel_size", 1)), pp=int(v("pipeline_model_parallel_size", 1)),
                          ep=int(v("expert_model_parallel_size", 1)), etp=v("expert_tensor_parallel_size"),
                          extend_ep=bool(v("moe_tp_extend_ep", False)), layer_list=_tuple(v("num_layer_list")))


def from_config(cfg: DictConfig) -> Layout:
    v = lambda key, default=None: value(cfg, key, default)  # noqa: E731
    recompute = v(AM + "override_transformer_config", {}) or {}
    return Layout(
        nodes=int(v("launch.nodes")), devices_per_node=int(v("launch.devices_per_node")),
        accelerator=str(v("launch.accelerator")),
        train=parallel_layout(cfg, AM), sequence_parallel=bool(v(AM + "sequence_parallel", False)),
        swap_optimizer=bool(v(AM + "swap_optimizer", False)),
        optimizer_offload=bool(v(AM + "optimizer_offload", False)),
        param_offload=bool(v(AM + "param_offload", False)), grad_offload=bool(v(AM + "grad_offload", False)),
        recompute_granularity=recompute.get("recompute_granularity"),
        recompute_method=recompute.get("recompute_method"),
        recompute_num_layers=recompute.get("recompute_num_layers"),
        ref=parallel_layout(cfg, RM), ref_param_offload=bool(v(RM + "param_offload", False)),
        rollout_tp=int(v(R + "tensor_model_parallel_size", 1)), rollout_dp=int(v(RR + "data_parallel_size", 1)),
        rollout_instances=int(v(RR + "instances", 1)), rollout_ep=int(v(RR + "expert_parallel_size", 1)),
        gpu_memory_utilization=float(v(R + "gpu_memory_utilization", 0.5)),
        max_num_seqs=int(v(R + "max_num_seqs", 1024)),
        max_num_batched_tokens=int(v(R + "max_num_batched_tokens", 8192)),
        chunked_prefill=bool(v(R + "enable_chunked_prefill", False)), max_model_len=v(R + "max_model_len"),
        enforce_eager=bool(v(R + "enforce_eager", True)), free_cache_engine=bool(v(R + "free_cache_engine", True)),
        train_batch=int(v("data.train_batch_size")), n=int(v(R + "n", 1)),
        mini_batch=int(v(A + "ppo_mini_batch_size")), micro_batch=int(v(A + "ppo_micro_batch_size_per_gpu") or 1),
        ref_micro_batch=v("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
        rollout_logprob_micro_batch=v(R + "log_prob_micro_batch_size_per_gpu"),
        prompt_len=int(v("data.max_prompt_length")), response_len=int(v("data.max_response_length")),
        ppo_epochs=int(v(A + "ppo_epochs", 1)), recompute_old_log_prob=bool(v(A + "recompute_old_log_prob", True)),
        adv_estimator=str(v("algorithm.adv_estimator", "gae")), use_kl_loss=bool(v(A + "use_kl_loss", False)),
        use_kl_in_reward=bool(v("algorithm.use_kl_in_reward", False)),
        trainer_nnodes=int(v("trainer.nnodes", 1)), trainer_devices=int(v("trainer.n_gpus_per_node", 1)),
        checkpoints=checkpoints(cfg),
        rollout_name=str(v(R + "name", "vllm")),
    )


def checkpoints(cfg: DictConfig) -> Checkpoints:
    """recipe.checkpoints (its declared defaults) and the trainer keys verl saves by (verl 0.4.0's defaults)."""
    ck = recipe_settings(cfg).checkpoints
    keep = value(cfg, "trainer.max_actor_ckpt_to_keep")
    return Checkpoints(save_freq=int(value(cfg, "trainer.save_freq", -1)), keep=None if keep is None else int(keep),
                       dir=ck.dir, write_gb_per_s=float(ck.write_gb_per_s),
                       step_s=None if ck.step_s is None else float(ck.step_s),
                       contents=tuple(value(cfg, A + "checkpoint.contents", ["model", "optimizer", "extra"])))
