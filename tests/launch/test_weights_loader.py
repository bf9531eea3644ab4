"""recipe.weights.loader picks the weight path (config.WEIGHT_LOADERS): hf-to-mcore's conversion or mbridge reading
the HF model at start-up. A config whose verl switches (megatron.use_mbridge, use_dist_checkpointing) say otherwise
is refused by the dry run, naming the field and the fix; with mbridge the conversion is neither required nor
checked."""

from __future__ import annotations

import pytest

from tests.launch.conftest import CONFIGS, write_dist_manifest
from tools.launch import cli, config, inputs, run

TINY = CONFIGS / "cpu-tiny.yaml"
A3 = CONFIGS / "a3-128-true-weight.yaml"
AM, RM = "actor_rollout_ref.actor.megatron.", "actor_rollout_ref.ref.megatron."
# cpu-tiny switched to mbridge: verl's switches for both roles (the ref's use_mbridge follows the actor's)
NO_DIST = [AM + "use_dist_checkpointing=false", RM + "use_dist_checkpointing=false"]
MBRIDGE = ["recipe.weights.loader=mbridge", AM + "use_mbridge=true", *NO_DIST, "recipe.weights.mcore_checkpoint=null"]


def dry_run(path, *overrides: str, tmp_path) -> int:
    return cli.main([str(path), *overrides, "--dry-run", "--run-id", "t", "--logs", str(tmp_path / "logs")])


@pytest.mark.parametrize("name", ["a3-128-true-weight", "a3-128-random-init", "cpu-tiny", "cpu-tiny-fsdp"])
def test_the_profiles_keep_the_conversion(name):
    assert config.load(CONFIGS / f"{name}.yaml").settings.weights.loader == "hf-to-mcore"


def test_mbridge_with_dist_checkpointing_is_refused_naming_both_and_the_fix(tmp_path, capsys):
    rc = dry_run(TINY, AM + "use_mbridge=true", tmp_path=tmp_path)  # cpu-tiny loads its torch_dist conversion
    err = capsys.readouterr().err
    assert rc == run.EXIT_ERROR
    assert f"{AM}use_mbridge and {AM}use_dist_checkpointing are both true" in err, err
    assert "recipe.weights.loader: hf-to-mcore (set" in err and f"mbridge (set {AM}use_dist_checkpointing=false)" in err


def test_the_ref_is_checked_too():
    overrides = [o for o in MBRIDGE if not o.startswith(RM)]  # the ref still loads the conversion
    with pytest.raises(config.ConfigError, match=f"{RM}use_mbridge and {RM}use_dist_checkpointing are both true"):
        config.load(TINY, overrides)


@pytest.mark.parametrize("path,overrides,says", [
    (TINY, ["recipe.weights.loader=mbridge"], f"recipe.weights.loader is mbridge but {AM}use_mbridge is false"),
    (A3, [AM + "use_mbridge=true", *NO_DIST], f"recipe.weights.loader is hf-to-mcore but {AM}use_mbridge is true"),
    (TINY, ["recipe.weights.loader=mbrige"], "recipe.weights.loader is 'mbrige': use one of hf-to-mcore, mbridge"),
    (TINY, [*MBRIDGE[:-1], "recipe.weights.mcore_checkpoint=/ckpt"], "set recipe.weights.mcore_checkpoint=null"),
    (A3, [RM + "use_dist_checkpointing=false"], f"recipe.weights.loader is hf-to-mcore but {RM}use_dist_checkpointing"
     " is false: verl 0.6.1 reads the conversion only through dist checkpointing"),
], ids=["mbridge-off", "conversion-unread", "unknown-loader", "checkpoint-unread", "conversion-not-dist"])
def test_a_loader_the_switches_contradict_is_refused(path, overrides, says):
    with pytest.raises(config.ConfigError, match="recipe.weights.loader") as err:
        config.load(path, overrides)
    assert says in str(err.value)


def test_mbridge_needs_no_conversion(tmp_path):
    recipe = config.load(TINY, MBRIDGE)
    assert recipe.settings.weights.loader == "mbridge" and not recipe.inputs.weights_load
    assert not [c for c in inputs.input_checks(recipe) if c.field.startswith("recipe.weights")]
    a3 = config.load(A3, ["recipe.weights.loader=mbridge", AM + "use_mbridge=true", *NO_DIST])  # checkpoint left ???
    assert "recipe.weights.mcore_checkpoint" not in {c.field for c in inputs.input_checks(a3)}
    # random init: the loader reads nothing, only the contradiction is refused
    config.load(TINY, ["recipe.weights.load=false", "recipe.weights.loader=mbridge"])
    # the conversion is still checked on the default path
    dist = write_dist_manifest(tmp_path / "dist")
    converted = config.load(TINY, [f"recipe.weights.mcore_checkpoint={dist}"])
    assert [c.field for c in inputs.input_checks(converted) if c.field.startswith("recipe.weights")] == [
        "recipe.weights.mcore_checkpoint"]
