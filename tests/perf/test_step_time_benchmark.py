"""benchmarks/step_time.py's list of our changes, held to the profiles it reverts them on: every change's overrides
must still be keys of a3-128-true-weight (a renamed vLLM-Ascend key once stopped the benchmark), and each one must
move the predicted step, or the row it prints says nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tools.perf import reference_runs as refs
from tools.perf import timing

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "step_time.py"


def _step_time():
    spec = importlib.util.spec_from_file_location("step_time_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STEP_TIME = _step_time()


@pytest.fixture(scope="module")
def base():
    return timing.predict(STEP_TIME.profile_run(STEP_TIME.PROFILES[0]), refs.TRUE_WEIGHT.dims(), refs.fit())


@pytest.mark.parametrize(("change", "overrides", "opts"), STEP_TIME.CHANGES, ids=[c[0] for c in STEP_TIME.CHANGES])
def test_each_change_loads_on_the_profile_and_moves_the_step(base, change, overrides, opts):
    other = timing.predict(STEP_TIME.profile_run(STEP_TIME.PROFILES[0], overrides, **opts), refs.TRUE_WEIGHT.dims(),
                           refs.fit())
    assert abs(other.step_s - base.step_s) > 1.0, change


def test_the_long_answer_overrides_load_and_the_rebalance_helps_more_there(base):
    def rollout_s(overrides, enable):
        run = STEP_TIME.profile_run(STEP_TIME.PROFILES[0], (*overrides, f"{STEP_TIME.REBALANCE}={enable}"))
        return timing.predict(run, refs.TRUE_WEIGHT.dims(), refs.fit()).phases["rollout"].s

    short = rollout_s((), "true") / rollout_s((), "false")
    long = rollout_s(STEP_TIME.LONG_ANSWERS, "true") / rollout_s(STEP_TIME.LONG_ANSWERS, "false")
    assert long < short < 1.0
