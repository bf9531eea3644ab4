"""--resume: the last complete checkpoint of a run directory, the cut-off saves beside it, and what is refused.

Run directories are made here as the launcher and verl leave them: config.yaml and verl.yaml from a real
`save_run_files`, global_step_N folders with the model's config.json, and the tracker verl writes last.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from tests.launch.conftest import CONFIGS, ROOT
from tools.launch import cli, config, env, resume, run

FACTS = env.NodeFacts("127.0.0.1", "lo", "127.0.0.1", True, None)
TINY = yaml.safe_load((ROOT / "recipes/deepseek_r1/model/tiny.yaml").read_text())


def saved_run(logs: Path, run_id: str = "r1", steps=(1, 2), tracked: int | None = 1, overrides=()) -> Path:
    """A cpu-tiny run dir whose run saved `steps` and whose tracker names `tracked` (None: no tracker)."""
    p = run.prepare(config.load(CONFIGS / "cpu-tiny.yaml", list(overrides)), FACTS, run_id, logs)
    run.save_run_files(p, logs)
    ckpt = run.checkpoint_dir(p)
    for step in steps:
        model = ckpt / f"global_step_{step}" / resume.SAVED_MODEL
        model.parent.mkdir(parents=True)
        model.write_text(json.dumps(TINY))
        (model.parents[2] / "data.pt").write_bytes(b"0" * 1000)
    if tracked is not None:
        resume.tracker_path(ckpt).write_text(str(tracked))
    return p.plan.run_dir


def prepared(run_dir: Path, *overrides: str) -> run.Prepared:
    return run.prepare(config.load(CONFIGS / "cpu-tiny.yaml", list(overrides)), FACTS, run_dir.name, run_dir.parent)


def test_the_tracked_checkpoint_is_found_and_newer_saves_are_cut_off(tmp_path):
    run_dir = saved_run(tmp_path, steps=(1, 2, 3), tracked=2)
    p = prepared(run_dir)
    cut = run.find_resume(p)
    assert p.resume.step == 2 and p.resume.path == run_dir / "checkpoints" / "global_step_2"
    assert p.resume.nbytes >= 1000 and "step 2 (" in p.resume.describe() and "UTC" in p.resume.describe()
    assert cut == [run_dir / "checkpoints" / "global_step_3"]
    assert resume.set_aside(cut) == [run_dir / "checkpoints" / "global_step_3.partial"]
    (run_dir / "checkpoints" / "global_step_3").mkdir()  # cut off a second time: both kept
    assert resume.set_aside(cut) == [run_dir / "checkpoints" / "global_step_3.partial.1"]
    assert resume.partial(run_dir / "checkpoints") == []


def test_no_complete_checkpoint_is_refused_naming_the_cut_off_saves(tmp_path):
    run_dir = saved_run(tmp_path, steps=(1,), tracked=None)
    with pytest.raises(config.ConfigError, match="no complete checkpoint in .*cut-off saves there: global_step_1"
                                                 ".*start a new run without --resume"):
        run.find_resume(prepared(run_dir))


def test_a_changed_layout_is_refused_naming_the_field_and_its_saved_value(tmp_path):
    run_dir = saved_run(tmp_path)
    with pytest.raises(config.ConfigError, match=r"tensor_model_parallel_size is 1, the checkpoint was saved with 2"
                                                 r".*set actor_rollout_ref.actor.megatron.tensor_model_parallel_si"):
        run.find_resume(prepared(run_dir, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                                 "launch.devices_per_node=2"))


def test_a_changed_model_is_refused_naming_what_differs(tmp_path):
    run_dir = saved_run(tmp_path)
    bigger = tmp_path / "model"
    bigger.mkdir()
    (bigger / "config.json").write_text(json.dumps({**TINY, "hidden_size": 256}))
    with pytest.raises(config.ConfigError, match="actor_rollout_ref.model.path: the model differs .*hidden_size"
                                                 " 200 -> 256"):
        run.find_resume(prepared(run_dir, f"actor_rollout_ref.model.path={bigger}"))


def test_a_tracker_verl_did_not_write_is_refused(tmp_path):
    run_dir = saved_run(tmp_path)
    resume.tracker_path(run_dir / "checkpoints").write_text("")
    with pytest.raises(config.ConfigError, match="holds '', not a step"):
        run.find_resume(prepared(run_dir))


def test_a_new_run_over_a_run_with_checkpoints_is_refused(tmp_path):
    run_dir = saved_run(tmp_path)
    with pytest.raises(config.ConfigError, match=f"continue it with --resume {run_dir}, or choose another --run-id"):
        run.refuse_saved_run(prepared(run_dir))


def test_dry_run_names_the_checkpoint_it_would_continue_from(tmp_path, capsys):
    run_dir = saved_run(tmp_path, steps=(1, 2, 3), tracked=2)
    assert cli.main([str(CONFIGS / "cpu-tiny.yaml"), "--dry-run", "--resume", str(run_dir)]) == run.EXIT_OK
    out = capsys.readouterr().out
    assert f"resume: continues r1 from step 2 ({run_dir / 'checkpoints' / 'global_step_2'}, saved " in out
    assert (run_dir / "checkpoints" / "global_step_3").is_dir(), "a dry run moves nothing"
    assert OmegaConf.load(run_dir / "verl.yaml").trainer.resume_mode == "disable", "a dry run writes nothing"


def test_dry_run_without_a_checkpoint_says_why(tmp_path, capsys):
    run_dir = saved_run(tmp_path, steps=(), tracked=None)
    assert cli.main([str(CONFIGS / "cpu-tiny.yaml"), "--dry-run", "--resume", str(run_dir)]) == run.EXIT_ERROR
    assert "no complete checkpoint in" in capsys.readouterr().err


def test_resume_and_run_id_naming_two_runs_are_refused(tmp_path, capsys):
    run_dir = saved_run(tmp_path)
    args = [str(CONFIGS / "cpu-tiny.yaml"), "--dry-run", "--resume", str(run_dir), "--run-id", "other"]
    assert cli.main(args) == run.EXIT_ERROR
    assert "--run-id other and --resume" in capsys.readouterr().err


def test_the_resume_command_repeats_the_config_and_overrides(tmp_path):
    run_dir = saved_run(tmp_path)
    p = prepared(run_dir, "trainer.total_training_steps=9")
    assert run.resume_command(p).endswith(f"-m tools.launch {CONFIGS / 'cpu-tiny.yaml'} trainer.total_training_steps=9"
                                          f" --resume {run_dir}")


def test_the_resume_command_of_a_multi_node_run_names_the_head(tmp_path):
    """Every node runs the same command; without MASTER_ADDR in their shell the others could not find the head."""
    run_dir = saved_run(tmp_path, overrides=("launch.nodes=2", "launch.devices_per_node=2"))
    p = run.prepare(config.load(CONFIGS / "cpu-tiny.yaml", ["launch.nodes=2", "launch.devices_per_node=2"]),
                    env.NodeFacts("10.0.0.1", "eth0", "10.0.0.1", True, None), run_dir.name, run_dir.parent)
    assert run.resume_command(p).endswith(f"launch.devices_per_node=2 --master-addr 10.0.0.1 --resume {run_dir}")
