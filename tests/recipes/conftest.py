"""What the recipe runs share: one --work folder, so the tiny model, the task and its warm start are made once; and
one run of the megatron profile that both the smoke checks and the fault chain read (each launch costs minutes of
Ray, Megatron and vLLM start on 2 cores, so CI makes this one once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.recipes.smoke_run import ROOT, run_smoke

# The machinery's sizes: 4 prompts x 4 samples a step, no validation (each would roll out 4 samples of all 66
# held-out problems), a checkpoint after every step (the fault chain resumes from them).
PROMPTS, N = 4, 4
SMALL = (f"data.train_batch_size={PROMPTS}", f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
         f"actor_rollout_ref.rollout.n={N}", "trainer.val_before_train=false", "trainer.test_freq=-1")
CHECKPOINTED = (*SMALL, "trainer.save_freq=1")
MEGATRON_STEPS = 3

# verl's custom_reward_function: our strict reward, plus one line per call so a test can count the samples. It
# returns strict's score, so a run with it logs what a run with the config's own reward logs.
COUNTING_REWARD = """
import json, sys
sys.path.insert(0, {root!r})
from tools.reward.verl_entry import compute_score as strict


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    score = strict(data_source, solution_str, ground_truth, extra_info)
    with open({calls!r}, "a") as f:
        f.write(json.dumps({{"source": data_source, "truth": ground_truth, "score": score}}) + "\\n")
    return score
"""


@pytest.fixture(scope="session")
def smoke_work():
    """The smoke inputs, kept across sessions like the vLLM wheel: their folder names carry a digest of the settings
    and code that make them (tools.smoke.folders), so only a change makes them again (4 min on 2 AVX2 cores).
    $RL_RECIPE_SMOKE_CACHE moves it; else it lies beside the wheel cache."""
    from tools.install.wheels import cache_base

    cache = Path(os.environ.get("RL_RECIPE_SMOKE_CACHE") or cache_base() / "smoke")
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def counting_reward(tmp: Path) -> tuple[str, Path]:
    """The override that installs the counting reward in `tmp`, and the file its calls go to."""
    calls = tmp / "reward_calls.jsonl"
    reward = tmp / "counting_reward.py"
    reward.write_text(COUNTING_REWARD.format(root=str(ROOT), calls=str(calls)))
    return f"custom_reward_function.path={reward}", calls


@pytest.fixture(scope="session")
def fault_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("faults") / "logs"


@pytest.fixture(scope="session")
def megatron_run(tmp_path_factory, smoke_work, fault_logs):
    """3 steps of cpu-tiny.yaml at the machinery's sizes, checkpointed every step, run straight through: the smoke
    checks of the megatron profile and the run the fault chain's resumed runs must equal."""
    override, calls = counting_reward(tmp_path_factory.mktemp("smoke-megatron"))
    run = run_smoke("megatron", MEGATRON_STEPS, smoke_work, fault_logs, *CHECKPOINTED, override, run_id="straight")
    return {**run, "calls": calls, "steps": MEGATRON_STEPS, "run_id": "straight"}
