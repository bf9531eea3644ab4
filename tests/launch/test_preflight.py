"""Preflight arithmetic: both A3 profiles pass; each broken variant fails with the field it names."""

from __future__ import annotations

import dataclasses
import json

import pytest
from omegaconf import OmegaConf

from tests.launch.conftest import CONFIGS, LEGACY_LAYOUT, write_dist_manifest, write_manifest
from tools.launch import config, inputs, preflight
from tools.model.dims import dims_from_config
from tools.perf import memory

# key prefixes that keep the override tables short (the launcher itself names full keys: tools/launch/fields.py)
A, AM = "actor_rollout_ref.actor.", "actor_rollout_ref.actor.megatron."
RM, R = "actor_rollout_ref.ref.megatron.", "actor_rollout_ref.rollout."


def checks_for(name: str, *overrides: str, device_gb: float = 64.0) -> list[preflight.Check]:
    recipe = config.load(CONFIGS / f"{name}.yaml", list(overrides))
    dims = dims_from_config(config.model_dims(recipe)[0])
    checks, _ = preflight.run(recipe.layout, dims, device_gb)
    return checks


@pytest.mark.parametrize("name,rollout", [("a3-128-true-weight", "64 x TP2 x 2 = 256 vs 256"),
                                           ("a3-128-random-init", "128 x TP2 x 1 = 256 vs 256")])
def test_a3_profiles_pass(name, rollout):
    checks = checks_for(name)
    assert [c.message() for c in checks if not c.ok] == []
    table = preflight.render(checks)
    assert table.splitlines()[0].split() == ["check", "value", "rule", "ok"]
    assert "256 % (4 x 8)" in table
    assert rollout in table


BROKEN = [
    # (overrides, field named in the failure, a fragment of the numbers shown)
    ([AM + "pipeline_model_parallel_size=6", AM + "num_layer_list=[10,10,10,10,11,10]"],
     AM + "pipeline_model_parallel_size", "256 % (4 x 6)"),
    ([AM + "tensor_model_parallel_size=3"], AM + "tensor_model_parallel_size", "128 % 3"),
    ([AM + "expert_model_parallel_size=16", AM + "tensor_model_parallel_size=32", AM + "pipeline_model_parallel_size=1",
      AM + "num_layer_list=[61]"], AM + "expert_model_parallel_size", "256 % 512"),
    ([AM + "expert_model_parallel_size=16"], AM + "expert_model_parallel_size", "DP*TP = 32 % (EP*ETP = 64)"),
    ([AM + "expert_tensor_parallel_size=4"], AM + "expert_tensor_parallel_size", "etp=4"),
    ([AM + "num_layer_list=[8,8,8,8,8,8,8,8]"], AM + "num_layer_list", "sum = 64 vs 61"),
    ([AM + "override_transformer_config.recompute_num_layers=9"],
     AM + "override_transformer_config.recompute_num_layers", "9 vs largest stage 8"),
    (["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=8"],
     "actor_rollout_ref.ref.megatron.tensor_model_parallel_size", "ref TP8"),
    (["recipe.rollout.data_parallel_size=32"], "recipe.rollout.data_parallel_size", "32 x TP2 x 2 = 128"),
    ([R + "tensor_model_parallel_size=3"], R + "tensor_model_parallel_size", "128 % 3"),
    (["recipe.rollout.expert_parallel_size=64"], "recipe.rollout.expert_parallel_size", "64 vs DP*TP = 128"),
    (["recipe.rollout.data_parallel_size=48", "recipe.rollout.instances=1", R + "tensor_model_parallel_size=2",
      "recipe.rollout.expert_parallel_size=96"], "recipe.rollout.expert_parallel_size", "256 % 96"),
    (["recipe.rollout.data_parallel_size=8", "recipe.rollout.instances=16", "recipe.rollout.expert_parallel_size=16"],
     "recipe.rollout.expert_parallel_size", "16 % (EP*TP = 32)"),
    (["data.max_response_length=200000"], "data.max_response_length", "vs 163840"),
    ([R + "enable_chunked_prefill=false", R + "max_num_batched_tokens=1024"], R + "max_num_batched_tokens",
     "chunked_prefill=False"),
    ([R + "max_num_seqs=32"], R + "max_num_seqs", "32 vs 8192 / 128 engines = 64"),
    ([R + "gpu_memory_utilization=1.2"], R + "gpu_memory_utilization", "1.2"),
    (["data.train_batch_size=500", A + "ppo_mini_batch_size=500"], "data.train_batch_size", "8000 % 128 engines"),
    ([R + "n=1"], R + "n", "n=1"),
    (["algorithm.use_kl_in_reward=true"], "algorithm.use_kl_in_reward", "use_kl_in_reward=True"),
    (["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=7"],
     "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "1024 per DP rank % 7"),
    (["trainer.nnodes=8"], "trainer.nnodes", "8 vs launch.nodes 16"),
    ([AM + "swap_optimizer=false", AM + "override_transformer_config.recompute_granularity=selective"],
     AM + "pipeline_model_parallel_size", "GB (stage"),
    ([AM + "swap_optimizer=false"], R + "gpu_memory_utilization", "GB resident"),
    ([R + "gpu_memory_utilization=0.99"], R + "gpu_memory_utilization", "GB resident"),
    ([R + "gpu_memory_utilization=0.5"], R + "gpu_memory_utilization", "needs 18.4 GB"),
    (["recipe.checkpoints.dir=null"], "recipe.checkpoints.dir", "save_freq=15, dir=null"),
    (["trainer.max_actor_ckpt_to_keep=null"], "trainer.max_actor_ckpt_to_keep", "keep=null"),
]


@pytest.mark.parametrize("overrides,field,fragment", BROKEN, ids=[b[1].split(".")[-1] + f"-{i}"
                                                                  for i, b in enumerate(BROKEN)])
def test_broken_variant_fails_naming_the_field(overrides, field, fragment):
    failed = [c for c in checks_for("a3-128-true-weight", *overrides) if not c.ok]
    assert failed, f"{overrides} passed preflight"
    named = [c for c in failed if c.field == field]
    assert named, f"{overrides}: failures name {[c.field for c in failed]}, not {field}"
    assert any(fragment in c.value for c in named), [c.value for c in named]
    assert named[0].message().startswith(field + ":")


def test_recompute_layers_are_bounded_by_the_largest_stage_without_a_layer_list():
    """64 layers over PP8 without a layer list: 8 per stage, so block recompute of 9 layers cannot run."""
    recipe = config.load(CONFIGS / "a3-128-true-weight.yaml", [AM + "num_layer_list=null"])
    dims = dataclasses.replace(dims_from_config(config.model_dims(recipe)[0]), layers=64)
    lay = recipe.layout

    def recompute(num_layers: int) -> preflight.Check:
        checks = preflight.megatron_checks(dataclasses.replace(lay, recompute_num_layers=num_layers), dims)
        return next(c for c in checks if c.field == AM + "override_transformer_config.recompute_num_layers")

    assert recompute(8).ok
    too_many = recompute(9)
    assert not too_many.ok, too_many.value
    assert too_many.value == "9 vs largest stage 8"


def test_memory_estimate_of_the_true_weight_profile():
    recipe = config.load(CONFIGS / "a3-128-true-weight.yaml")
    dims = dims_from_config(config.model_dims(recipe)[0])
    assert dims.total_params() / 1e9 == pytest.approx(671.0, abs=0.1)  # DeepSeek-V3 without MTP
    est = memory.estimate(recipe.layout, dims, 64.0)
    assert est.update["actor params (bf16)"] == pytest.approx(6.59, abs=0.01)  # a stage of 8 MoE layers
    assert est.vllm["kv cache needed"] == pytest.approx(64 * 4096 * 61 * 576 * 2 / 1e9)
    no_recompute = memory.estimate(config.load(CONFIGS / "a3-128-random-init.yaml").layout, dims, 64.0)
    assert no_recompute.update["activations (1F1B in flight)"] > 10 * est.update["activations (1F1B in flight)"]


def test_model_dims_come_from_config_json_when_the_model_has_one(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**_dsv3(), "num_hidden_layers": 60}))
    failed = [c for c in checks_for("a3-128-true-weight", f"actor_rollout_ref.model.path={tmp_path}") if not c.ok]
    assert [c.field for c in failed] == [AM + "num_layer_list"]  # 61-layer list, 60-layer model


def _dsv3() -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(CONFIGS.parent / "model" / "deepseek-v3.yaml"))


def _lay(*overrides):
    return config.load(CONFIGS / "a3-128-true-weight.yaml", list(overrides)).layout


def test_weights_check_wants_a_finished_conversion_of_this_layout(tmp_path):
    lay = _lay()
    missing = inputs.weights_check(tmp_path / "nothing", lay)
    assert not missing.ok and "not converted" in missing.fix and "--moe-tp-extend-ep" in missing.fix
    good = inputs.weights_check(write_manifest(tmp_path / "good", LEGACY_LAYOUT), lay)
    assert good.ok, good.fix
    other = write_manifest(tmp_path / "other", {**LEGACY_LAYOUT, "ep": 16})
    bad = inputs.weights_check(other, lay)
    assert not bad.ok and "ep is 16, the config needs 8" in bad.fix
    unfinished = inputs.weights_check(write_manifest(tmp_path / "half", LEGACY_LAYOUT, finished=False), lay)
    assert not unfinished.ok and "--resume" in unfinished.fix


def test_a_dist_checkpointing_config_takes_a_torch_dist_conversion_of_any_layout(tmp_path):
    """torch_dist is resharded at load (verl's use_dist_checkpointing): no layout to match, but legacy rank files
    cannot be read that way, and an unfinished conversion is refused."""
    lay = _lay()
    dist = write_dist_manifest(tmp_path / "dist")
    assert inputs.weights_check(dist, lay, dist=True).ok
    legacy = inputs.weights_check(write_manifest(tmp_path / "legacy", LEGACY_LAYOUT), lay, dist=True)
    assert not legacy.ok and "torch_dist" in legacy.fix and "format='legacy'" in legacy.fix
    assert "--format legacy" not in legacy.fix  # the fix is a torch_dist conversion
    half = inputs.weights_check(write_dist_manifest(tmp_path / "half", finished=False), lay, dist=True)
    assert not half.ok and "metadata.json" in half.fix
    assert not inputs.weights_check(dist, lay).ok, "without use_dist_checkpointing verl needs the legacy layout"


def test_cpu_tiny_checks_its_torch_dist_checkpoint_and_that_verl_loads_it(tmp_path):
    dist = write_dist_manifest(tmp_path / "dist")
    recipe = config.load(CONFIGS / "cpu-tiny.yaml", [f"recipe.weights.mcore_checkpoint={dist}"])
    weights = [c for c in inputs.input_checks(recipe) if c.field.startswith(("recipe.weights", AM, RM))]
    assert [(c.field, c.ok) for c in weights] == [("recipe.weights.mcore_checkpoint", True)]
    other = config.load(CONFIGS / "cpu-tiny.yaml", [f"recipe.weights.mcore_checkpoint={dist}",
                                                    f"{RM}dist_checkpointing_path={tmp_path / 'elsewhere'}"])
    failed = [c for c in inputs.input_checks(other) if not c.ok and c.name != "required setting"]
    assert [c.field for c in failed] == [RM + "dist_checkpointing_path"]
    random = config.load(CONFIGS / "cpu-tiny.yaml", ["recipe.weights.load=false",
                                                     "recipe.weights.mcore_checkpoint=null"])
    assert not [c for c in inputs.input_checks(random) if c.field.startswith("recipe.weights")]


def test_required_paths_are_named_with_how_to_set_them(tmp_path):
    recipe = config.load(CONFIGS / "a3-128-true-weight.yaml")
    failed = [c for c in inputs.input_checks(recipe) if not c.ok]
    assert {c.field for c in failed} == {"actor_rollout_ref.model.path", "data.train_files", "data.val_files",
                                         "recipe.weights.mcore_checkpoint", "recipe.checkpoints.dir"}
    assert any("tools.weights hf-to-mcore" in c.fix for c in failed)


def test_unknown_verl_key_is_refused():
    overrides = [R + "gpu_mem_utilization=0.5", AM + "anything_the_forks_add=1"]
    cfg = OmegaConf.merge(OmegaConf.load(CONFIGS / "a3-128-true-weight.yaml"), OmegaConf.from_dotlist(overrides))
    assert sorted(config.unknown_keys(cfg, config.verl_base())) == [AM + "anything_the_forks_add",
                                                                     R + "gpu_mem_utilization"]
    with pytest.raises(config.ConfigError, match=r"anything_the_forks_add is not a key of verl's trainer config"):
        config.load(CONFIGS / "a3-128-true-weight.yaml", overrides)


def test_bad_override_and_missing_launch_block_are_named(tmp_path):
    with pytest.raises(config.ConfigError, match="not key=value"):
        config.load(CONFIGS / "cpu-tiny.yaml", ["data.train_batch_size"])
    bare = tmp_path / "bare.yaml"
    bare.write_text("data: {train_batch_size: 8}\n")
    with pytest.raises(config.ConfigError, match="launch.nodes is not set"):
        config.load(bare)
