"""actor_rollout_ref.rollout.reshard: the A3 profiles take the directed TP-split path, verl's default
is the gather path, and config.load refuses bad values naming the field."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.launch.conftest import CONFIGS
from tools.launch import config

TINY = CONFIGS / "cpu-tiny.yaml"
KEY = "actor_rollout_ref.rollout.reshard"


@pytest.mark.parametrize("name", ["a3-128-true-weight", "a3-128-random-init"])
def test_a3_profiles_take_the_directed_path(name):
    cfg = config.load(CONFIGS / f"{name}.yaml").cfg
    assert config.reshard_settings(cfg) == config.Reshard(tp_pp="directed", experts="directed", fallback=False)


def test_verl_default_is_the_gather_path():
    base = config.verl_base()
    assert config.reshard_settings(base) == config.Reshard()
    assert config.value(base, f"{KEY}.tp_pp") == "gather"
    assert not config.unknown_keys(config.load(CONFIGS / "a3-128-true-weight.yaml").cfg, base)


def test_an_absent_block_means_gather():
    assert config.reshard_settings(OmegaConf.create({})) == config.Reshard()


@pytest.mark.parametrize("override, field", [
    ("tp_pp=alltoall", "tp_pp"),
    ("fallback=maybe", "fallback"),
    ("experts=alltoall", "experts"),
    ("expert=directed", "expert"),  # a misspelt key: refused, not ignored
])
def test_bad_values_are_refused_naming_the_field(override, field):
    with pytest.raises(config.ConfigError, match=rf"{KEY}\.{field}\b"):
        config.load(TINY, [f"{KEY}.{override}"])


def test_a_virtual_pipeline_needs_gather_or_fallback():
    vpp = "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"
    with pytest.raises(config.ConfigError, match=rf"{KEY}.tp_pp=directed has no plan with a virtual pipeline"):
        config.load(TINY, [f"{KEY}.tp_pp=directed", vpp])
    assert config.reshard_settings(config.load(TINY, [f"{KEY}.tp_pp=directed", f"{KEY}.fallback=true", vpp]).cfg) \
        == config.Reshard(tp_pp="directed", experts="directed", fallback=True)
    config.load(TINY, [f"{KEY}.tp_pp=gather", vpp])


def test_directed_experts_need_vllm_expert_parallelism():
    vllm = "actor_rollout_ref.rollout.name=vllm"
    off = "actor_rollout_ref.rollout.engine_kwargs.vllm.enable_expert_parallel=false"
    with pytest.raises(config.ConfigError, match=rf"{KEY}.experts=directed .*\.enable_expert_parallel=true"):
        config.load(TINY, [f"{KEY}.experts=directed", vllm, off])
    on = "actor_rollout_ref.rollout.engine_kwargs.vllm.enable_expert_parallel=true"
    assert config.reshard_settings(config.load(TINY, [f"{KEY}.experts=directed", on, vllm]).cfg).experts == "directed"


def test_the_hf_rollout_takes_directed_experts_without_vllm_settings():
    """cpu-tiny with --rollout hf: each HF engine holds every expert, so the directed plan needs no vLLM expert
    parallelism."""
    from tools.launch.smoke import ROLLOUTS

    no_ep = "actor_rollout_ref.rollout.engine_kwargs.vllm.enable_expert_parallel=false"
    cfg = config.load(TINY, [*ROLLOUTS["hf"], no_ep]).cfg
    assert config.value(cfg, "actor_rollout_ref.rollout.name") == "hf"
    assert config.reshard_settings(cfg) == config.Reshard(tp_pp="directed", experts="directed", fallback=False)
