"""Recipe configs: load with overrides, check them, type them once (Recipe), build the verl config.

A recipe config is a verl config (keys of verl's ppo_megatron_trainer.yaml, which in our series declares the
series' own keys too) plus `launch:` and `recipe:`, which only the launcher reads (typed by LaunchSettings and
RecipeSettings). load refuses keys verl does not have, naming the nearest known key, and values that break their
type, fixed set or range (tools/launch/rules.py), then reads every value the launcher uses into the typed Recipe
(tools/launch/fields.py maps each field to its key). The rules across verl's settings live in our verl series
(verl/trainer/config/series_settings.py), which check_series runs.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib
import importlib.util
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationToMissingValueError, MissingMandatoryValue, ValidationError

from tools.model.errors import ConfigError

if TYPE_CHECKING:
    from tools.launch.layout import Layout

ROOT = Path(__file__).resolve().parents[2]
VERL_CONFIG = "verl/trainer/config/ppo_megatron_trainer.yaml"
# verl's trainer config per actor strategy: its main_ppo picks the worker classes from the same key
VERL_CONFIGS = {"megatron": VERL_CONFIG, "fsdp": "verl/trainer/config/ppo_trainer.yaml",
                "fsdp2": "verl/trainer/config/ppo_trainer.yaml"}
ENGINE_KWARGS = "actor_rollout_ref.rollout.engine_kwargs.vllm"  # verl 0.6.1 passes it to vllm.LLM(**...)
# Where a key may be new to verl: `launch:`, `recipe:` (typed by RecipeSettings) and vLLM's engine arguments (each
# checked by vllm_engine_settings).
EXTENSION_PREFIXES = ("launch.", "recipe.", ENGINE_KWARGS + ".")
# Free-form maps inside verl's Megatron blocks. override_transformer_config goes into Megatron-core's
# (MLA)TransformerConfig, whose fields check its keys. mindspeed.args holds MindSpeed-LLM argument names: only an
# installed MindSpeed-LLM knows them (it is not installable off Ascend), so that map stays open.
TRANSFORMER_OVERRIDES = ("actor_rollout_ref.actor.megatron.override_transformer_config.",
                         "actor_rollout_ref.ref.megatron.override_transformer_config.")
OPEN_MAPS = ("actor_rollout_ref.actor.megatron.mindspeed.args.",)
INSTALL = "`nox -s install` or `python -m tools.install --device cpu`"
REQUIRED_LAUNCH = ("launch.nodes", "launch.devices_per_node", "launch.accelerator", "launch.env_profile",
                   "launch.ray.port", "launch.ray.dashboard_port")


@dataclass(frozen=True)
class Recipe:
    """A loaded config, checked and typed (load): the file it came from (relative paths in it are relative to it),
    its content as written plus the overrides (what verl gets, in verl.yaml), and the typed settings every part
    of the launcher reads instead of the content. tools/launch/fields.py maps each typed field to its key."""

    path: Path
    cfg: DictConfig
    overrides: tuple[str, ...]
    launch: LaunchSettings  # the cluster: nodes, devices, accelerator, env profile, Ray
    settings: RecipeSettings  # recipe:
    engine: AscendEngine  # what vLLM-Ascend gets through engine_kwargs.vllm
    layout: Layout  # the parallel layouts of actor, ref and rollout, the batch, the checkpoints
    rollout: RolloutSettings  # what the step time depends on besides the layout
    inputs: Inputs  # what the run reads from disk

    @property
    def name(self) -> str:
        return self.path.stem


@dataclass
class RaySettings:
    port: int = MISSING  # GCS port on the head
    dashboard_port: int = MISSING  # the Jobs API the trainer is submitted through
    join_timeout_s: float = 600.0  # how long the head waits for every node and its devices, its restarts included
    extra_start_args: list[str] = field(default_factory=list)  # added to every `ray start` (e.g. fixed ports)


@dataclass
class LaunchSettings:
    """`launch:`, read only by the launcher: the cluster (OmegaConf refuses any other key)."""

    nodes: int = MISSING
    devices_per_node: int = MISSING
    accelerator: str = MISSING  # a3 | h200 | cpu
    env_profile: str = MISSING  # recipes/<recipe>/env/<name>.yaml
    ray: RaySettings = field(default_factory=RaySettings)


@dataclass(frozen=True)
class RolloutSettings:
    """verl settings the step time depends on besides the layout (timing.options)."""

    tensor_cache: bool = False
    reshard_experts: str = "gather"
    lifecycle: str = "sleep"
    calculate_log_probs: bool = False
    ignore_eos: bool = False
    rebalance: bool = False  # the live rollout rebalance (verl series: rollout/rebalance/settings.py)


@dataclass(frozen=True)
class Inputs:
    """What the run reads from disk, and the required settings left as `???` (inputs.input_checks)."""

    missing: tuple[str, ...] = ()
    model_path: str | None = None
    train_files: str | list[str] | None = None
    val_files: str | list[str] | None = None
    weights_load: bool = False
    mcore_checkpoint: str | None = None
    dist: tuple[tuple[str, bool, str | None], ...] = ()  # (role, use_dist_checkpointing, dist_checkpointing_path)


@dataclass
class RecipeWeights:
    load: bool = False  # true: start from the weights `loader` reads; false: random init (Megatron's own)
    # Who puts the weights into Megatron when load is true (WEIGHT_LOADERS; docs/weights-and-data.md says which when)
    loader: str = "hf-to-mcore"
    mcore_checkpoint: str | None = None  # the converted Megatron checkpoint (tools.weights), relative to the config


@dataclass
class RecipeRollout:
    data_parallel_size: int = 1  # vLLM DP engines per rollout instance (verl: rollout.data_parallel_size)
    instances: int = 1  # rollout instances over the world; DP x TP x instances == world
    expert_parallel_size: int = 1  # vLLM EP inside an instance (== DP x TP with vLLM, 1 without)
    torchair_graph: bool = False  # vLLM-Ascend graph decode (interpolated into additional_config.torchair_graph_config)


@dataclass
class RecipeCheckpoints:
    # Where a run saves: <dir>/<run id>, a directory every node mounts (each rank writes its own shards there).
    # null: <run dir>/checkpoints, for a one-node run. The launcher sets verl's trainer.default_local_dir to it
    # (run.checkpoint_dir). The cadence and how many to keep are verl's trainer.save_freq and
    # trainer.max_actor_ckpt_to_keep.
    dir: str | None = None
    write_gb_per_s: float = 5.0  # the filesystem's write bandwidth for one checkpoint (preflight's time estimate)
    step_s: float | None = None  # the step time the save cadence was chosen for (preflight's overhead estimate)


@dataclass
class RecipeTiming:
    # The mean lengths the step-time prediction assumes (tools/perf/timing.py); with rollout.ignore_eos every
    # response is max_response_length. Defaults: the reference's true-weight step 2 on deepscaler.
    prompt_tokens: float = 77.8
    response_tokens: float = 1576.6


@dataclass
class RecipeSettings:
    """`recipe:`, read only by the launcher: its keys, types and defaults (OmegaConf refuses any other)."""

    model_dims: str | None = None  # architecture yaml, relative to the config, when model.path has no config.json
    weights: RecipeWeights = field(default_factory=RecipeWeights)
    rollout: RecipeRollout = field(default_factory=RecipeRollout)
    checkpoints: RecipeCheckpoints = field(default_factory=RecipeCheckpoints)
    timing: RecipeTiming = field(default_factory=RecipeTiming)


def recipe_settings(cfg: DictConfig) -> DictConfig:
    """`recipe:` checked against RecipeSettings: an unknown key or a wrong type names the key (and the nearest
    known one)."""
    return _typed_block(cfg, "recipe", RecipeSettings, "a recipe setting")


def launch_settings(cfg: DictConfig) -> LaunchSettings:
    """`launch:` checked against LaunchSettings, as an object."""
    return as_object(_typed_block(cfg, "launch", LaunchSettings, "a launch setting"))


def as_object(block: DictConfig):
    """A checked block as its dataclass; a required setting left `???` is None there (inputs reports it)."""
    block = copy.deepcopy(block)
    for key in missing_keys(block):
        try:
            OmegaConf.update(block, key, None, merge=False)
        except ValidationError:
            raise ConfigError(f"{block._get_full_key(key)} is ??? (not set): set it on the command line or in"
                              " the config") from None
    return OmegaConf.to_object(block)


def _typed_block(cfg: DictConfig, name: str, schema: type, what: str) -> DictConfig:
    block = cfg.get(name) if isinstance(cfg, DictConfig) else None
    structured = OmegaConf.structured(schema)
    if block is None:
        return structured
    try:
        merged = OmegaConf.merge(structured, block)
    except ConfigKeyError as exc:
        parent, _, key = f"{name}.{exc.full_key}".rpartition(".")
        known = list(OmegaConf.select(OmegaConf.create({name: structured}), parent).keys())
        raise ConfigError(f"{parent}.{key} is not {what}{_did_you_mean(key, known)}; known under"
                          f" {parent}: {', '.join(known)}") from None
    except ValidationError as exc:
        raise ConfigError(f"{name}.{exc.full_key}: {exc.msg.splitlines()[0]}") from None
    return merged


def _did_you_mean(key: str, known) -> str:
    near = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {near[0]}?)" if near else ""


def load(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """The config file with `key=value` overrides merged on top (OmegaConf dotlist syntax), checked (keys, types,
    fixed sets and ranges: tools/launch/rules.py; the A3-only settings; vLLM's engine arguments) and typed once."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config {path} not found")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not key=value (e.g. data.train_batch_size=256)")
    cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))
    for key in REQUIRED_LAUNCH:
        if OmegaConf.select(cfg, key, default=None) is None:
            raise ConfigError(f"{path}: {key} is not set; every recipe config has a launch block"
                              " (nodes, devices_per_node, accelerator, env_profile, ray.port, ray.dashboard_port)")
    try:
        base = verl_base_for(cfg)
        refuse_unknown_keys(cfg, base)
        refuse_bad_values(cfg, base)
        settings = as_object(recipe_settings(cfg))
        weights_loader_settings(cfg, base, settings.weights)
        launch = launch_settings(cfg)
        accelerator_settings(cfg)
        engine = vllm_engine_settings(cfg)
        return typed(path.resolve(), cfg, tuple(overrides), launch, settings, engine)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def refuse_bad_values(cfg: DictConfig, declared: DictConfig) -> None:
    """ConfigError naming the first value that breaks its type, fixed set or range (tools/launch/rules.py), and how
    many more there are."""
    from tools.launch import rules

    values = {k: v for k, v in leaf_values(resolved(cfg)).items()
              if v != "???" and not k.startswith((ENGINE_KWARGS + ".",) + OPEN_MAPS)}
    types = {**schema_types(LaunchSettings, "launch."), **schema_types(RecipeSettings, "recipe.")}
    try:
        problems = rules.check(values, declared, types)
    except LookupError as exc:
        raise ConfigError(f"{exc} ({INSTALL})") from None
    if problems:
        more = f" (and {len(problems) - 1} more: {', '.join(p.field for p in problems[1:4])})" \
            if len(problems) > 1 else ""
        raise ConfigError(problems[0].message + more)


def schema_types(schema: type, prefix: str) -> dict[str, type]:
    """Dotted key -> the plain type (int, float, bool, str, list) of each field of a settings dataclass."""
    out = {}
    for name, hint in typing.get_type_hints(schema).items():
        if dataclasses.is_dataclass(hint):
            out.update(schema_types(hint, f"{prefix}{name}."))
            continue
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None -> X
            hint = next(t for t in typing.get_args(hint) if t is not type(None))
        base = typing.get_origin(hint) or hint
        if base in (int, float, bool, str, list):
            out[prefix + name] = base
    return out


def typed(path: Path, cfg: DictConfig, overrides: tuple[str, ...], launch: LaunchSettings,
          settings: RecipeSettings, engine: AscendEngine) -> Recipe:
    """The typed run config of a checked config: every value the launcher reads, read once (tools/launch/fields.py
    names each field's key)."""
    from tools.launch import layout
    from tools.launch.fields import KEY

    def v(name, default=None):
        return value(cfg, KEY[name], default)

    rollout = RolloutSettings(tensor_cache=bool(v("rollout.tensor_cache", False)),
                              reshard_experts=str(v("rollout.reshard_experts", "gather")),
                              lifecycle=str(v("rollout.lifecycle", "sleep")),
                              calculate_log_probs=bool(v("rollout.calculate_log_probs", False)),
                              ignore_eos=bool(v("rollout.ignore_eos", False)),
                              rebalance=bool(v("rollout.rebalance", False)))
    # mbridge reads model.path: a `???` left for the conversion is not a setting the run needs
    unread = {KEY["inputs.mcore_checkpoint"]} if settings.weights.loader == "mbridge" else set()
    inputs = Inputs(missing=tuple(k for k in missing_keys(cfg) if k not in unread), model_path=v("inputs.model_path"),
                    train_files=v("inputs.train_files"), val_files=v("inputs.val_files"),
                    # the converted checkpoint is read (and checked) only when hf-to-mcore's output is the loader
                    weights_load=bool(settings.weights.load) and settings.weights.loader == "hf-to-mcore",
                    mcore_checkpoint=settings.weights.mcore_checkpoint,
                    dist=tuple((role, v(f"inputs.{role}_dist", False) is True, v(f"inputs.{role}_dist_path"))
                               for role in ("actor", "ref")))
    return Recipe(path, cfg, overrides, launch, settings, engine, layout.from_config(cfg, settings), rollout, inputs)


# recipe.weights.loader: what puts the weights into verl's Megatron model at start-up, and the verl switches each sets.
#   hf-to-mcore: `python -m tools.weights hf-to-mcore`'s output at recipe.weights.mcore_checkpoint, converted once;
#                verl reads a torch_dist one with megatron.use_dist_checkpointing (use_mbridge stays false)
#   mbridge:     mbridge reads the HF safetensors at actor_rollout_ref.model.path (megatron.use_mbridge=true,
#                use_dist_checkpointing=false); nothing is converted (tests/weights/test_mbridge.py: same weights)
WEIGHT_LOADERS = ("hf-to-mcore", "mbridge")
WEIGHT_ROLES = ("actor", "ref")  # the Megatron models verl loads weights into


def _megatron_key(role: str, name: str) -> str:
    return f"actor_rollout_ref.{role}.megatron.{name}"


def weights_loader_settings(cfg: DictConfig, base: DictConfig, weights: RecipeWeights) -> None:
    """recipe.weights.loader against verl's switches, resolved as verl gets them (the ref's use_mbridge defaults to
    the actor's): ConfigError naming the field and the fix. verl 0.6.1 (megatron_workers.py) reads
    use_dist_checkpointing first: with use_mbridge also true, mbridge builds the model but the HF weights are never
    read; with use_mbridge alone, the conversion is never read."""
    key = "recipe.weights.loader"
    if weights.loader not in WEIGHT_LOADERS:
        raise ConfigError(f"{key} is {weights.loader!r}: use one of {', '.join(WEIGHT_LOADERS)}")
    merged = OmegaConf.merge(base, cfg)
    for role in WEIGHT_ROLES:
        bridge, dist = _megatron_key(role, "use_mbridge"), _megatron_key(role, "use_dist_checkpointing")
        on = {k: value(merged, k, False) is True for k in (bridge, dist)}
        if on[bridge] and on[dist]:
            raise ConfigError(f"{bridge} and {dist} are both true: verl then loads the converted checkpoint and mbridge"
                              " only builds the model. Pick one weight path with"
                              f" {key}: hf-to-mcore (set {bridge}=false) or mbridge (set {dist}=false)")
        if not weights.load:
            continue
        if weights.loader == "mbridge" and not on[bridge]:
            raise ConfigError(f"{key} is mbridge but {bridge} is false: verl would not read the HF weights through"
                              f" mbridge; set {bridge}=true and {dist}=false")
        if weights.loader == "hf-to-mcore" and on[bridge]:
            raise ConfigError(f"{key} is hf-to-mcore but {bridge} is true: verl would read the HF weights at"
                              " actor_rollout_ref.model.path through mbridge instead of the conversion; set"
                              f" {bridge}=false, or {key}=mbridge")
        if weights.loader == "hf-to-mcore" and not on[dist]:
            raise ConfigError(f"{key} is hf-to-mcore but {dist} is false: verl 0.6.1 reads the conversion only"
                              " through dist checkpointing, and would load actor_rollout_ref.model.path's HF"
                              f" weights with its own converter instead; set {dist}=true and"
                              f" {_megatron_key(role, 'dist_checkpointing_path')} to the torch_dist conversion")
    if weights.load and weights.loader == "mbridge" and weights.mcore_checkpoint is not None:
        raise ConfigError(f"{key} is mbridge, which reads actor_rollout_ref.model.path, but"
                          f" recipe.weights.mcore_checkpoint is set ({weights.mcore_checkpoint}) and nothing would"
                          " read it: set recipe.weights.mcore_checkpoint=null")


def settings_block(cfg: DictConfig, key: str, fields) -> dict | None:
    """The mapping at `key` (None when absent), refusing keys that are not fields of the dataclass `fields`
    (or not in the tuple of names `fields`):
    our blocks live under open prefixes, where a misspelt key would otherwise pass unnoticed."""
    block = value(cfg, key)
    if block is None:
        return None
    names = tuple(getattr(fields, "__dataclass_fields__", fields))  # a dataclass or the key names themselves
    known = ", ".join(names)
    if not isinstance(block, dict):
        raise ConfigError(f"{key} must be a mapping of {known}")
    unknown = sorted(set(block) - set(names))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]} is not a {key.rsplit('.', 1)[-1]} setting; known: {known}")
    return block


# Settings that only the A3 path can run, each with why a CPU cannot: config.load refuses them, naming the key,
# when launch.accelerator is cpu (cpu-tiny keeps every other A3 key; tests/recipes/test_profile_diff.py).
CPU_REFUSED = (
    ("actor_rollout_ref.actor.megatron.mindspeed.enable",
     "MindSpeed's kernels and patches are built for Ascend NPUs (torch_npu); on CPU Megatron-core runs its torch spec"),
    ("actor_rollout_ref.actor.megatron.swap_optimizer",
     "a MindSpeed feature (host <-> NPU swaps of the optimizer state); MindSpeed does not run on CPU"),
    ("recipe.rollout.torchair_graph", "TorchAir compiles vLLM-Ascend's decode into NPU graphs"),
    ("actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.torchair_graph_config.enabled",
     "TorchAir compiles vLLM-Ascend's decode into NPU graphs"),
    ("actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.torchair_graph_config.enable_kv_nz",
     "the NZ KV-cache layout is an Ascend format written by vLLM-Ascend's graph decode"),
    ("actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.dp_sync_on_device",
     "it moves vLLM's DP syncs onto HCCL, which needs NPUs (CPU ranks sync on gloo)"),
)


def accelerator_settings(cfg: DictConfig) -> None:
    """Refuse, on launch.accelerator cpu, every A3-only setting of CPU_REFUSED that is on, naming each key."""
    if value(cfg, "launch.accelerator") != "cpu":
        return
    on = [(key, why) for key, why in CPU_REFUSED if value(cfg, key) is True]
    if on:
        raise ConfigError("launch.accelerator is cpu, which cannot run " + "; ".join(
            f"{key}: true ({why})" for key, why in on) + ": set " + ", ".join(f"{key}=false" for key, _ in on))


def _flag(key: str, v) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key} must be true or false, got {v!r}")
    return v


# vLLM's EngineArgs.additional_config -> vLLM-Ascend, and two of its blocks
ADDITIONAL_CONFIG = "actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config"
TORCHAIR = "actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.torchair_graph_config"
ASCEND_SCHEDULER = "actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.ascend_scheduler_config"
DP_SYNC_ON_DEVICE = "actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.dp_sync_on_device"
MAX_NUM_SEQS = "actor_rollout_ref.rollout.max_num_seqs"
# engine_kwargs.vllm keys: verl's own (swap_space) and those the recipe sets. verl 0.6.1 passes each non-null one to
# vllm.LLM, where a typo would fail only on the cluster.
ENGINE_KWARGS_KEYS = ("swap_space", "enable_expert_parallel", "additional_config")
# vllm.LLM arguments verl 0.6.1's vLLMRollout passes from the rollout config itself: also in engine_kwargs, the
# engine stops with "multiple values for keyword argument" (vllm_rollout_spmd.py)
ROLLOUT_PASSES = {"max_num_seqs": MAX_NUM_SEQS}
# What vLLM-Ascend 0.11.0 reads from additional_config (vllm_ascend/ascend_config.py: AscendConfig.__init__, and
# "refresh" in init_ascend_config; kv_cache_dtype in platform.py and the model runner); dp_sync_on_device is our
# series' (third_party/patches/CHANGES.md (i)).
# tests/vllm_ascend/test_recipe_additional_config.py keeps these lists equal to the fork's source.
ASCEND_CONFIG_KEYS = ("torchair_graph_config", "ascend_scheduler_config", "weight_prefetch_config",
                      "expert_map_path", "eplb_policy_type", "expert_map_record_path", "init_redundancy_expert",
                      "dynamic_eplb", "num_iterations_eplb_update", "gate_eplb", "num_wait_worker_iterations",
                      "chunked_prefill_for_mla", "enable_shared_expert_dp", "multistream_overlap_shared_expert",
                      "recompute_scheduler_enable", "lmhead_tensor_parallel_size", "oproj_tensor_parallel_size",
                      "enable_cpu_binding", "kv_cache_dtype", "dp_sync_on_device", "refresh")
# Shared experts on a second stream (torchair_graph_config.enable_multistream_moe until vLLM-Ascend 0.10)
MULTISTREAM_SHARED = "actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.multistream_overlap_shared_expert"
# ascend_scheduler_config: "enabled" (AscendSchedulerConfig in ascend_config.py), then the init fields of
# vLLM-Ascend 0.11.0's vllm_ascend/core/schedule_config.py:AscendSchedulerConfig (vLLM 0.11.0's SchedulerConfig and
# its own), which it overrides.
ASCEND_SCHEDULER_KEYS = ("enabled", "runner_type", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
                         "max_num_partial_prefills", "max_long_partial_prefills", "long_prefill_token_threshold",
                         "num_lookahead_slots", "cuda_graph_sizes", "enable_chunked_prefill", "is_multimodal_model",
                         "send_delta_data", "policy", "disable_chunked_mm_input", "scheduler_cls",
                         "disable_hybrid_kv_cache_manager", "async_scheduling", "enable_pd_transfer",
                         "decode_max_num_seqs")


@dataclass(frozen=True)
class TorchairGraph:
    """additional_config.torchair_graph_config: vLLM-Ascend 0.11.0's TorchairGraphConfig keys, same defaults."""

    enabled: bool = False
    mode: str = ""  # TorchAir's compile mode; vLLM-Ascend's default when empty
    use_cached_graph: bool = False
    use_cached_kv_cache_bytes: bool = False
    graph_batch_sizes: tuple[int, ...] = ()  # decode batch sizes captured as graphs; () = [1, max_num_seqs]
    graph_batch_sizes_init: bool = False
    enable_multistream_mla: bool = False
    enable_view_optimize: bool = True
    enable_frozen_parameter: bool = True
    enable_kv_nz: bool = False
    enable_super_kernel: bool = False


# Keys TorchairGraphConfig accepts only together with another one (it raises otherwise, on the cluster).
TORCHAIR_NEEDS = {
    **{k: "enabled" for k in TorchairGraph.__dataclass_fields__
       if k not in ("enabled", "enable_view_optimize", "enable_frozen_parameter")},
    "use_cached_kv_cache_bytes": "use_cached_graph",  # which needs enabled in turn
}


@dataclass(frozen=True)
class AscendEngine:
    """What the recipe gives vLLM-Ascend through verl's engine_kwargs.vllm (absent = vLLM-Ascend's defaults)."""

    torchair: TorchairGraph = TorchairGraph()
    ascend_scheduler: bool = False
    dp_sync_on_device: bool = False
    multistream_shared_experts: bool = False  # additional_config.multistream_overlap_shared_expert


def torchair_settings(cfg: DictConfig) -> TorchairGraph:
    """torchair_graph_config, checked as vLLM-Ascend's TorchairGraphConfig checks it, plus the engine's limit:
    a graph batch size above max_num_seqs is silently dropped there (check_torchair_graph_batch_sizes)."""
    block = settings_block(cfg, TORCHAIR, TorchairGraph) or {}
    flags = {k: _flag(f"{TORCHAIR}.{k}", v) for k, v in block.items() if k not in ("graph_batch_sizes", "mode")}
    mode = block.get("mode", "")
    if not isinstance(mode, str):
        raise ConfigError(f"{TORCHAIR}.mode must be a string (TorchAir's compile mode, e.g. reduce-overhead) or"
                          f" left out, got {mode!r}")
    sizes = block.get("graph_batch_sizes", [])
    max_seqs = value(cfg, MAX_NUM_SEQS)
    if not isinstance(sizes, list) or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1
                                              for b in sizes):
        raise ConfigError(f"{TORCHAIR}.graph_batch_sizes must be a list of positive integers (decode batch sizes,"
                          f" e.g. [{max_seqs}]), got {sizes!r}")
    if isinstance(max_seqs, int) and any(b > max_seqs for b in sizes):
        raise ConfigError(f"{TORCHAIR}.graph_batch_sizes: {max(sizes)} exceeds {MAX_NUM_SEQS} = {max_seqs}, an"
                          " engine never decodes that many (vLLM-Ascend drops it); drop it or raise max_num_seqs")
    t = TorchairGraph(**{**flags, "mode": mode, "graph_batch_sizes": tuple(sizes)})
    if t.graph_batch_sizes_init and t.graph_batch_sizes:
        raise ConfigError(f"{TORCHAIR}.graph_batch_sizes_init derives the sizes and needs graph_batch_sizes"
                          " empty; set one of them")
    unmet = [k for k, need in TORCHAIR_NEEDS.items() if getattr(t, k) and not getattr(t, need)]
    if unmet:
        need = TORCHAIR_NEEDS[unmet[0]]
        fix = f"set {TORCHAIR}.{need}=true" + (" (in the A3 profiles: recipe.rollout.torchair_graph=true)"
                                                  if need == "enabled" else "")
        raise ConfigError(f"{TORCHAIR}.{unmet[0]} needs {need}, which is off (vLLM-Ascend refuses it at engine"
                          f" start): {fix}, or turn off {', '.join(f'{TORCHAIR}.{k}' for k in unmet)}")
    return t


def vllm_engine_settings(cfg: DictConfig) -> AscendEngine:
    """engine_kwargs.vllm and its additional_config, checked here so that a bad key or value stops the launch
    instead of a vLLM-Ascend engine on the cluster."""
    engine = settings_block(cfg, ENGINE_KWARGS, (*ENGINE_KWARGS_KEYS, *ROLLOUT_PASSES)) or {}
    for key, home in ROLLOUT_PASSES.items():
        if engine.get(key) is not None:
            raise ConfigError(f"{ENGINE_KWARGS}.{key}: verl 0.6.1 passes {home} to vLLM itself, and vLLM refuses"
                              f" the argument twice; remove {ENGINE_KWARGS}.{key} and set {home}")
    if settings_block(cfg, ADDITIONAL_CONFIG, ASCEND_CONFIG_KEYS) is None:
        return AscendEngine()
    t = torchair_settings(cfg)
    _check_graph_mode(cfg, t)
    on = _ascend_scheduler(cfg, t)
    dp_sync = _flag(DP_SYNC_ON_DEVICE, value(cfg, DP_SYNC_ON_DEVICE, False))
    return AscendEngine(t, on, dp_sync, _multistream_shared(cfg, t))


def _multistream_shared(cfg: DictConfig, t: TorchairGraph) -> bool:
    """multistream_overlap_shared_expert, and the super kernel that needs it at tensor parallel 1."""
    on = _flag(MULTISTREAM_SHARED, value(cfg, MULTISTREAM_SHARED, False))
    if t.enable_super_kernel and not on:
        raise ConfigError(f"{TORCHAIR}.enable_super_kernel needs {MULTISTREAM_SHARED}=true (vLLM-Ascend refuses it"
                          " at engine start); set it, or turn the super kernel off")
    tp = value(cfg, "actor_rollout_ref.rollout.tensor_model_parallel_size")
    if t.enable_super_kernel and tp != 1:
        raise ConfigError(f"{TORCHAIR}.enable_super_kernel needs actor_rollout_ref.rollout.tensor_model_parallel_size"
                          f"=1, got {tp} (vLLM-Ascend refuses it at engine start); turn the super kernel off")
    return on


def _check_graph_mode(cfg: DictConfig, t: TorchairGraph) -> None:
    """What graph mode needs outside torchair_graph_config: its switch, no eager."""
    switch = value(cfg, "recipe.rollout.torchair_graph")
    if switch is not None and switch != t.enabled:
        raise ConfigError(f"{TORCHAIR}.enabled = {t.enabled} but recipe.rollout.torchair_graph = {switch}: set"
                          f" recipe.rollout.torchair_graph (the profiles interpolate it into {TORCHAIR}.enabled)")
    if t.enabled and value(cfg, "actor_rollout_ref.rollout.enforce_eager") is True:
        raise ConfigError(f"{TORCHAIR}.enabled needs actor_rollout_ref.rollout.enforce_eager=false (vLLM-Ascend"
                          " refuses graph mode with eager mode)")


def _ascend_scheduler(cfg: DictConfig, t: TorchairGraph) -> bool:
    """ascend_scheduler_config.enabled, checked against enable_kv_nz: the graph decode path writes the cache as
    NZ, and a step that mixes prefill and decode reads it as ND (third_party/patches/CHANGES.md (h))."""
    scheduler = settings_block(cfg, ASCEND_SCHEDULER, ASCEND_SCHEDULER_KEYS) or {}
    on = _flag(f"{ASCEND_SCHEDULER}.enabled", scheduler.get("enabled", False))
    chunked = _flag(f"{ASCEND_SCHEDULER}.enable_chunked_prefill", scheduler.get("enable_chunked_prefill", False))
    if t.enable_kv_nz and (not on or chunked):
        raise ConfigError(f"{TORCHAIR}.enable_kv_nz needs prefill and decode in separate steps: set"
                          f" {ASCEND_SCHEDULER}.enabled=true and leave its enable_chunked_prefill off")
    return on


def verl_base(root: Path = ROOT, strategy: str = "megatron") -> DictConfig:
    """verl's own trainer config for an actor strategy (Megatron's by default): from our fork's tree, else from
    the installed verl."""
    if strategy not in VERL_CONFIGS:
        raise ConfigError(f"actor_rollout_ref.actor.strategy is {strategy!r}; use one of {', '.join(VERL_CONFIGS)}")
    rel = VERL_CONFIGS[strategy]
    trees = [root / "third_party" / "verl"]
    try:
        spec = importlib.util.find_spec("verl")
        if spec and spec.origin:
            trees.append(Path(spec.origin).parent.parent)
    except (ImportError, ValueError):
        pass
    candidates = [tree / rel for tree in trees]
    for path in candidates:
        if path.is_file():
            # verl >= 0.5 composes its trainer config from Hydra defaults; `_generated_<name>` is that composition
            # (upstream's CI keeps it equal), the keys and defaults main_ppo gets
            composed = path.with_name(f"_generated_{path.name}")
            return OmegaConf.load(composed if composed.is_file() else path)
    raise ConfigError(f"verl's {rel} not found (tried {', '.join(map(str, candidates))});"
                      " run `python -m tools.forks sync verl`")


def verl_base_for(cfg: DictConfig, root: Path = ROOT) -> DictConfig:
    """verl's trainer config for the strategy a recipe config names (megatron when it names none)."""
    return verl_base(root, str(OmegaConf.select(cfg, "actor_rollout_ref.actor.strategy", default="megatron")))


def leaf_values(data: dict, prefix: str = "") -> dict:
    """Dotted key -> value of every leaf of plain data (lists and empty mappings count as leaves)."""
    out = {}
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out.update(leaf_values(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def leaf_keys(node, prefix: str = "") -> list[str]:
    """Dotted keys of every leaf (lists count as leaves)."""
    if isinstance(node, DictConfig):
        keys = []
        for k in node.keys():
            child = node._get_node(k)
            sub = f"{prefix}{k}"
            keys += leaf_keys(child, sub + ".") if isinstance(child, DictConfig) and len(child) else [sub]
        return keys
    return [prefix.rstrip(".")]


def unknown_keys(cfg: DictConfig, base: DictConfig) -> list[str]:
    """Keys of the recipe that verl's config does not have (or, in override_transformer_config, that Megatron-core's
    TransformerConfig does not have), outside the blocks the launcher checks itself and the open maps."""
    out = []
    for key in leaf_keys(cfg):
        if key.startswith(EXTENSION_PREFIXES + OPEN_MAPS):
            continue
        if key.startswith(TRANSFORMER_OVERRIDES):
            if key.split(".")[4] not in transformer_config_fields():
                out.append(key)
        elif not has_key(base, key):
            out.append(key)
    return out


def nearest_key(key: str, base: DictConfig) -> str | None:
    """The known key closest to a misspelt one: a sibling in verl's config (or a TransformerConfig field)."""
    parent, _, name = key.rpartition(".")
    if key.startswith(TRANSFORMER_OVERRIDES):
        known = transformer_config_fields()
    else:
        node = OmegaConf.select(base, parent, default=None) if parent else base
        known = list(node.keys()) if isinstance(node, DictConfig) else []
    near = difflib.get_close_matches(name, known, n=1)
    return f"{parent}.{near[0]}" if near else None


def transformer_config_fields() -> frozenset[str]:
    """Fields of Megatron-core's MLATransformerConfig (a superset of TransformerConfig's: DeepSeek-V3 builds it)."""
    import dataclasses

    try:
        from megatron.core.transformer.transformer_config import MLATransformerConfig
    except ImportError as exc:
        raise ConfigError(f"megatron.core is not importable ({exc}): the keys of override_transformer_config cannot"
                          f" be checked; install the stack: {INSTALL}") from None
    return frozenset(f.name for f in dataclasses.fields(MLATransformerConfig))


def refuse_unknown_keys(cfg: DictConfig, base: DictConfig) -> None:
    """ConfigError naming the first unknown key and the nearest known one."""
    unknown = unknown_keys(cfg, base)
    if not unknown:
        return
    near = nearest_key(unknown[0], base)
    hint = f"did you mean {near}?" if near else "check the spelling"
    where = ("a field of Megatron-core's TransformerConfig" if unknown[0].startswith(TRANSFORMER_OVERRIDES)
             else "a key of verl's trainer config for this actor strategy")
    raise ConfigError(f"{unknown[0]} is not {where} ({len(unknown)} unknown: {', '.join(unknown[:5])}); {hint}")


def check_series(cfg: DictConfig, base: DictConfig) -> None:
    """Run our verl series' own check of its settings (the one the trainer runs at start) on the config verl
    will get; ConfigError naming the field of the first problem."""
    try:
        series_settings = importlib.import_module("verl.trainer.config.series_settings")
    except ImportError as exc:
        raise ConfigError(f"verl (our series) is not importable here ({exc}): the checks of verl's settings (on-policy"
                          " skip, batch divisions, reshard, rollout lifecycle, TensorCache limits, layer lists) could"
                          f" not run; install the stack: {INSTALL}") from None
    problems = series_settings.check(verl_config(cfg, base))
    if problems:
        more = f" (and {len(problems) - 1} more: {', '.join(p.field for p in problems[1:4])})" if len(problems) > 1 \
            else ""
        raise ConfigError(f"{problems[0].field}: {problems[0].message}{more}")


def has_key(base: DictConfig, key: str) -> bool:
    """Whether verl's config has the key: with a value, as a block (a recipe's empty `model_config: {}`), or as
    a mandatory value verl leaves to the user (`???`, e.g. verl 0.6's rollout.name)."""
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(base, parent, default=None) if parent else base
    return isinstance(node, DictConfig) and name in node.keys()  # `in node` is false for a `???` value


def missing_keys(cfg: DictConfig) -> list[str]:
    """Required settings left as `???` (the keys themselves, not the interpolations that point at them, e.g.
    cpu-tiny's dist_checkpointing_path: ${recipe.weights.mcore_checkpoint})."""
    return sorted(k for k in leaf_keys(cfg) if _node(cfg, k)._is_missing())


def _node(cfg: DictConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = node._get_node(part)
    return node


def value(cfg: DictConfig, key: str, default=None):
    """A resolved value, `default` when absent, `???` or an interpolation of a `???`."""
    try:
        if key in missing_keys(cfg):
            return default
        v = OmegaConf.select(cfg, key, default=default)
        if isinstance(v, DictConfig | ListConfig):
            return OmegaConf.to_container(v, resolve=True)
    except (MissingMandatoryValue, InterpolationToMissingValueError):
        return default
    return v


def resolved(cfg: DictConfig) -> dict:
    """The config as plain data, interpolations resolved; a `???`, or an interpolation of one, stays `???`."""
    cfg = copy.deepcopy(cfg)
    for key in leaf_keys(cfg):
        node = _node(cfg, key)
        if node._is_interpolation():
            try:
                OmegaConf.select(cfg, key)
            except (MissingMandatoryValue, InterpolationToMissingValueError):
                OmegaConf.update(cfg, key, "???", merge=False)
    return OmegaConf.to_container(cfg, resolve=True)


def verl_config(cfg: DictConfig, base: DictConfig) -> DictConfig:
    """What verl's trainer gets: its own defaults, our config over them, resolved; `launch` dropped."""
    container = resolved(OmegaConf.merge(base, cfg))
    container.pop("launch", None)
    reward = container.get("custom_reward_function") or {}
    if reward.get("path") and not Path(reward["path"]).is_absolute():
        # verl opens it from the trainer's working directory, which a Ray job does not set to ours
        reward["path"] = str(ROOT / reward["path"])
    return OmegaConf.create(container)


def model_dims(recipe: Recipe) -> tuple[dict, str]:
    """Architecture numbers: the HF config.json under model.path when there is one, else recipe.model_dims."""
    model_path = recipe.inputs.model_path
    if model_path:
        hf = Path(str(model_path)).expanduser() / "config.json"
        if hf.is_file():
            return json.loads(hf.read_text()), str(hf)
    rel = recipe.settings.model_dims
    if not rel:
        raise ConfigError("recipe.model_dims is not set and actor_rollout_ref.model.path holds no config.json:"
                          " set recipe.model_dims=../model/deepseek-v3.yaml (relative to the config)")
    path = (recipe.path.parent / str(rel)).resolve()
    if not path.is_file():
        raise ConfigError(f"recipe.model_dims: {path} not found")
    return OmegaConf.to_container(OmegaConf.load(path)), str(path)
