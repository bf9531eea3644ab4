"""Recipe configs: load with overrides, check keys against verl's own config, build the verl config.

A recipe config is a verl config (keys of verl's ppo_megatron_trainer.yaml) plus `launch:` (read here
only) and `recipe:` (our forks' settings). Keys verl does not have are refused, except where our fork
series adds settings: under the Megatron blocks and under `recipe:`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

ROOT = Path(__file__).resolve().parents[2]
VERL_CONFIG = "verl/trainer/config/ppo_megatron_trainer.yaml"
# Where a key may be new to verl: blocks our forks read (MindSpeed features, recompute, recipe settings).
EXTENSION_PREFIXES = ("launch.", "recipe.", "actor_rollout_ref.actor.megatron.", "actor_rollout_ref.ref.megatron.")
REBALANCE = "recipe.rollout.rebalance"
KV_TRANSFER_MODES = ("ship", "reprefill")  # verl/workers/rollout/rebalance/migrate.py (our verl series)
RESHARD = "actor_rollout_ref.rollout.reshard"  # verl/utils/reshard/weight_sync.py (our verl series)
RESHARD_MODES = ("directed", "gather")
REQUIRED_LAUNCH = ("launch.nodes", "launch.devices_per_node", "launch.accelerator", "launch.env_profile",
                   "launch.ray.port", "launch.ray.dashboard_port")


class ConfigError(Exception):
    """A config that cannot be used; the message names the field and the fix."""


@dataclass(frozen=True)
class Recipe:
    """A loaded config: the file it came from (relative paths in it are relative to it) and its content."""

    path: Path
    cfg: DictConfig
    overrides: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.path.stem


def load(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """The config file with `key=value` overrides merged on top (OmegaConf dotlist syntax)."""
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
        rebalance_settings(cfg)
        reshard_settings(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return Recipe(path.resolve(), cfg, tuple(overrides))


def settings_block(cfg: DictConfig, key: str, fields) -> dict | None:
    """The mapping at `key` (None when absent), refusing keys that are not fields of the dataclass `fields`:
    our blocks live under open prefixes, where a misspelt key would otherwise pass unnoticed."""
    block = value(cfg, key)
    if block is None:
        return None
    known = ", ".join(fields.__dataclass_fields__)
    if not isinstance(block, dict):
        raise ConfigError(f"{key} must be a mapping of {known}")
    unknown = sorted(set(block) - set(fields.__dataclass_fields__))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]} is not a {key.rsplit('.', 1)[-1]} setting; known: {known}")
    return block


@dataclass(frozen=True)
class Rebalance:
    """recipe.rollout.rebalance: move live sequences between vLLM DP engines (our verl series, rebalance/)."""

    enable: bool = False
    check_interval: int = 64  # engine steps between load checks
    buckets: tuple[int, ...] = ()  # captured-graph batch sizes, increasing; () = powers of 2 up to max_num_seqs
    kv_usage_cap: float = 0.9  # engines above this KV usage receive nothing; receivers stay under it
    kv_transfer: str = "ship"  # ship: copy the moved sequences' KV blocks; reprefill: recompute them


def rebalance_settings(cfg: DictConfig) -> Rebalance:
    """The rebalance block, checked: every key known, every value in range. Absent = off. recipe.* is open
    to our forks' settings, so a misspelt key here would otherwise pass unnoticed."""
    block = settings_block(cfg, REBALANCE, Rebalance)
    if block is None:
        return Rebalance()
    r = Rebalance()
    enable, interval = block.get("enable", r.enable), block.get("check_interval", r.check_interval)
    buckets, cap = block.get("buckets", list(r.buckets)), block.get("kv_usage_cap", r.kv_usage_cap)
    mode = block.get("kv_transfer", r.kv_transfer)
    if not isinstance(enable, bool):
        raise ConfigError(f"{REBALANCE}.enable must be true or false, got {enable!r}")
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ConfigError(f"{REBALANCE}.check_interval must be an integer >= 1 (engine steps), got {interval!r}")
    if not isinstance(buckets, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in buckets) \
            or any(b < 1 for b in buckets) or any(a >= b for a, b in zip(buckets, buckets[1:], strict=False)):
        raise ConfigError(f"{REBALANCE}.buckets must be strictly increasing positive integers (graph batch"
                          f" sizes, e.g. [1, 2, 4, 8, 16, 32, 64]) or [] for powers of 2, got {buckets!r}")
    max_seqs = value(cfg, "actor_rollout_ref.rollout.max_num_seqs")
    if enable and buckets and isinstance(max_seqs, int) and buckets[-1] > max_seqs:  # off: no run to stop
        raise ConfigError(f"{REBALANCE}.buckets: {buckets[-1]} exceeds actor_rollout_ref.rollout.max_num_seqs"
                          f" = {max_seqs}, an engine never runs that many; drop it or raise max_num_seqs")
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not 0 < cap <= 1:
        raise ConfigError(f"{REBALANCE}.kv_usage_cap must be a fraction in (0, 1], got {cap!r}")
    if mode not in KV_TRANSFER_MODES:
        raise ConfigError(f"{REBALANCE}.kv_transfer must be one of {', '.join(KV_TRANSFER_MODES)}, got {mode!r}")
    dp = value(cfg, "recipe.rollout.data_parallel_size", 1)
    if enable and isinstance(dp, int) and dp < 2:
        raise ConfigError(f"{REBALANCE}.enable is true but recipe.rollout.data_parallel_size is {dp}: rebalancing"
                          " moves sequences between DP engines and needs at least 2")
    return Rebalance(enable, interval, tuple(buckets), float(cap), mode)


@dataclass(frozen=True)
class Reshard:
    """actor_rollout_ref.rollout.reshard: the train -> rollout weight-sync path (verl's yaml: gather)."""

    tp_pp: str = "gather"  # directed: per layer slot, gather in TP, one all_to_all over PP
    fallback: bool = False  # no directed plan for the layout: gather (true) or stop (false)


def reshard_settings(cfg: DictConfig) -> Reshard:
    """The reshard block, checked as the worker will check it, plus the layout limit it checks only at
    start-up (no directed plan with a virtual pipeline), so that a run stops here rather than on the cluster."""
    block = settings_block(cfg, RESHARD, Reshard)
    if block is None:
        return Reshard()
    r = Reshard(**block)
    if r.tp_pp not in RESHARD_MODES:
        raise ConfigError(f"{RESHARD}.tp_pp must be one of {', '.join(RESHARD_MODES)}, got {r.tp_pp!r}")
    if not isinstance(r.fallback, bool):
        raise ConfigError(f"{RESHARD}.fallback must be true or false, got {r.fallback!r}")
    vpp = value(cfg, "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size")
    if r.tp_pp == "directed" and not r.fallback and isinstance(vpp, int) and vpp > 1:
        raise ConfigError(f"{RESHARD}.tp_pp=directed has no plan with a virtual pipeline"
                          f" (actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size = {vpp}):"
                          f" set {RESHARD}.tp_pp=gather or {RESHARD}.fallback=true")
    return r


def verl_base(root: Path = ROOT) -> DictConfig:
    """verl's own Megatron trainer config: from our fork's tree, else from the installed verl."""
    candidates = [root / "third_party" / "verl" / VERL_CONFIG]
    try:
        import importlib.util

        spec = importlib.util.find_spec("verl")
        if spec and spec.origin:
            candidates.append(Path(spec.origin).parent.parent / VERL_CONFIG)
    except (ImportError, ValueError):
        pass
    for path in candidates:
        if path.is_file():
            return OmegaConf.load(path)
    raise ConfigError(f"verl's {VERL_CONFIG} not found (tried {', '.join(map(str, candidates))});"
                      " run `python -m tools.forks sync verl`")


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
    """Keys of the recipe that verl's config does not have, outside the blocks our forks extend."""
    out = []
    for key in leaf_keys(cfg):
        if key.startswith(EXTENSION_PREFIXES):
            continue
        if OmegaConf.select(base, key, default="<absent>") == "<absent>" and not _is_dict_in(base, key):
            out.append(key)
    return out


def _is_dict_in(base: DictConfig, key: str) -> bool:
    """An empty dict in the recipe (e.g. `model_config: {}`) is fine where verl has that block."""
    parent, _, _ = key.rpartition(".")
    node = OmegaConf.select(base, key, default=None) if parent else None
    return isinstance(node, DictConfig)


def missing_keys(cfg: DictConfig) -> list[str]:
    """Required settings left as `???`."""
    return sorted(OmegaConf.missing_keys(cfg))


def value(cfg: DictConfig, key: str, default=None):
    """A resolved value, `default` when absent or `???`."""
    if key in OmegaConf.missing_keys(cfg):
        return default
    v = OmegaConf.select(cfg, key, default=default)
    if isinstance(v, DictConfig | ListConfig):
        return OmegaConf.to_container(v, resolve=True)
    return v


def verl_config(cfg: DictConfig, base: DictConfig) -> DictConfig:
    """What verl's trainer gets: its own defaults, our config over them, resolved; `launch` dropped."""
    merged = OmegaConf.merge(base, cfg)
    container = OmegaConf.to_container(merged, resolve=True)
    container.pop("launch", None)
    reward = container.get("custom_reward_function") or {}
    if reward.get("path") and not Path(reward["path"]).is_absolute():
        # verl opens it from the trainer's working directory, which a Ray job does not set to ours
        reward["path"] = str(ROOT / reward["path"])
    return OmegaConf.create(container)


def model_dims(recipe: Recipe) -> tuple[dict, str]:
    """Architecture numbers: the HF config.json under model.path when there is one, else recipe.model_dims."""
    cfg = recipe.cfg
    model_path = value(cfg, "actor_rollout_ref.model.path")
    if model_path:
        hf = Path(str(model_path)).expanduser() / "config.json"
        if hf.is_file():
            return json.loads(hf.read_text()), str(hf)
    rel = value(cfg, "recipe.model_dims")
    if not rel:
        raise ConfigError("recipe.model_dims is not set and actor_rollout_ref.model.path holds no config.json:"
                          " set recipe.model_dims=../model/deepseek-v3.yaml (relative to the config)")
    path = (recipe.path.parent / str(rel)).resolve()
    if not path.is_file():
        raise ConfigError(f"recipe.model_dims: {path} not found")
    return OmegaConf.to_container(OmegaConf.load(path)), str(path)
