"""Every rule has one home: each broken override is refused by the dry run (run.prepare, what --dry-run runs) and,
where it is a verl setting, by our verl series' own validator (the one the trainer runs at start), both naming the
same field; recipe.* and the Megatron blocks refuse unknown keys, naming the nearest known one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from omegaconf import OmegaConf
from verl.trainer.config import series_settings  # the launcher needs it: no skip

from tests.launch.conftest import CONFIGS
from tools.launch import config, env, run

ROOT = Path(__file__).resolve().parents[2]

A3 = CONFIGS / "a3-128-true-weight.yaml"
A, AM, R = "actor_rollout_ref.actor.", "actor_rollout_ref.actor.megatron.", "actor_rollout_ref.rollout."
FACTS = env.NodeFacts("10.0.0.1", "enp189s0f0", "10.0.0.1", True, "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2")


def dry_run(path: Path, *overrides: str) -> run.Prepared:
    recipe = config.load(path, list(overrides))
    return run.prepare(recipe, FACTS, "one-home", Path("/runs"), device_gb=64.0)


def series_fields(path: Path, *overrides: str) -> list[str]:
    """Fields the series validator names, on the config verl would get (its defaults merged in); the config as
    written, not through config.load, which refuses some of these settings itself (their types, unknown keys)."""
    cfg = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))
    problems = series_settings.check(config.verl_config(cfg, config.verl_base_for(cfg)))
    return [f for p in problems for f in p.fields]


# (config, overrides, the field both name): one per rule moved from the launcher into the verl series
MOVED = [
    (A3, [A + "entropy_coeff=0.01"], A + "entropy_coeff"),  # the on-policy skip (preflight lacked it)
    (A3, [A + "ppo_epochs=2"], A + "ppo_epochs"),
    (A3, [A + "ppo_mini_batch_size=256"], A + "ppo_mini_batch_size"),
    (A3, ["algorithm.use_kl_in_reward=true", A + "use_kl_loss=false"], "algorithm.use_kl_in_reward"),
    (A3, [A + "ppo_micro_batch_size_per_gpu=3"], A + "ppo_micro_batch_size"),  # batch divisions
    (A3, ["data.train_batch_size=511", A + "ppo_mini_batch_size=511", R + "n=15"], "data.train_batch_size"),
    (A3, [R + "reshard.tp_pp=alltoall"], R + "reshard.tp_pp"),  # reshard keys
    (A3, [R + "reshard.expert=directed"], R + "reshard.expert"),
    (A3, [AM + "virtual_pipeline_model_parallel_size=2"], R + "reshard.tp_pp"),
    (A3, [R + "engine_kwargs.vllm.enable_expert_parallel=false"], R + "reshard.experts"),
    (A3, [R + "lifecycle=asleep"], R + "lifecycle"),  # the rollout lifecycle
    (A3, ["trainer.balance_batch=true"], "trainer.balance_batch"),  # TensorCache limits (the A3 profiles use it)
    (A3, [AM + "num_layer_list=[8,8,8,8,8,8,13]"], AM + "num_layer_list"),  # layer list length
    (A3, [AM + "optimizer_offload=true"], AM + "swap_optimizer"),  # one optimizer placement
    (A3, [R + "data_parallel_size=many"], R + "data_parallel_size"),  # a declared type
    (A3, [R + "rebalance.check_every=0"], R + "rebalance.check_every"),  # the live rollout rebalance
    (A3, [R + "name=hf", R + "engine_kwargs.vllm.enable_expert_parallel=false"], R + "rebalance.enable"),
]


@pytest.mark.parametrize("path,overrides,field", MOVED, ids=[m[2].rsplit(".", 1)[-1] for m in MOVED])
def test_dry_run_and_series_validator_name_the_same_field(path, overrides, field):
    assert field in series_fields(path, *overrides)
    with pytest.raises(config.ConfigError, match=field.replace(".", r"\.")):
        dry_run(path, *overrides)


def test_the_a3_profiles_pass_the_series_validator():
    for name in ("a3-128-true-weight", "a3-128-random-init", "cpu-tiny", "cpu-tiny-fsdp"):
        assert series_fields(CONFIGS / f"{name}.yaml") == [], name


@pytest.mark.parametrize("override,named,nearest", [
    ("recipe.rollout.bogus=1", "recipe.rollout.bogus", None),
    ("recipe.rollout.torchair_grph=true", "recipe.rollout.torchair_grph", "torchair_graph"),
    ("recipe.weight.load=true", "recipe.weight", "weights"),
])
def test_unknown_recipe_keys_are_refused_naming_the_nearest(override, named, nearest):
    with pytest.raises(config.ConfigError, match=named.replace(".", r"\.")) as err:
        config.load(A3, [override])
    assert "known under" in str(err.value)
    if nearest:
        assert f"did you mean {nearest}?" in str(err.value)


def test_recipe_values_are_typed():
    with pytest.raises(config.ConfigError, match=r"recipe\.rollout\.instances"):
        config.load(A3, ["recipe.rollout.instances=two"])


@pytest.mark.parametrize("override,named,nearest", [
    (AM + "pipeline_num_layer_list_typo=1", AM + "pipeline_num_layer_list_typo", AM + "num_layer_list"),
    (AM + "swap_optimiser=true", AM + "swap_optimiser", AM + "swap_optimizer"),
    ("actor_rollout_ref.ref.megatron.moe_tp_extend=true", "actor_rollout_ref.ref.megatron.moe_tp_extend",
     "actor_rollout_ref.ref.megatron.moe_tp_extend_ep"),
    (AM + "override_transformer_config.recompute_num_layer=8", AM + "override_transformer_config.recompute_num_layer",
     AM + "override_transformer_config.recompute_num_layers"),
])
def test_misspelt_megatron_keys_are_refused_naming_the_nearest(override, named, nearest):
    with pytest.raises(config.ConfigError, match=named.replace(".", r"\.") + " is not") as err:
        dry_run(A3, override)
    assert f"did you mean {nearest}?" in str(err.value)


def test_mindspeed_args_stay_open():
    """MindSpeed-LLM's argument names are known only to an installed MindSpeed-LLM (not installable here)."""
    cfg = config.load(A3, [AM + "mindspeed.args.any_mindspeed_llm_argument=1"]).cfg
    assert config.unknown_keys(cfg, config.verl_base_for(cfg)) == []


def test_recompute_beyond_the_largest_stage_fails_the_dry_run(tmp_path):
    """9 block-recompute layers at 64 layers / PP8 without a layer list: 8 layers per stage."""
    dims = OmegaConf.to_container(OmegaConf.load(CONFIGS.parent / "model" / "deepseek-v3.yaml"))
    (tmp_path / "config.json").write_text(json.dumps({**dims, "num_hidden_layers": 64}))
    key = AM + "override_transformer_config.recompute_num_layers"
    p = dry_run(A3, f"actor_rollout_ref.model.path={tmp_path}", AM + "num_layer_list=null", f"{key}=9")
    assert [c.field for c in p.checks if not c.ok] == [key]
    assert "9 vs largest stage 8" in run.report(p, dry_run=True)
    assert dry_run(A3, f"actor_rollout_ref.model.path={tmp_path}", AM + "num_layer_list=null", f"{key}=8").ok


def test_without_verl_the_dry_run_says_which_checks_did_not_run():
    with mock.patch.dict("sys.modules", {"verl.trainer.config.series_settings": None}):
        with pytest.raises(config.ConfigError, match=r"verl .* not importable.*on-policy.*nox -s install"):
            dry_run(A3)


@pytest.mark.parametrize("overrides", [
    [AM + "virtual_pipeline_model_parallel_size=2", R + "reshard.fallback=true"],  # directed falls back to gather
    [AM + "virtual_pipeline_model_parallel_size=2", R + "reshard.tp_pp=gather"],
    # HF engines hold every expert, and the live rebalance moves vLLM requests only
    [R + "name=hf", R + "engine_kwargs.vllm.enable_expert_parallel=false", R + "rebalance.enable=false"],
])
def test_reshard_settings_the_series_accepts(overrides):
    assert series_fields(A3, *overrides) == []


RECORD_RAY_IMPORT = """
import os, sys
class Recorder:  # notes RAY_AUTH_MODE at the moment `ray` is first imported (Ray reads it then, once)
    def find_spec(self, name, path=None, target=None):
        if name == "ray" and "mode" not in seen:
            seen["mode"] = os.environ.get("RAY_AUTH_MODE")
        return None
seen = {}
sys.meta_path.insert(0, Recorder())
from tools.launch import cli
rc = cli.main([sys.argv[1], "--dry-run", "actor_rollout_ref.model.path=/nonexistent"])
print("ray imported with", seen.get("mode"), "rc", rc)
"""


def test_the_launcher_holds_the_runs_ray_auth_mode_before_the_series_check_imports_ray(tmp_path):
    """A machine with ~/.ray/auth_token: `ray start` turns token auth on, so this process must be a token client.
    Ray fixes its mode when first imported, and the series check imports it (through verl) before the launch."""
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("secret")
    environ = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"} | {"HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", RECORD_RAY_IMPORT, str(CONFIGS / "cpu-tiny.yaml")], cwd=ROOT,
                          env=environ, capture_output=True, text=True, timeout=600)
    assert "ray imported with token" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
