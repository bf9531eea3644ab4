"""actor_rollout_ref.rollout.engine_kwargs.vllm (verl 0.6.1 passes it to vllm.LLM) and its additional_config
(read by vLLM-Ascend): the A3 profiles carry the TorchAir / ascend-scheduler / DP-sync settings, cpu-tiny none,
and config.load refuses what vLLM-Ascend would refuse on the cluster, naming the field and the fix."""

from __future__ import annotations

import pytest

from tests.launch.conftest import CONFIGS
from tools.launch import config

A3 = ["a3-128-true-weight", "a3-128-random-init"]
TINY = CONFIGS / "cpu-tiny.yaml"
ENGINE = "actor_rollout_ref.rollout.engine_kwargs.vllm"
EXTRA = f"{ENGINE}.additional_config"
GRAPH = f"{EXTRA}.torchair_graph_config"
SCHED = f"{EXTRA}.ascend_scheduler_config"


def load(name: str, *overrides: str):
    return config.load(CONFIGS / f"{name}.yaml", list(overrides)).cfg


def load_tiny_on_a3(*overrides: str):
    """cpu-tiny (no additional_config) planned for A3: vLLM-Ascend's rules apply, not the CPU refusals."""
    return config.load(TINY, ["launch.accelerator=a3", *overrides]).cfg


@pytest.mark.parametrize("name", A3)
def test_a3_profiles_pass_the_engine_checks_in_graph_mode(name):
    """The settings vLLM-Ascend reads are known keys with values it accepts; graph mode (the point of the A3
    profiles' additional_config) is on, with the scheduler that its NZ KV cache needs."""
    cfg = load(name)
    settings = config.vllm_engine_settings(cfg)
    assert settings.torchair.enabled and settings.torchair.enable_kv_nz and settings.ascend_scheduler
    assert config.unknown_keys(cfg, config.verl_base()) == []


@pytest.mark.parametrize("name", A3)
def test_the_profiles_derive_the_graph_settings_instead_of_repeating_them(name):
    """enabled follows recipe.rollout.torchair_graph; graph_batch_sizes follows rollout.max_num_seqs (which verl
    passes to the engine), also in the verl config the launcher writes."""
    cfg = load(name, "actor_rollout_ref.rollout.max_num_seqs=32")
    settings = config.vllm_engine_settings(cfg)
    assert settings.torchair.graph_batch_sizes == (32,)
    verl = config.verl_config(cfg, config.verl_base()).actor_rollout_ref.rollout.engine_kwargs.vllm
    assert "max_num_seqs" not in verl and list(verl.additional_config.torchair_graph_config.graph_batch_sizes) == [32]
    assert verl.additional_config.torchair_graph_config.enabled is True
    # the switch alone turns graph mode off; what needs graph mode is then refused, each key named
    with pytest.raises(config.ConfigError, match="recipe.rollout.torchair_graph=true") as err:
        load(name, "recipe.rollout.torchair_graph=false")
    for key in ("graph_batch_sizes", "enable_multistream_mla", "enable_kv_nz"):
        assert f"{GRAPH}.{key}" in str(err.value)


def test_cpu_tiny_gets_nothing_vllm_ascend_specific():
    cfg = config.load(TINY).cfg
    assert config.value(cfg, f"{ENGINE}.additional_config") is None
    assert config.value(cfg, f"{ENGINE}.max_num_seqs") is None
    assert config.vllm_engine_settings(cfg) == config.AscendEngine()


@pytest.mark.parametrize("override, field, known", [
    (f"{EXTRA}.torchair_graph_cfg.enabled=true", f"{EXTRA}.torchair_graph_cfg", "dp_sync_on_device"),
    (f"{EXTRA}.dp_sync_on_devices=true", f"{EXTRA}.dp_sync_on_devices", "torchair_graph_config"),
    # what vLLM-Ascend 0.9.1 read; 0.11.0 reads multistream_overlap_shared_expert beside torchair_graph_config
    (f"{GRAPH}.enable_multistream_moe=true", f"{GRAPH}.enable_multistream_moe", "enable_kv_nz"),
    (f"{SCHED}.enable=true", f"{SCHED}.enable", "enabled"),
    (f"{ENGINE}.max_num_seq=64", f"{ENGINE}.max_num_seq", "additional_config"),
])
@pytest.mark.parametrize("name", A3)
def test_unknown_keys_are_refused_with_the_known_ones(name, override, field, known):
    with pytest.raises(config.ConfigError, match=rf"{field}\b.*known: .*\b{known}\b"):
        load(name, override)


@pytest.mark.parametrize("sizes", ["[0]", "[65]", "[32,true]", "[1.5]", "64"])
def test_graph_batch_sizes_are_positive_ints_up_to_max_num_seqs(sizes):
    with pytest.raises(config.ConfigError, match=rf"{GRAPH}\.graph_batch_sizes"):
        load("a3-128-true-weight", f"{GRAPH}.graph_batch_sizes={sizes}")
    cfg = load("a3-128-true-weight", f"{GRAPH}.graph_batch_sizes=[8,16,64]")
    assert config.vllm_engine_settings(cfg).torchair.graph_batch_sizes == (8, 16, 64)


def test_kv_nz_needs_graph_mode():
    with pytest.raises(config.ConfigError, match=rf"{GRAPH}\.enable_kv_nz needs enabled.*{GRAPH}\.enabled=true"):
        load_tiny_on_a3(f"{GRAPH}.enable_kv_nz=true", f"{SCHED}.enabled=true")


@pytest.mark.parametrize("override", [f"{SCHED}.enabled=false", f"{SCHED}.enable_chunked_prefill=true"])
def test_kv_nz_needs_prefill_and_decode_apart(override):
    with pytest.raises(config.ConfigError, match=rf"{GRAPH}\.enable_kv_nz needs prefill and decode in separate"):
        load("a3-128-true-weight", override)
    load("a3-128-true-weight", override, f"{GRAPH}.enable_kv_nz=false")


@pytest.mark.parametrize("overrides, match", [
    ([f"{GRAPH}.enable_super_kernel=true", f"{EXTRA}.multistream_overlap_shared_expert=false"],
     rf"{GRAPH}\.enable_super_kernel needs {EXTRA}\.multistream_overlap_shared_expert=true"),
    ([f"{GRAPH}.enable_super_kernel=true"], rf"{GRAPH}\.enable_super_kernel needs .*tensor_model_parallel_size=1"),
    ([f"{GRAPH}.mode=1"], rf"{GRAPH}\.mode must be a string"),
    ([f"{GRAPH}.use_cached_kv_cache_bytes=true"], rf"{GRAPH}\.use_cached_kv_cache_bytes needs use_cached_graph"),
    ([f"{GRAPH}.graph_batch_sizes_init=true"], rf"{GRAPH}\.graph_batch_sizes_init .*graph_batch_sizes empty"),
    ([f"{GRAPH}.enable_view_optimize=maybe"], rf"{GRAPH}\.enable_view_optimize must be true or false"),
    ([f"{EXTRA}.dp_sync_on_device=1"], rf"{EXTRA}\.dp_sync_on_device must be true or false"),
    ([f"{SCHED}.enabled=2"], rf"{SCHED}\.enabled must be true or false"),
    (["actor_rollout_ref.rollout.enforce_eager=true"], rf"{GRAPH}\.enabled needs .*enforce_eager=false"),
    ([f"{GRAPH}.enabled=false"], rf"{GRAPH}\.graph_batch_sizes needs enabled"),
    # verl 0.6.1 passes rollout.max_num_seqs to vllm.LLM itself: a second one stops the engine
    ([f"{ENGINE}.max_num_seqs=64"], rf"{ENGINE}\.max_num_seqs: verl 0.6.1 passes .*rollout\.max_num_seqs.*remove"),
])
def test_combinations_vllm_ascend_refuses_stop_here(overrides, match):
    with pytest.raises(config.ConfigError, match=match):
        load("a3-128-random-init", *overrides)


def test_the_graph_switch_and_its_key_cannot_disagree():
    with pytest.raises(config.ConfigError, match=rf"{GRAPH}\.enabled = True but recipe.rollout.torchair_graph"):
        load_tiny_on_a3(f"{GRAPH}.enabled=true")  # cpu-tiny: torchair_graph false
