"""The 16-node plan of the true-weight profile against a golden file (UPDATE_GOLDEN=1 to accept a change)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.launch.conftest import CONFIGS, ROOT
from tools.launch import config, env, plan, run

GOLDEN = Path(__file__).parent / "golden"
# Fixed inputs: the plan reads no files and the output holds no timestamp or host name.
FACTS = env.NodeFacts("10.0.0.1", "enp189s0f0", "10.0.0.1", True, "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2")
PATHS = ["actor_rollout_ref.model.path=/models/DeepSeek-V3-bf16", "data.train_files=/data/deepscaler/train.parquet",
         "data.val_files=/data/deepscaler/test.parquet", "recipe.weights.mcore_checkpoint=/ckpt/dsv3-tp4pp8ep8"]


def rendered(name: str) -> str:
    recipe = config.load(CONFIGS / f"{name}.yaml", PATHS)
    p = run.prepare(recipe, FACTS, "golden-run", Path("/runs"), python="/venv/bin/python", ray_bin="/venv/bin/ray",
                    device_gb=64.0)  # RAY_AUTH_MODE is the session's (tests/conftest.py), not this machine's token
    return plan.render(p.plan).replace(str(ROOT), "<root>")


def test_true_weight_plan_matches_golden():
    text = rendered("a3-128-true-weight")
    golden = GOLDEN / "a3-128-true-weight.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"plan changed: UPDATE_GOLDEN=1 pytest {__file__} to accept"


def test_plan_has_one_head_and_fifteen_workers():
    text = rendered("a3-128-true-weight")
    assert text.count("node 0: head") == 1 and text.count(": worker") == 15
    assert text.count("--resources '{\"NPU\": 16}'") == 16
    assert "ray start --block --address 10.0.0.1:6379" in text
    assert "LD_PRELOAD=/usr/lib/aarch64-linux-gnu/libjemalloc.so.2" in text
    assert "--config-path /runs/golden-run --config-name verl" in text


def test_cpu_plan_has_no_device_resource():
    recipe = config.load(CONFIGS / "cpu-tiny.yaml", PATHS)
    p = run.prepare(recipe, env.NodeFacts("127.0.0.1", "lo", "127.0.0.1", True, None), "r", Path("/runs"))
    assert len(p.plan.nodes) == 1 and "--resources" not in p.plan.nodes[0].ray_command


def test_run_files_are_saved_with_the_run(tmp_path):
    recipe = config.load(CONFIGS / "a3-128-true-weight.yaml", PATHS)
    p = run.prepare(recipe, FACTS, "saved", tmp_path, device_gb=64.0)
    (tmp_path / "venv").mkdir()
    assert run.save_run_files(p, tmp_path / "venv") == [
        f"{tmp_path / 'venv' / 'stack.json'} not found (written by `python -m tools.install`):"
        " stack.json not saved with the run"]
    (tmp_path / "venv" / "stack.json").write_text('{"forks": {}}\n')
    assert run.save_run_files(p, tmp_path / "venv") == []
    saved = {f.name for f in (tmp_path / "saved").iterdir()}
    assert {"config.yaml", "verl.yaml", "env.json", "stack.json"} <= saved
    verl_cfg = OmegaConf.load(tmp_path / "saved" / "verl.yaml")
    assert "launch" not in verl_cfg and verl_cfg.trainer.nnodes == 16
    assert verl_cfg.critic.rollout_n == 16, "verl's own defaults are merged in and resolved"
    assert verl_cfg.actor_rollout_ref.ref.megatron.num_layer_list == [7, 7, 8, 8, 8, 8, 8, 7]


def test_verl_saves_under_the_checkpoint_dir_and_run_id(tmp_path):
    """verl.yaml's trainer.default_local_dir: <recipe.checkpoints.dir>/<run id> (every rank writes its shards there,
    so every node mounts it), else <run dir>/checkpoints."""
    shared = tmp_path / "shared"
    p = run.prepare(config.load(CONFIGS / "a3-128-true-weight.yaml", [*PATHS, f"recipe.checkpoints.dir={shared}"]),
                    FACTS, "saved", tmp_path / "logs", device_gb=64.0)
    run.save_run_files(p, tmp_path)
    saved = OmegaConf.load(tmp_path / "logs" / "saved" / "verl.yaml").trainer
    assert saved.default_local_dir == str(shared / "saved") == str(run.checkpoint_dir(p))
    own = run.prepare(config.load(CONFIGS / "cpu-tiny.yaml", PATHS), FACTS, "tiny", tmp_path / "logs")
    assert run.checkpoint_dir(own) == tmp_path / "logs" / "tiny" / "checkpoints"


@pytest.mark.parametrize(("key", "instead"), [("trainer.default_local_dir", "set recipe.checkpoints.dir"),
                                              ("trainer.resume_mode", "--resume RUN_DIR"),
                                              ("trainer.resume_from_path", "--resume RUN_DIR")])
def test_where_and_whether_verl_resumes_has_one_home(key, instead):
    with pytest.raises(config.ConfigError, match=f"{key} is set by the launcher: .*{instead}"):
        run.prepare(config.load(CONFIGS / "a3-128-true-weight.yaml", [f"{key}=/elsewhere"]),
                    FACTS, "r", Path("/runs"), device_gb=64.0)


def test_a_new_run_never_resumes_and_a_resumed_one_does_without_validating_first(tmp_path):
    p = run.prepare(config.load(CONFIGS / "cpu-tiny.yaml", PATHS), FACTS, "tiny", tmp_path)
    run.save_run_files(p, tmp_path)
    fresh = OmegaConf.load(tmp_path / "tiny" / "verl.yaml").trainer
    assert fresh.resume_mode == "disable" and fresh.val_before_train is True
    p.resume = object()  # what find_resume sets
    run.save_run_files(p, tmp_path)
    resumed = OmegaConf.load(tmp_path / "tiny" / "verl.yaml").trainer
    assert resumed.resume_mode == "auto" and resumed.val_before_train is False
