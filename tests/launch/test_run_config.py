"""config.load checks every value by its type, fixed set and range (tools/launch/rules.py) and builds the typed run
config once; a bad setting is refused through the real command line naming the full key, never as a traceback."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from omegaconf import OmegaConf

from tests import stack
from tests.launch.conftest import CONFIGS
from tools.launch import cli, config, layout, rules, run
from tools.launch.fields import KEY
from tools.perf import reference_runs

ROOT = Path(__file__).resolve().parents[2]
A3 = CONFIGS / "a3-128-true-weight.yaml"
PROFILES = ("a3-128-true-weight", "a3-128-random-init", "cpu-tiny", "cpu-tiny-fsdp")

# (override, the key the refusal names, a fragment of what it says): the settings the dry run once let through
# (kl_loss_coef=abc, temperature=-1, grpoo), answered with a ZeroDivisionError (nnodes=0) or named wrongly
BAD = [
    ("actor_rollout_ref.actor.kl_loss_coef=abc", "actor_rollout_ref.actor.kl_loss_coef", "must be a number"),
    ("actor_rollout_ref.rollout.temperature=-1", "actor_rollout_ref.rollout.temperature", "must be >= 0"),
    ("algorithm.adv_estimator=grpoo", "algorithm.adv_estimator", "did you mean grpo?"),
    ("trainer.nnodes=0", "trainer.nnodes", "must be >= 1"),
    ("data.max_prompt_length=abc", "data.max_prompt_length", "must be an integer"),
    ("actor_rollout_ref.rollout.top_p=0", "actor_rollout_ref.rollout.top_p", "must be > 0 and <= 1"),
    ("actor_rollout_ref.actor.use_kl_loss=maybe", "actor_rollout_ref.actor.use_kl_loss", "must be true or false"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1.5",
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "must be an integer"),
    ("trainer.n_gpus_per_node=null", "trainer.n_gpus_per_node", "is null"),
    ("launch.nodes=0", "launch.nodes", "must be >= 1"),
    ("launch.accelerator=tpu", "launch.accelerator", "not one of a3, h200, cpu"),
    ("recipe.rollout.instances=0", "recipe.rollout.instances", "must be >= 1"),
    ("actor_rollout_ref.actor.megatron.num_layer_list=abc", "actor_rollout_ref.actor.megatron.num_layer_list",
     "expected integers"),
    ("actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=blocks",
     "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method", "did you mean block?"),
]


def dry_run(*args: str, tmp_path) -> int:
    return cli.main([*args, "--dry-run", "--run-id", "t", "--logs", str(tmp_path / "logs")])


@pytest.mark.parametrize("override,key,says", BAD, ids=[b[0] for b in BAD])
def test_a_bad_setting_is_refused_naming_its_key_and_the_fix(override, key, says, tmp_path, capsys):
    rc = dry_run(str(A3), override, tmp_path=tmp_path)
    out = capsys.readouterr()
    assert rc in (run.EXIT_CHECK, run.EXIT_ERROR), out.out[-2000:]
    assert f"error: {A3}: {key}" in out.err and says in out.err, out.err
    assert f"set {key}" in out.err or "did you mean" in out.err, out.err  # the fix
    assert "Traceback" not in out.out + out.err and "preflight" not in out.out


def test_the_refusal_reaches_the_shell_without_a_traceback():
    """The real process: exit 2 and one error line, where trainer.nnodes=0 once ended in a ZeroDivisionError."""
    proc = subprocess.run([sys.executable, "-m", "tools.launch", str(A3), "trainer.nnodes=0", "--dry-run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == run.EXIT_ERROR, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {A3}: trainer.nnodes is 0: it must be >= 1 (verl's trainer: its resource pool has n_gpus_per_node"
        " x nnodes ranks); set trainer.nnodes=${launch.nodes}"]


def test_the_advantage_estimators_are_verls_enum():
    ray_trainer = stack.require("verl.trainer.ppo.ray_trainer")  # verl 0.4.0's home of the enum
    allowed = rules.RULES["algorithm.adv_estimator"].allowed()
    assert set(allowed) == {e.value for e in ray_trainer.AdvantageEstimator} and "grpo" in allowed


def test_the_checker_takes_the_declared_config_as_input():
    """verl 0.4.0 declares its config as YAML defaults, verl 0.6 as dataclasses (types): both are inputs."""
    declared = OmegaConf.create({"algo": {"coef": 0.1, "flag": False, "name": "x", "steps": None}})
    values = {"algo.coef": "abc", "algo.flag": "yes?", "algo.name": "y", "algo.steps": "many"}
    assert [p.field for p in rules.check(values, declared, rules={})] == ["algo.coef", "algo.flag"]
    found = rules.check(values, declared, types={"algo.steps": int}, rules={})
    assert [p.field for p in found] == ["algo.coef", "algo.flag", "algo.steps"]
    assert "algo.coef must be a number (verl's declared default is 0.1), got 'abc': set algo.coef=0.1" == \
        found[0].message
    ranged = {"algo.coef": rules.Rule("the test", low=0, high=1)}
    assert [p.message for p in rules.check({"algo.coef": 2}, declared, rules=ranged)] == [
        "algo.coef is 2: it must be >= 0 and <= 1 (the test); set algo.coef=0.1"]


def test_every_rule_is_of_a_key_a_recipe_can_set():
    """A rule of a key nobody can set never fires: each is verl's, a TransformerConfig field's, or ours."""
    base = config.verl_base()
    ours = {**config.schema_types(config.LaunchSettings, "launch."),
            **config.schema_types(config.RecipeSettings, "recipe.")}
    fields = config.transformer_config_fields()
    for key in rules.RULES:
        if key.startswith(config.TRANSFORMER_OVERRIDES):
            assert key.rsplit(".", 1)[-1] in fields, key
        else:
            assert key in ours or config.has_key(base, key), key


def test_every_field_names_a_key_a_recipe_can_set():
    base = config.verl_base()
    ours = {**config.schema_types(config.LaunchSettings, "launch."),
            **config.schema_types(config.RecipeSettings, "recipe.")}
    fields = config.transformer_config_fields()
    for name, key in KEY.items():
        if key.startswith(config.TRANSFORMER_OVERRIDES):
            assert key.rsplit(".", 1)[-1] in fields, name
        else:
            assert key in ours or config.has_key(base, key), (name, key)
    flat = {f.name for f in dataclasses.fields(layout.Layout)} - {"train", "ref", "checkpoints"}
    assert flat <= set(KEY), flat - set(KEY)  # every field of the layout is read through the map


@pytest.mark.parametrize("name", PROFILES)
def test_the_profiles_load_typed(name):
    recipe = config.load(CONFIGS / f"{name}.yaml")
    lay = recipe.layout
    assert (lay.nodes, lay.devices_per_node, lay.accelerator) == (recipe.launch.nodes,
                                                                   recipe.launch.devices_per_node,
                                                                   recipe.launch.accelerator)
    assert lay.train.tp == config.value(recipe.cfg, KEY["train.tp"], 1)
    assert lay.rollout_dp == recipe.settings.rollout.data_parallel_size
    assert recipe.rollout.lifecycle == config.value(recipe.cfg, KEY["rollout.lifecycle"], "sleep")
    assert set(recipe.inputs.missing) == set(config.missing_keys(recipe.cfg))


def test_a_dry_run_builds_the_layout_once_and_once_more_per_what_if(tmp_path, capsys):
    reference_runs.fit()  # the step-time model's fit loads its reference profile once per process (cached)
    with mock.patch.object(layout, "from_config", wraps=layout.from_config) as built:
        assert dry_run(str(A3), tmp_path=tmp_path) == run.EXIT_OK
        assert built.call_count == 1
        built.reset_mock()
        assert dry_run(str(A3), "--what-if", "actor_rollout_ref.tensor_cache.enable=false", tmp_path=tmp_path) == \
            run.EXIT_OK
        assert built.call_count == 2
    assert "what-if actor_rollout_ref.tensor_cache.enable=false" in capsys.readouterr().out


def test_a_bad_what_if_is_refused_naming_its_key(tmp_path, capsys):
    rc = dry_run(str(A3), "--what-if", "actor_rollout_ref.rollout.temperature=-1", tmp_path=tmp_path)
    assert rc == run.EXIT_ERROR
    assert "actor_rollout_ref.rollout.temperature is -1" in capsys.readouterr().err


@pytest.mark.parametrize("composed", [True, False])
def test_verls_config_is_the_composed_one_where_verl_composes_it(tmp_path, composed):
    """verl >= 0.5 builds its trainer config from Hydra defaults, so the flat file lacks most keys; the launcher
    checks and merges against `_generated_<name>`, the composition upstream keeps in step, where verl has one."""
    configs = tmp_path / "third_party/verl/verl/trainer/config"
    configs.mkdir(parents=True)
    (configs / "ppo_megatron_trainer.yaml").write_text("defaults:\n  - actor@actor_rollout_ref.actor: megatron_actor\n")
    if composed:
        composition = "actor_rollout_ref:\n  actor:\n    ppo_epochs: 1\n"
        (configs / "_generated_ppo_megatron_trainer.yaml").write_text(composition)
    base = config.verl_base(tmp_path)
    assert (OmegaConf.select(base, "actor_rollout_ref.actor.ppo_epochs") == 1) is composed
    assert ("defaults" in base) is not composed


def test_a_key_verl_leaves_mandatory_is_a_key():
    """verl 0.6 declares rollout.name as `???` (the user must set it): the recipe's value is for a known key."""
    base = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "???", "engine_kwargs": {}}}})
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "engine_kwargs": {}, "nme": "hf"}}})
    assert config.unknown_keys(cfg, base) == ["actor_rollout_ref.rollout.nme"]
