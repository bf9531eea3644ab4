"""tools/smoke/cli.py: which profile it runs, the inputs it prepares (once, via .partial folders) and the
launcher arguments it builds from them. Not a run: tests/recipes/test_smoke.py (slow) does that."""

from __future__ import annotations

import json

import pytest

from tools.launch import config, env, run
from tools.smoke import cli as smoke

MCORE_KEY = "recipe.weights.mcore_checkpoint"


def test_an_interrupted_preparation_is_redone(tmp_path):
    made = []

    def make(dst):
        dst.mkdir()
        (dst / "done").write_text("x")
        made.append(dst)

    partial = tmp_path / "tiny.partial"
    partial.mkdir()
    (partial / "half-written").write_text("?")  # what an interrupted run leaves
    assert smoke.complete(tmp_path / "tiny", make) == tmp_path / "tiny"
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == ["done"] and not partial.exists()
    smoke.complete(tmp_path / "tiny", make)
    assert len(made) == 1, "a finished input is reused"


def test_smoke_refuses_zero_steps(capsys):
    assert smoke.main(["--steps", "0"]) == 2
    assert "--steps is 0" in capsys.readouterr().err


def test_random_init_is_for_the_megatron_profile(capsys):
    assert smoke.main(["--profile", "fsdp", "--random-init", "--dry-run"]) == 2
    assert "--random-init applies to --profile megatron" in capsys.readouterr().err


@pytest.mark.parametrize("profile", ["megatron", "fsdp"])
def test_smoke_dry_run_makes_nothing(profile, tmp_path, capsys):
    rc = smoke.main(["--dry-run", "--profile", profile, "--work", str(tmp_path / "work"),
                     "--logs", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "verl.trainer.main_ppo" in out and "trainer.total_training_steps" not in out
    assert f"plan: {smoke.PROFILES[profile].stem}," in out
    assert not (tmp_path / "work").exists() and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("steps", [1, 7])
def test_smoke_passes_steps_and_inputs_to_the_launcher(tmp_path, steps):
    args = smoke.parser().parse_args(["--steps", str(steps), "data.train_batch_size=4"])
    out = smoke.launcher_args(args, tmp_path / "m", tmp_path / "d", tmp_path / "c")
    assert out[0] == str(smoke.CONFIG)
    assert f"trainer.total_training_steps={steps}" in out and "data.train_batch_size=4" in out
    assert f"data.train_files={tmp_path / 'd' / 'train.parquet'}" in out


def test_the_default_profile_is_the_a3_path_with_its_checkpoint(tmp_path):
    args = smoke.parser().parse_args([])
    assert args.profile == "megatron" and smoke.CONFIG.name == "cpu-tiny.yaml" and smoke.needs_checkpoint(args)
    out = smoke.launcher_args(args, tmp_path / "m", tmp_path / "d", tmp_path / "tiny-mcore")
    assert out[0] == str(smoke.PROFILES["megatron"])
    assert f"{MCORE_KEY}={tmp_path / 'tiny-mcore'}" in out and "recipe.weights.load=false" not in out
    with pytest.raises(ValueError, match="loads a checkpoint"):
        smoke.launcher_args(args, tmp_path / "m", tmp_path / "d", None)


def test_random_init_loads_no_checkpoint(tmp_path):
    args = smoke.parser().parse_args(["--random-init"])
    assert not smoke.needs_checkpoint(args)
    out = smoke.launcher_args(args, tmp_path / "m", tmp_path / "d", None)
    assert "recipe.weights.load=false" in out and f"{MCORE_KEY}=null" in out
    cfg = config.load(out[0], [o for o in out[1:] if "=" in o]).cfg
    assert config.value(cfg, "actor_rollout_ref.actor.megatron.use_dist_checkpointing") is False
    assert config.value(cfg, "actor_rollout_ref.actor.load_weight") is False
    assert config.value(cfg, "actor_rollout_ref.ref.load_weight") is False


def test_the_fsdp_profile_gets_no_megatron_weights(tmp_path):
    args = smoke.parser().parse_args(["--profile", "fsdp"])
    assert not smoke.needs_checkpoint(args)
    out = smoke.launcher_args(args, tmp_path / "m", tmp_path / "d", None)
    assert out[0] == str(smoke.PROFILES["fsdp"]) and out[0].endswith("cpu-tiny-fsdp.yaml")
    assert not [o for o in out if o.startswith("recipe.weights")]


def test_user_overrides_come_last_so_they_win(tmp_path):
    args = smoke.parser().parse_intermixed_args([f"{MCORE_KEY}=/elsewhere", "--steps", "2", "--run-id", "r"])
    out = smoke.launcher_args(args, tmp_path / "m", tmp_path / "d", tmp_path / "c")
    mine = [i for i, o in enumerate(out) if o.startswith(MCORE_KEY)]
    assert [out[i] for i in mine] == [f"{MCORE_KEY}={tmp_path / 'c'}", f"{MCORE_KEY}=/elsewhere"]
    assert out[-6:] == ["--master-addr", "127.0.0.1", "--logs", str(args.logs), "--run-id", "r"]


def test_the_prepared_inputs_pass_the_launchers_input_checks(tmp_path, monkeypatch):
    """make-tiny, synthetic-arith, the warm start and hf-to-mcore (torch_dist) for real, once; the launcher accepts
    what they made."""
    monkeypatch.setattr(smoke, "WARM_START", {"steps": 2})  # the stage's flow, not its learning
    said = []
    model, data, mcore = smoke.prepare(tmp_path, say=said.append)
    names = smoke.folders(seed=0)
    assert (model, data, mcore) == (tmp_path / names["warm"], tmp_path / names["data"], tmp_path / names["mcore"])
    assert json.loads((mcore / "manifest.json").read_text())["header"]["format"] == "torch_dist"
    assert json.loads((model / "warm_start.json").read_text())["source"] == str(tmp_path / names["model"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[k] for k in ("model", "data", "warm", "mcore")])
    again = smoke.prepare(tmp_path, say=said.append)
    assert again == (model, data, mcore) and sum("converting" in s for s in said) == 1, "made once"
    assert sum("warm-starting" in s for s in said) == 1
    out = smoke.launcher_args(smoke.parser().parse_args([]), model, data, mcore)
    recipe = config.load(out[0], [o for o in out[1:] if "=" in o])
    prepared = run.prepare(recipe, env.NodeFacts("127.0.0.1", "lo", "127.0.0.1", True, None), "t", tmp_path / "logs")
    assert [c.message() for c in prepared.checks + prepared.inputs if not c.ok] == []
    assert prepared.ready


def test_cold_skips_the_warm_start_and_converts_the_random_model(tmp_path):
    said = []
    model, _, mcore = smoke.prepare(tmp_path / "w", warm=False, say=said.append)
    names = smoke.folders(seed=0)
    assert model.name == names["model"] and mcore.name == names["cold-mcore"]
    assert not any("warm-starting" in s for s in said)


def test_a_changed_model_task_warm_start_or_seed_gets_folders_of_its_own(monkeypatch):
    from tools.weights import tiny

    before = smoke.folders(seed=0)
    assert before["mcore"].startswith(before["warm"]) and before["cold-mcore"].startswith(before["model"])
    assert smoke.folders(seed=1)["warm"] != before["warm"] and smoke.folders(seed=1)["model"] == before["model"]
    monkeypatch.setattr(smoke, "WARM_START", {"lr": 1.0})
    assert smoke.folders(seed=0)["warm"] != before["warm"] and smoke.folders(seed=0)["data"] == before["data"]
    monkeypatch.setattr(smoke, "ARITH_ARGS", (*smoke.ARITH_ARGS, "--max-terms", "3"))
    assert smoke.folders(seed=0)["data"] != before["data"]
    monkeypatch.setitem(tiny.TINY_CONFIG, "num_experts_per_tok", 2)
    after = smoke.folders(seed=0)
    assert all(after[k] != before[k] for k in before)


def test_changed_input_code_gets_folders_of_its_own(tmp_path, monkeypatch):
    """A kept --work folder (the recipe tests keep theirs under ~/.cache) is never served by an older converter."""
    code = tmp_path / "tools/weights"
    code.mkdir(parents=True)
    (code / "dist.py").write_text("VERSION = 1\n")
    monkeypatch.setattr(smoke, "ROOT", tmp_path)
    monkeypatch.setattr(smoke, "INPUT_CODE", (code,))
    before = smoke.folders(seed=0)
    assert smoke.folders(seed=0) == before
    (code / "dist.py").write_text("VERSION = 2\n")
    after = smoke.folders(seed=0)
    assert all(after[k] != before[k] for k in before)


def test_rollout_is_for_the_megatron_profile(capsys):
    assert smoke.main(["--profile", "fsdp", "--rollout", "hf", "--dry-run"]) == 2
    assert "--rollout applies to --profile megatron" in capsys.readouterr().err


@pytest.mark.parametrize("rollout, name, dp, instances, ep", [("vllm", "vllm", 2, 2, 2), ("hf", "hf", 1, 4, 1)])
def test_the_rollout_choice_sets_the_engine_and_its_layout(tmp_path, rollout, name, dp, instances, ep):
    """vLLM is the default; --rollout hf sets the HF engine's one-rank layout, and the launcher's checks take it."""
    args = smoke.parser().parse_args(["--rollout", rollout])
    out = smoke.launcher_args(args, tmp_path / "m", tmp_path / "d", tmp_path / "c")
    cfg = config.load(out[0], [o for o in out[1:] if "=" in o]).cfg
    assert config.value(cfg, "actor_rollout_ref.rollout.name") == name
    assert config.value(cfg, "actor_rollout_ref.rollout.data_parallel_size") == dp
    layout = config.value(cfg, "recipe.rollout.instances"), config.value(cfg, "recipe.rollout.expert_parallel_size")
    assert layout == (instances, ep)
