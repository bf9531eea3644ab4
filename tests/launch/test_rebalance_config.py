"""recipe.rollout.rebalance: the profiles carry it off by default, and config.load refuses bad values
with an error that names the field."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tests.launch.conftest import CONFIGS
from tools.launch import config

TINY = CONFIGS / "cpu-tiny-fsdp.yaml"  # no rebalance block and 2 HF engines (cpu-tiny has one per rank: DP 1)
KEY = "recipe.rollout.rebalance"
SEQS = "actor_rollout_ref.rollout.max_num_seqs=4"


@pytest.mark.parametrize("name", ["a3-128-true-weight", "a3-128-random-init"])  # cpu-tiny's HF rollout has no engines
def test_profiles_carry_the_block_switched_off(name):
    cfg = config.load(CONFIGS / f"{name}.yaml").cfg
    settings = config.rebalance_settings(cfg)
    assert settings.enable is False, "off until measured on hardware"
    assert settings.kv_transfer in config.KV_TRANSFER_MODES and 0 < settings.kv_usage_cap <= 1
    assert settings.buckets[-1] == config.value(cfg, "actor_rollout_ref.rollout.max_num_seqs")
    assert list(settings.buckets) == sorted(set(settings.buckets)) and settings.check_interval >= 1


def test_enabled_settings_are_read():
    cfg = config.load(TINY, [f"{KEY}.enable=true", f"{KEY}.check_interval=8", f"{KEY}.kv_transfer=reprefill",
                             f"{KEY}.kv_usage_cap=0.8", f"{KEY}.buckets=[2,4]"]).cfg
    assert config.rebalance_settings(cfg) == config.Rebalance(True, 8, (2, 4), 0.8, "reprefill")


def test_an_absent_block_means_off():
    cfg = OmegaConf.create({"recipe": {"rollout": {"data_parallel_size": 4}}})
    assert config.rebalance_settings(cfg) == config.Rebalance()
    assert config.Rebalance().enable is False


@pytest.mark.parametrize("override, field", [
    ("enable=maybe", "enable"),
    ("check_interval=0", "check_interval"),
    ("check_interval=2.5", "check_interval"),
    ("buckets=[4,2]", "buckets"),
    ("buckets=[0,2]", "buckets"),
    ("kv_usage_cap=1.5", "kv_usage_cap"),
    ("kv_usage_cap=0", "kv_usage_cap"),
    ("kv_transfer=rdma", "kv_transfer"),
    ("check_intervall=8", "check_intervall"),  # a misspelt key
])
def test_bad_values_are_refused_naming_the_field(override, field):
    with pytest.raises(config.ConfigError, match=rf"{KEY}\.{field}\b"):
        config.load(TINY, [f"{KEY}.{override}"])


def test_enabled_buckets_must_fit_max_num_seqs():
    with pytest.raises(config.ConfigError, match=rf"{KEY}\.buckets: 8 exceeds actor_rollout_ref.rollout.max_num_seqs"):
        config.load(TINY, [f"{KEY}.enable=true", f"{KEY}.buckets=[1,2,8]", SEQS])
    config.load(TINY, [f"{KEY}.buckets=[1,2,8]", SEQS])  # off: it blocks nothing


def test_enabling_needs_more_than_one_engine():
    with pytest.raises(config.ConfigError, match="data_parallel_size is 1"):
        config.load(TINY, [f"{KEY}.enable=true", "recipe.rollout.data_parallel_size=1"])
    config.load(TINY, [f"{KEY}.enable=false", "recipe.rollout.data_parallel_size=1"])  # off: no objection
