"""The rules of a recipe config's values, declared once: types from verl's declared config, fixed sets, ranges.

`check(values, declared)` is pure: `values` maps each dotted key of a recipe config to its resolved value,
`declared` is verl's declared trainer config (a mapping of keys to defaults: verl 0.4.0's trainer YAML; from verl
0.6 on, its config dataclasses rendered with the YAML) and, optionally, `types` gives a key's declared Python type
where the declaration has one (0.6's dataclass fields). It returns one Problem per bad value, each naming the full
dotted key, what is wrong and the fix. config.load runs it before it builds the typed run config, so no bad value
reaches the arithmetic (or verl) as a traceback.

A key's type is RULES' `kind` when it has one, else its declared type, else the kind of its default: a bool default
takes a bool, a number default a number (verl's YAML writes top_p's default as 1), a string default a string (or a
list: verl takes data files either way), a list default a list. A key whose default is null has no type unless RULES
gives it one. Ranges and fixed sets are the ones verl or the engines enforce (at start, on the cluster): each rule
names its source. Keys our verl series adds are the series' own business (series_settings, run by
config.check_series); they still get their declared type here.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

VLLM = "vLLM's SamplingParams"


@dataclass(frozen=True)
class Problem:
    field: str  # the full dotted key to change
    message: str  # what is wrong and the fix, naming the field


@dataclass(frozen=True)
class Rule:
    """What a key's value must be, beyond its declared type; `source` says who enforces it."""

    source: str
    kind: type | None = None  # int, float, bool, str: the type when the declaration has none (or a wrong one)
    low: float | None = None  # value >= low (> low when low_open)
    high: float | None = None  # value <= high
    low_open: bool = False
    choices: Callable[[], tuple[str, ...]] | tuple[str, ...] | None = None  # the allowed values
    nullable: bool = False  # null allowed (verl's "not set")
    example: Any = None  # a good value, for the fix

    def allowed(self) -> tuple[str, ...] | None:
        return self.choices() if callable(self.choices) else self.choices


def verl_enum(name: str, modules: tuple[str, ...]) -> Callable[[], tuple[str, ...]]:
    """The values of one of verl's string enums, read from the source of the first module that declares it (verl
    moved AdvantageEstimator from ray_trainer to core_algos after 0.4). Read, not imported: importing ray_trainer
    costs the dry run seconds (torch, Ray, the datasets), and the declaration is all the check needs."""

    def values() -> tuple[str, ...]:
        top = importlib.util.find_spec(modules[0].split(".")[0])  # the package, found without importing it
        root = Path(top.origin).parent if top and top.origin else None
        for module in modules:
            source = root / Path(*module.split(".")[1:]).with_suffix(".py") if root else None
            if source is None or not source.is_file():
                continue
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.ClassDef) and node.name == name:
                    return tuple(stmt.value.value for stmt in node.body if isinstance(stmt, ast.Assign)
                                 and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str))
        raise LookupError(f"verl's {name} not found in {', '.join(modules)}: sync and install verl")

    return values


def count(source: str, nullable: bool = False, example: int = 1) -> Rule:
    return Rule(source, kind=int, low=1, nullable=nullable, example=example)


ARR = "actor_rollout_ref"
MEGATRON_COUNTS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")
TRAINER = "verl's trainer"
MEGATRON = "Megatron-core's parallel_state (initialize_model_parallel)"
# Key -> its rule; every rule of a value lives here (the launcher's arithmetic assumes them, verl or an engine
# enforces them later).
RULES: dict[str, Rule] = {
    # the cluster (launch:) and the recipe's rollout layout (recipe:)
    "launch.nodes": count("the world: nodes x devices_per_node ranks", example=16),
    "launch.devices_per_node": count("the world: nodes x devices_per_node ranks", example=16),
    "launch.accelerator": Rule("the accelerators tools/launch/layout.py knows (device memory, Ray resource)",
                               choices=lambda: tuple(importlib.import_module("tools.launch.layout").RAY_RESOURCE)),
    "launch.ray.port": Rule("a TCP port", kind=int, low=1, high=65535, example=6379),
    "launch.ray.dashboard_port": Rule("a TCP port", kind=int, low=1, high=65535, example=8265),
    "launch.ray.join_timeout_s": Rule("seconds the head waits for the nodes", kind=float, low=0, low_open=True,
                                      example=600),
    "recipe.rollout.data_parallel_size": count("vLLM's data_parallel_size"),
    "recipe.rollout.instances": count("rollout instances over the world"),
    "recipe.rollout.expert_parallel_size": count("vLLM's expert parallelism inside an instance"),
    "recipe.checkpoints.write_gb_per_s": Rule("a bandwidth (preflight's time estimate)", kind=float, low=0,
                                              low_open=True, example=5.0),
    "recipe.checkpoints.step_s": Rule("a step time (preflight's estimate)", kind=float, low=0, low_open=True,
                                      nullable=True, example=300),
    "recipe.timing.prompt_tokens": Rule("a mean length", kind=float, low=0, example=77.8),
    "recipe.timing.response_tokens": Rule("a mean length", kind=float, low=0, example=1576.6),
    # verl's trainer and data
    "trainer.nnodes": Rule(f"{TRAINER}: its resource pool has n_gpus_per_node x nnodes ranks", kind=int, low=1,
                           example="${launch.nodes}"),
    "trainer.n_gpus_per_node": Rule(f"{TRAINER}: its resource pool has n_gpus_per_node x nnodes ranks", kind=int,
                                    low=1, example="${launch.devices_per_node}"),
    "trainer.max_actor_ckpt_to_keep": count(f"{TRAINER}'s checkpoint manager", nullable=True, example=2),
    "data.train_batch_size": count(f"{TRAINER}: prompts per step", example=512),
    "data.max_prompt_length": count("verl's RLHFDataset", example=1024),
    "data.max_response_length": count(f"verl's rollout and {VLLM}: max_tokens must be at least 1", example=2048),
    "algorithm.adv_estimator": Rule(
        "verl's AdvantageEstimator: compute_advantage raises NotImplementedError on any other",
        choices=verl_enum("AdvantageEstimator", ("verl.trainer.ppo.core_algos", "verl.trainer.ppo.ray_trainer"))),
    "algorithm.kl_ctrl.type": Rule("verl's get_kl_controller in core_algos.py", choices=("fixed", "adaptive")),
    # the actor and the ref
    f"{ARR}.actor.ppo_mini_batch_size": count("verl's actor: prompts per update", example=512),
    f"{ARR}.actor.ppo_micro_batch_size_per_gpu": count("verl's actor: sequences per forward", nullable=True),
    f"{ARR}.actor.ppo_epochs": count("verl's actor: passes over a step's batch"),
    f"{ARR}.actor.loss_agg_mode": Rule("verl's agg_loss in core_algos.py raises ValueError on any other",
                                       choices=("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                                "seq-mean-token-sum-norm")),
    f"{ARR}.ref.log_prob_micro_batch_size_per_gpu": count("verl's ref: sequences per forward", nullable=True),
    **{f"{ARR}.{role}.megatron.{k}": count(MEGATRON) for role in ("actor", "ref") for k in MEGATRON_COUNTS},
    **{f"{ARR}.{role}.megatron.expert_tensor_parallel_size": count(MEGATRON, nullable=True)
       for role in ("actor", "ref")},
    f"{ARR}.actor.megatron.override_transformer_config.recompute_granularity": Rule(
        "Megatron-core's TransformerConfig", choices=("full", "selective"), nullable=True),
    f"{ARR}.actor.megatron.override_transformer_config.recompute_method": Rule(
        "Megatron-core's TransformerConfig", choices=("uniform", "block"), nullable=True),
    f"{ARR}.actor.megatron.override_transformer_config.recompute_num_layers": count(
        "Megatron-core's TransformerConfig", nullable=True),
    # the rollout (vLLM)
    f"{ARR}.rollout.name": Rule("the rollout engines verl's workers build", choices=("vllm", "sglang", "hf")),
    f"{ARR}.rollout.mode": Rule("verl's rollout modes", choices=("sync", "async")),
    f"{ARR}.rollout.tensor_model_parallel_size": count("vLLM's tensor parallelism"),
    f"{ARR}.rollout.n": count(f"{VLLM}: n must be at least 1", example=16),
    f"{ARR}.rollout.temperature": Rule(f"{VLLM}: temperature must be non-negative", kind=float, low=0, example=1.0),
    f"{ARR}.rollout.top_p": Rule(f"{VLLM}: top_p must be in (0, 1]", kind=float, low=0, low_open=True, high=1,
                                 example=1.0),
    f"{ARR}.rollout.top_k": Rule(f"{VLLM}: -1 or 0 turns it off", kind=int, low=-1, example=-1),
    f"{ARR}.rollout.val_kwargs.n": count(f"{VLLM}: n must be at least 1"),
    f"{ARR}.rollout.val_kwargs.temperature": Rule(f"{VLLM}: temperature must be non-negative", kind=float, low=0,
                                                  example=1.0),
    f"{ARR}.rollout.val_kwargs.top_p": Rule(f"{VLLM}: top_p must be in (0, 1]", kind=float, low=0, low_open=True,
                                            high=1, example=1.0),
    f"{ARR}.rollout.val_kwargs.top_k": Rule(f"{VLLM}: -1 or 0 turns it off", kind=int, low=-1, example=-1),
    f"{ARR}.rollout.max_num_seqs": count("vLLM's scheduler: sequences per engine step", example=256),
    f"{ARR}.rollout.max_num_batched_tokens": count("vLLM's scheduler: tokens per engine step", example=8192),
    f"{ARR}.rollout.max_model_len": count("vLLM's model config", nullable=True),
    f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu": count("verl's rollout: sequences per forward",
                                                              nullable=True),
}

KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
              dict: "a mapping"}
NONE_DEFAULTS = (None, "None", "null", "???")  # verl's YAML writes some nulls as None (a string to YAML)


def declared_default(declared: DictConfig, key: str):
    """The declared default of a key: `missing` when the declaration has no such key, None when it has no value
    (null, ???, or an interpolation that does not resolve on its own)."""
    try:
        node = OmegaConf.select(declared, key, default=_MISSING, throw_on_missing=False)
    except Exception:  # noqa: BLE001 - an interpolation into another block of the declaration: untyped
        return None
    if node is _MISSING:
        return _MISSING
    if isinstance(node, DictConfig):
        return {}
    if isinstance(node, ListConfig):
        return []
    return None if node in NONE_DEFAULTS else node


_MISSING = object()


def kind_of(default) -> type | None:
    if isinstance(default, bool):
        return bool
    if isinstance(default, int | float):
        return float  # a number: verl's YAML does not tell an int default from a float one (top_p: 1)
    for t in (str, list, dict):
        if isinstance(default, t):
            return t
    return None


def _fits(v, kind: type) -> bool:
    if kind is bool:
        return isinstance(v, bool)
    if kind is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if kind is float:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    if kind is str:
        return isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
    return isinstance(v, kind)


def _example(rule: Rule | None, default, kind: type) -> str:
    if rule is not None and rule.example is not None:
        return str(rule.example)
    if kind in (bool, int, float, str) and default is not None and default is not _MISSING and _fits(default, kind):
        return str(default).lower() if kind is bool else str(default)
    return {bool: "true", int: "1", float: "1.0", str: "<text>", list: "[...]", dict: "{...}"}[kind]


def check(values: Mapping[str, Any], declared: DictConfig, types: Mapping[str, type] | None = None,
          rules: Mapping[str, Rule] = RULES) -> list[Problem]:
    """One Problem per value of `values` (dotted key -> resolved value) that breaks its type, its fixed set or its
    range, in key order."""
    types = types or {}
    found = []
    for key, v in values.items():
        rule = rules.get(key)
        default = declared_default(declared, key)
        kind = (rule.kind if rule and rule.kind else None) or types.get(key) or kind_of(default)
        if rule is not None and rule.choices is not None and kind is None:
            kind = str
        problem = _value_problem(key, v, rule, default, kind)
        if problem:
            found.append(Problem(key, problem))
    return found


def _value_problem(key: str, v, rule: Rule | None, default, kind: type | None) -> str | None:
    if v is None:
        nullable = rule.nullable if rule is not None else kind is None or kind in (str, list, dict)
        if nullable:
            return None
        return (f"{key} is null, but it needs {KIND_NAMES[kind]} ({_why(rule, default)}): set"
                f" {key}={_example(rule, default, kind)}")
    if kind is not None and not _fits(v, kind):
        return (f"{key} must be {KIND_NAMES[kind]} ({_why(rule, default)}), got {v!r}: set"
                f" {key}={_example(rule, default, kind)}")
    if rule is None:
        return None
    allowed = rule.allowed()
    if allowed is not None and v not in allowed:
        near = difflib.get_close_matches(str(v), allowed, n=1)
        fix = f"did you mean {near[0]}? set {key}={near[0]}" if near else f"set {key} to one of them"
        return f"{key} is {v!r}, not one of {', '.join(allowed)} ({rule.source}): {fix}"
    too_low = rule.low is not None and (v <= rule.low if rule.low_open else v < rule.low)
    if too_low or (rule.high is not None and v > rule.high):
        return f"{key} is {v}: it must be {_bounds(rule)} ({rule.source}); set {key}={_example(rule, default, kind)}"
    return None


def _why(rule: Rule | None, default) -> str:
    if rule is not None and rule.kind is not None:
        return rule.source
    return f"verl's declared default is {default!r}"


def _bounds(rule: Rule) -> str:
    low = f"> {rule.low:g}" if rule.low_open else f">= {rule.low:g}"
    return low if rule.high is None else f"{low} and <= {rule.high:g}"
