"""The end-of-run summary (tools/report/summary.py) and the CPU-rank sizes the smoke profiles plan."""

from __future__ import annotations

import json
import math

from tests.launch.conftest import CONFIGS
from tools.launch import config, plan, preflight
from tools.model.dims import dims_from_config
from tools.report import summary


def _write_events(tb_dir, steps: dict[int, dict[str, float]]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tb_dir))  # what verl's tensorboard logger uses
    for step, values in steps.items():
        for k, v in values.items():
            w.add_scalar(k, v, step)
    w.close()


VERL_STEP = {"critic/score/mean": 0.25, "response_length/mean": 40.0, "prompt_length/mean": 90.0,
             "timing_s/step": 13.0, "timing_s/gen": 6.0, "timing_s/ref": 1.0, "timing_s/update_actor": 4.0}


def test_steps_are_read_back_from_tensorboard_in_order(tmp_path):
    _write_events(tmp_path, {2: {**VERL_STEP, "critic/score/mean": 0.5}, 1: VERL_STEP})
    steps = summary.read_steps(tmp_path)
    assert [s.step for s in steps] == [1, 2]
    assert [s.reward for s in steps] == [0.25, 0.5]
    assert steps[0].values["timing_s/gen"] == 6.0


def test_table_carries_the_a3_metric_lines(tmp_path):
    rows = summary.table([summary.Step(1, VERL_STEP)], samples=32, cards=2, dies_per_card=1)
    (row,) = rows
    tokens = 32 * (90 + 40)
    assert math.isclose(row["system TPS per card"], tokens / (13.0 * 2))
    assert math.isclose(row["system TPS per die"], row["system TPS per card"])  # a CPU rank is one die
    assert math.isclose(row["rollout TPS per card"], 32 * 40 / (6.0 * 2))
    assert row["update time (s)"] == 4.0 and row["reward mean"] == 0.25
    text = summary.render(rows, tmp_path, tmp_path / "tb")
    assert "run summary: 1 step(s)" in text and f"tensorboard --logdir {tmp_path / 'tb'}" in text
    summary.write(rows, tmp_path / "summary.json")
    assert json.loads((tmp_path / "summary.json").read_text())[0]["step"] == 1


def test_the_log_prob_drift_sync_check_and_kv_cache_get_columns_where_logged(tmp_path):
    drift = {**VERL_STEP, "rollout_corr/log_ppl_diff_max": 0.4, "rollout_corr/log_ppl_abs_diff": 0.06,
             "rollout/weight_sync_mismatches": 0.0, "rollout/kv_cache_freed_mib": 1024.0,
             "rollout/kv_cache_mib": 1024.0, "rollout/kv_cache_freed_rss_mib": 1020.5}
    with_drift, without = summary.table([summary.Step(1, drift), summary.Step(2, VERL_STEP)], samples=8, cards=2,
                                        dies_per_card=1)
    got = (with_drift["logprob diff seq max"], with_drift["logprob diff |seq|"], with_drift["sync mismatches"])
    assert got == (0.4, 0.06, 0)
    assert "logprob diff |seq|" not in without  # a path that logs no drift: no column of NaNs
    text = summary.render([with_drift, without], tmp_path, tmp_path / "tb")
    assert "logprob diff seq max" in text and "sync mismatches" in text and "checks per step" in text
    assert "kv freed (MiB)" in text and "kv freed rss (MiB)" in text and "1020.5" in text  # headers whole, one line
    assert "logprob diff" not in summary.render([without], tmp_path, tmp_path / "tb")  # no empty columns


def test_the_rebalance_figures_get_columns_where_the_rollout_rebalanced(tmp_path):
    rebalanced = {**VERL_STEP, "rollout/rebalance/moved": 3.0, "rollout/rebalance/failed": 0.0,
                  "rollout/rebalance/kv_bytes_sent": 98304.0, "rollout/rebalance/busy_s": 4.5,
                  "rollout/rebalance/idle_s": 0.5, "rollout/rebalance/makespan_s": 5.0,
                  "rollout/rebalance/steps": 41.0, "rollout/rebalance/largest_load_steps": 64.0,
                  "rollout/rebalance/lower_bound_steps": 37.0, "rollout/rebalance/engine_busy_s/0": 4.75,
                  "rollout/rebalance/engine_busy_s/1": 4.25}
    on, off = summary.table([summary.Step(1, rebalanced), summary.Step(2, VERL_STEP)], samples=8, cards=2,
                            dies_per_card=1)
    assert (on["moved"], on["kv bytes sent"], on["makespan (s)"]) == (3, 98304, 5)
    assert (on["makespan (steps)"], on["unmoved (steps)"], on["bound (steps)"]) == (41, 64, 37)
    assert (on["busiest (s)"], on["idlest (s)"]) == (4.75, 4.25)
    assert "moved" not in off
    text = summary.render([on, off], tmp_path, tmp_path / "tb")
    assert "rollout rebalance per step" in text and "98304.0" in text
    headers = ("kv bytes sent", "makespan (s)", "unmoved (steps)", "bound (steps)",
               "busiest (s)", "idlest (s)")
    for header in headers:
        assert header in text, header  # headers whole, one line
    assert "rollout rebalance" not in summary.render([off], tmp_path, tmp_path / "tb")  # off: no table


def test_a_step_without_timings_still_gets_a_row():
    (row,) = summary.table([summary.Step(3, {"critic/score/mean": 1.0})], samples=8, cards=2, dies_per_card=2)
    assert row["reward mean"] == 1.0 and "system TPS per card" not in row and math.isnan(row["step time (s)"])


def test_cpu_ranks_are_ray_cpus_next_to_the_trainer_task():
    lay = config.load(CONFIGS / "cpu-tiny.yaml").layout
    assert plan.cpus_arg(lay) == ("--num-cpus", str(4 + plan.CPU_RANK_HEADROOM))
    a3 = config.load(CONFIGS / "a3-128-true-weight.yaml").layout
    assert plan.cpus_arg(a3) == ()


def _rollout_checks(overrides=()):
    loaded = config.load(CONFIGS / "cpu-tiny.yaml", list(overrides))
    dims = dims_from_config(config.model_dims(loaded)[0])
    return {c.name: c for c in preflight.rollout_checks(loaded.layout, dims)}


def test_the_rollout_expert_checks_follow_the_engine():
    from tools.smoke.cli import ROLLOUTS

    vllm = _rollout_checks()  # cpu-tiny: vLLM's EP spans an instance's DP2 x TP1
    assert vllm["rollout EP spans an instance"].ok and "rollout holds every expert" not in vllm
    assert not _rollout_checks(["recipe.rollout.expert_parallel_size=1"])["rollout EP spans an instance"].ok
    hf = _rollout_checks(ROLLOUTS["hf"])  # the HF engine: every expert on every rank
    assert hf["rollout holds every expert"].ok and "rollout EP spans an instance" not in hf
    hf_ep2 = _rollout_checks([*ROLLOUTS["hf"], "recipe.rollout.expert_parallel_size=2"])
    assert not hf_ep2["rollout holds every expert"].ok


VAL = "val-core/synthetic-arith/reward/mean@4"  # what verl 0.4.0's _validate logs, per data source


def test_validation_accuracy_gets_a_column_and_the_summary_says_before_and_after(tmp_path):
    # verl logs the validation before training at step 0 (no training metrics there) and then every test_freq steps
    _write_events(tmp_path, {0: {VAL: 0.25}, 1: VERL_STEP, 2: {**VERL_STEP, VAL: 0.5}})
    rows = summary.table(summary.read_steps(tmp_path), samples=8, cards=2, dies_per_card=1)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0][summary.VAL_ACCURACY] == 0.25 and math.isnan(rows[0]["reward mean"])
    assert math.isnan(rows[1][summary.VAL_ACCURACY]) and rows[2][summary.VAL_ACCURACY] == 0.5
    text = summary.render(rows, tmp_path, tmp_path / "tb")
    assert "val accuracy (held-out): step 0 0.250, step 2 0.500" in text


def test_validation_accuracy_averages_data_sources_and_ignores_other_validation_metrics():
    values = {"val-core/a/reward/mean@1": 0.2, "val-core/b/acc/mean@1": 0.6, "val-aux/a/reward/std@1": 9.0,
              "val-core/a/reward/maj@4/mean": 9.0}
    assert math.isclose(summary.Step(5, values).val_accuracy, 0.4)
    assert math.isnan(summary.Step(5, VERL_STEP).val_accuracy)


def test_curves_are_drawn_from_the_events_of_one_or_several_runs(tmp_path, capsys):
    from tools.report import curves

    for seed, val in ((0, 0.5), (1, 0.625)):
        _write_events(tmp_path / f"run{seed}" / "tensorboard",
                      {0: {VAL: 0.25}, 1: VERL_STEP, 2: {**VERL_STEP, VAL: val, "critic/score/mean": 0.5}})
    rows = curves.read_run(tmp_path / "run1")
    assert curves.series(rows, curves.VAL) == ([0, 2], [0.25, 0.625])
    assert curves.series(rows, curves.REWARD) == ([1, 2], [0.25, 0.5])
    assert curves.main([str(tmp_path / "run0")]) == 0  # one run: beside its events
    both = tmp_path / "docs" / "curves.png"
    assert curves.main([str(tmp_path / "run0"), str(tmp_path / "run1"), "--out", str(both)]) == 0
    for png in (tmp_path / "run0" / "curves.png", both):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not list(tmp_path.rglob("*.tmp.png")), "written whole, then renamed"
    assert curves.main([str(tmp_path / "nothing-here")]) == 2
    assert "no TensorBoard step metrics" in capsys.readouterr().err


def test_the_y_axis_ends_where_a_small_rise_stays_visible():
    from tools.report import curves

    assert [curves.ylim_top(p) for p in (0.0, 0.19, 0.25, 0.26, 0.5, 0.7, 1.0)] == [0.25, 0.25, 0.25, 0.5, 0.5, 1, 1]
