"""The numbers of a run, read once from a config into a plain dataclass (preflight, memory and the plan use it).

The actor's and the ref's Megatron layouts are tools.model's ParallelLayout, one per block; the rest is the run's:
the cluster, the rollout engines, offloading, recompute and the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from tools.launch.config import INSTALL, ConfigError, RecipeSettings, as_object, recipe_settings, value
from tools.launch.fields import KEY
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
    contents: tuple[str, ...]  # actor_rollout_ref.actor.checkpoint.save_contents

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


def _layer_list(cfg: DictConfig, key: str) -> tuple[int, ...] | None:
    """A layer list as our verl series reads it ([7,7,8] or "7,7,8"), by the series' own parser."""
    try:
        from verl.utils.megatron.layer_list import parse_num_layer_list
    except ImportError as exc:
        raise ConfigError(f"verl (our series) is not importable here ({exc}): {key} cannot be read; install the"
                          f" stack: {INSTALL}") from None
    try:
        layers = parse_num_layer_list(value(cfg, key), key)
    except ValueError as exc:
        raise ConfigError(f"{exc}: set {key} to one layer count per pipeline stage, or null for an even split") \
            from None
    return tuple(layers) if layers else None


def parallel_layout(cfg: DictConfig, role: str) -> ParallelLayout:
    """The Megatron layout of a role ("train": the actor, "ref") of a recipe config."""
    v = lambda name, default=None: value(cfg, KEY[f"{role}.{name}"], default)  # noqa: E731
    return ParallelLayout(tp=int(v("tp", 1)), pp=int(v("pp", 1)), ep=int(v("ep", 1)), etp=v("etp"),
                          extend_ep=bool(v("extend_ep", False)), layer_list=_layer_list(cfg, KEY[f"{role}.layer_list"]))


def from_config(cfg: DictConfig, settings: RecipeSettings | None = None) -> Layout:
    """The layout of a checked config (config.load builds it once, into Recipe.layout)."""
    v = lambda name, default=None: value(cfg, KEY[name], default)  # noqa: E731
    settings = settings or as_object(recipe_settings(cfg))
    recompute = v("transformer_config", {}) or {}
    return Layout(
        nodes=int(v("nodes")), devices_per_node=int(v("devices_per_node")), accelerator=str(v("accelerator")),
        train=parallel_layout(cfg, "train"), sequence_parallel=bool(v("sequence_parallel", False)),
        swap_optimizer=bool(v("swap_optimizer", False)), optimizer_offload=bool(v("optimizer_offload", False)),
        param_offload=bool(v("param_offload", False)), grad_offload=bool(v("grad_offload", False)),
        recompute_granularity=recompute.get("recompute_granularity"),
        recompute_method=recompute.get("recompute_method"),
        recompute_num_layers=recompute.get("recompute_num_layers"),
        ref=parallel_layout(cfg, "ref"), ref_param_offload=bool(v("ref_param_offload", False)),
        rollout_tp=int(v("rollout_tp", 1)), rollout_dp=int(settings.rollout.data_parallel_size),
        rollout_instances=int(settings.rollout.instances), rollout_ep=int(settings.rollout.expert_parallel_size),
        gpu_memory_utilization=float(v("gpu_memory_utilization", 0.5)), max_num_seqs=int(v("max_num_seqs", 1024)),
        max_num_batched_tokens=int(v("max_num_batched_tokens", 8192)),
        chunked_prefill=bool(v("chunked_prefill", False)), max_model_len=v("max_model_len"),
        train_batch=int(v("train_batch")), n=int(v("n", 1)), mini_batch=int(v("mini_batch")),
        micro_batch=int(v("micro_batch") or 1), ref_micro_batch=v("ref_micro_batch"),
        rollout_logprob_micro_batch=v("rollout_logprob_micro_batch"),
        prompt_len=int(v("prompt_len")), response_len=int(v("response_len")), ppo_epochs=int(v("ppo_epochs", 1)),
        recompute_old_log_prob=bool(v("recompute_old_log_prob", True)), adv_estimator=str(v("adv_estimator", "gae")),
        use_kl_loss=bool(v("use_kl_loss", False)), use_kl_in_reward=bool(v("use_kl_in_reward", False)),
        trainer_nnodes=int(v("trainer_nnodes", 1)), trainer_devices=int(v("trainer_devices", 1)),
        checkpoints=checkpoints(cfg, settings), rollout_name=str(v("rollout_name", "vllm")),
    )


def checkpoints(cfg: DictConfig, settings: RecipeSettings) -> Checkpoints:
    """recipe.checkpoints (its declared defaults) and the trainer keys verl saves by (verl 0.4.0's defaults)."""
    ck = settings.checkpoints
    keep = value(cfg, KEY["checkpoints.keep"])
    return Checkpoints(save_freq=int(value(cfg, KEY["checkpoints.save_freq"], -1)),
                       keep=None if keep is None else int(keep), dir=ck.dir,
                       write_gb_per_s=float(ck.write_gb_per_s), step_s=None if ck.step_s is None else float(ck.step_s),
                       contents=tuple(value(cfg, KEY["checkpoints.contents"], ["model", "optimizer", "extra"])))
