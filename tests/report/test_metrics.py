"""The reference's throughput definitions, checked against its published step."""

from __future__ import annotations

import pytest

from tools.report import metrics

TRUE_WEIGHT = metrics.StepStats(8192, 77.8, 1576.6, 859.68, {"rollout": 373.65, "old_log_prob": 0, "ref": 144.5,
                                                               "reward": 5.0, "adv": 0.21, "update": 319.3,
                                                               "reshard": 11.5, "offload": 5.5})


def test_system_tps_per_card_and_per_die():
    assert metrics.system_tps_per_card(TRUE_WEIGHT, 128) == pytest.approx(123.16, abs=0.005)
    assert metrics.system_tps_per_die(TRUE_WEIGHT, 128) == pytest.approx(61.58, abs=0.005)


def test_verl_throughput_is_the_per_die_figure():
    assert metrics.verl_throughput(TRUE_WEIGHT, 256) == pytest.approx(metrics.system_tps_per_die(TRUE_WEIGHT, 128))


def test_rollout_and_train_tps():
    assert metrics.train_tps_per_card(TRUE_WEIGHT, 128) == pytest.approx(331.6, abs=0.05)
    # response tokens / (rollout time x cards): 270.05 (the reference's table prints 271.05)
    assert metrics.rollout_tps_per_card(TRUE_WEIGHT, 128) == pytest.approx(270.05, abs=0.01)
    random_init = metrics.StepStats(8192, 75, 3039.8, 796.8, {"rollout": 318.27, "update": 328.8})
    assert metrics.system_tps_per_card(random_init, 128) == pytest.approx(250.2, abs=0.05)


def test_from_verl_metrics_and_report():
    logged = {"prompt_length/mean": 77.8, "response_length/mean": 1576.6, "timing_s/step": 859.68,
              "timing_s/gen": 373.65, "timing_s/ref": 144.5, "timing_s/update_actor": 319.3}
    step = metrics.from_verl(logged, samples=8192)
    assert step.phases["rollout"] == 373.65 and step.phases["reshard"] == 0.0
    rows = dict(metrics.report(step, 128))
    assert rows["system TPS per card"] == pytest.approx(123.16, abs=0.005)
    assert set(metrics.PHASES) <= {k.removesuffix(" time (s)") for k in rows}
