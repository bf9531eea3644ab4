"""The step-time model (tools/perf/timing.py): fitted on the reference's true-weight step, it must reproduce that
step, predict two other published runs within tolerances declared below, stay above its own physical limit, move
as the physics says under a what-if, and be printed by the dry run."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from tests.launch.conftest import CONFIGS
from tools.launch import cli, config
from tools.perf import memory, rollout_sim, timing
from tools.perf import reference_runs as refs
from tools.report import metrics

# Tolerances, chosen and committed before the model computed any prediction of a held-out run (git history: this
# file came in the commit before the first held-out result). The published figures themselves were known (they
# are in issue 20); what was not known is what the model would say. How much should transfer:
# - random init: the reference's own code, cluster and layout family, so the physics carried from the true-weight
#   step (lengths, rollout EP256, TensorCache, directed reshard, DP syncs on device, no recompute) should hold the
#   step within 15 % and each large phase within 30 %.
# - r1_ascend: another code base (upstream verl 0.7.0, no TorchAir config, TP1 training, packed micro-batches):
#   only the layout's physics transfers, kernels and framework overheads do not: the step within a factor of 1.5,
#   each large phase within a factor of 2.
# Phases under 5 % of their step (offload, reward) are reported, not held: the model has no physics for CPU
# scoring or allocator time, and a 50 % error there moves the step by under 3 %.
# Added after the first held-out run (commit a06dc67), not used to choose the above: random init step -15 %
# (rollout -12, ref -9, update -15, reshard +3; offload -78, reward -28); r1_ascend step -23 % (gen -8, old_log_prob
# -34, ref -25, update -35; reward -78). The model is optimistic on both.
HELD_OUT_TOLERANCE = {
    refs.RANDOM_INIT.name: {"step": 0.15, "rollout": 0.30, "ref": 0.30, "update": 0.30, "reshard": 0.30},
    refs.R1_ASCEND.name: {"step": math.log(1.5), "gen": math.log(2), "old_log_prob": math.log(2),
                          "ref": math.log(2), "update": math.log(2)},
}
RELATIVE = {refs.RANDOM_INIT.name: True, refs.R1_ASCEND.name: False}  # |pred/pub - 1| or |log(pred/pub)|

PATHS = ["actor_rollout_ref.model.path=/models/DeepSeek-V3-bf16", "data.train_files=/data/train.parquet",
         "data.val_files=/data/test.parquet", "recipe.weights.mcore_checkpoint=/ckpt/dsv3"]


@pytest.fixture(scope="module")
def fit() -> timing.Fit:
    return refs.fit()


@pytest.fixture(scope="module")
def dims():
    return refs.TRUE_WEIGHT.dims()


def profile(name: str, *overrides: str) -> timing.Run:
    return timing.run_from_config(config.load(CONFIGS / f"{name}.yaml", list(overrides)))


def test_published_throughput_is_rederived_from_each_runs_lengths_and_step():
    for pub in (refs.TRUE_WEIGHT, *refs.HELD_OUT):
        stats = metrics.StepStats(8192, pub.workload.prompt_tokens, pub.workload.response_tokens, pub.step_s)
        printed = 0.1 if pub is refs.R1_ASCEND else 0.05  # r1_ascend's README prints 95.5 for 95.57
        assert metrics.system_tps_per_card(stats, 128) == pytest.approx(pub.tps_card, abs=printed), pub.name
        phases = sum(pub.phases.values())
        # the random-init table's phases add up to 801.29 s, 4.49 s over its step (its doc, §1.4.2)
        slack = 4.5 if pub is refs.RANDOM_INIT else 1.2
        assert phases == pytest.approx(pub.step_s, abs=slack), f"{pub.name}: phases {phases} vs step {pub.step_s}"


def test_calibration_reproduces_the_true_weight_step_with_physical_efficiencies(fit, dims):
    pred = timing.predict(refs.TRUE_WEIGHT.run(), dims, fit)
    for phase, (published, predicted) in refs.errors(refs.TRUE_WEIGHT, pred).items():
        assert predicted == pytest.approx(published, rel=1e-6, abs=0.02), phase
    assert pred.tps_card == pytest.approx(123.16, abs=0.01)
    for name in ("decode_eff", "forward_eff", "train_eff", "host_eff"):
        assert 0.05 < getattr(fit, name) <= 1.0, f"{name} = {getattr(fit, name)}: not a fraction of a datasheet rate"
    assert 0 < fit.reshard_fixed_s < refs.TRUE_WEIGHT.phases["reshard"]


def test_driver_rate_from_the_ref_skew_predicts_the_measured_update_skew(fit):
    """§3.1.2 / §3.2.4: update started 73 s late without TensorCache and about 5 s with it. Only the ref's 57 s
    went into the rate: the update's bytes (the accounting) must give its skew."""
    run = refs.TRUE_WEIGHT.run()
    assert timing.driver_s(run, "ref", fit) == pytest.approx(57.0 + 0.13, abs=0.05)  # + the ref log-probs collected
    assert timing.driver_s(run, "update", fit) == pytest.approx(73.0, rel=0.10)
    cached = dataclasses.replace(run, opts=dataclasses.replace(run.opts, tensor_cache=True))
    assert timing.driver_s(cached, "update", fit) == pytest.approx(5.0, abs=1.0)
    assert timing.driver_s(cached, "ref", fit) == 0.0


def test_driver_accounting_matches_the_replay_of_verls_fit_loop():
    """benchmarks/driver_payload.py replays verl 0.4.0's loop with its own functions; the arithmetic must agree."""
    payload = pytest.importorskip("benchmarks.driver_payload", reason="needs verl (the stack)")
    run = profile("a3-128-true-weight")
    replay = {name: sent + back for name, sent, back in payload.default_flow(False)}
    ours = {stage: sum(b) for stage, b in timing.driver_bytes(run, tensor_cache=False).items()}
    assert ours["rollout"] == pytest.approx(replay["generate_sequences"], rel=1e-3)
    assert ours["ref"] == pytest.approx(replay["compute_ref_log_prob"], rel=1e-3)
    assert ours["update"] == pytest.approx(replay["update_actor"], rel=1e-3)
    # TensorCache as the series runs it (the advantages to one worker per DP rank, which broadcasts them), and as
    # the reference's did (to every TP x PP replica); the model leaves out the kilobytes of meta data per worker
    copies, rowless = payload.advantages_dispatch()
    for per_dp, flow in ((True, payload.tensor_cache_flow(copies, rowless)),
                         (False, payload.tensor_cache_flow(payload.REPLICAS, 0))):
        cached = {name: sent + back for name, sent, back in flow}
        opts = dataclasses.replace(run.opts, advantages_per_dp=per_dp)
        ours = {stage: sum(b) for stage, b in
                timing.driver_bytes(dataclasses.replace(run, opts=opts), tensor_cache=True).items()}
        assert ours["rollout"] == pytest.approx(cached["generate_sequences_cached"], rel=1e-3)
        assert ours["update"] == pytest.approx(cached["update_actor_cached"], rel=0.08 if per_dp else 1e-2), per_dp


@pytest.mark.parametrize("pub", refs.HELD_OUT, ids=["random-init", "r1_ascend"])
def test_held_out_runs_are_predicted_within_the_declared_tolerance(pub, fit, dims):
    pred = timing.predict(pub.run(), dims, fit)
    errors = refs.errors(pub, pred)
    report = ", ".join(f"{k} {p:.1f} vs {q:.1f} ({q / p - 1:+.0%})" for k, (p, q) in errors.items())
    print(f"{pub.name}: {report}")
    for phase, tolerance in HELD_OUT_TOLERANCE[pub.name].items():
        published, predicted = errors[phase]
        off = abs(predicted / published - 1) if RELATIVE[pub.name] else abs(math.log(predicted / published))
        assert off <= tolerance, f"{pub.name} {phase}: predicted {predicted:.1f} s vs {published:.1f} s ({report})"


@pytest.mark.parametrize("name", ["a3-128-true-weight", "a3-128-random-init"])
def test_every_phase_stays_above_its_physical_limit(name, fit, dims):
    pred = timing.predict(profile(name), dims, fit)
    for phase, p in pred.phases.items():
        assert p.limit <= p.s + 1e-9, f"{phase}: limit {p.limit} above the prediction {p.s}"
    assert pred.limit_tps_card > pred.tps_card > 0
    assert pred.phases["rollout"].limit > 0 and pred.phases["update"].limit > 0


def test_decode_limit_is_the_weights_and_kv_each_step_reads(dims):
    """Forced lengths: every engine holds 64 sequences for all 3072 steps, so the decode limit is the sum over
    steps of (weights + 64 x (prompt + step) KV tokens) / HBM bandwidth, and it halves with twice the bandwidth."""
    run = profile("a3-128-random-init")
    c = timing.CONSTANTS
    per_engine = run.lay.sequences // run.lay.engines
    prompt, steps = round(run.work.prompt_tokens), run.lay.response_len
    kv_tokens = sum(per_engine * (prompt + k) for k in range(steps))
    weights = 2 * memory.vllm_weight_params(run.lay, dims)
    expected = (steps * weights + kv_tokens * dims.layers * (dims.kv_lora_rank + dims.qk_rope) * 2) / (
        c.hbm_gb_per_s * 1e9)
    [(hbm_ms, counted)] = timing.decode_instances(run, dims, c)
    assert counted == steps
    assert hbm_ms / 1e3 == pytest.approx(expected, rel=1e-9)
    faster = dataclasses.replace(c, hbm_gb_per_s=2 * c.hbm_gb_per_s)
    assert timing.decode_instances(run, dims, faster)[0][0] == pytest.approx(hbm_ms / 2)


def test_training_limit_is_three_forward_passes_at_peak(dims):
    run = profile("a3-128-true-weight")
    c = timing.CONSTANTS
    seqs = run.work.prompt_tokens + timing.response_lengths(run)
    assert seqs.mean() == pytest.approx(77.8 + 1576.6, rel=0.01)  # the simulator hits the workload's mean
    # the FLOPs count's parameters met per token (LM head included) plus the input embedding: DeepSeek-V3's
    # "37B activated" (arXiv:2412.19437)
    active = timing.forward_flops(dims, 1, 0) / 2
    assert active + dims.embedding_params == pytest.approx(37e9, rel=0.02)
    linear = 3 * 2 * active * seqs.sum() / (run.lay.world * c.peak_tflops * 1e12)
    limit = timing.pass_limit_s(run, dims, c, backward=True)
    assert linear < limit < 1.15 * linear  # the attention pairs add a few per cent at these lengths
    assert timing.pass_limit_s(run, dims, dataclasses.replace(c, peak_tflops=2 * c.peak_tflops), True) == \
        pytest.approx(limit / 2)


WHAT_IF = [
    # (override, phase that must change, the change as the physics says it)
    ("actor_rollout_ref.tensor_cache.enable=false", "ref", lambda run, fit: timing.driver_s(
        dataclasses.replace(run, opts=dataclasses.replace(run.opts, tensor_cache=False)), "ref", fit)),
    (refs.VLLM + "dp_sync_on_device=false", "rollout", lambda run, fit: run.lay.response_len * 2 * (14 - 3) / 1e3),
    (refs.TORCHAIR + "enable_kv_nz=false", "rollout", lambda run, fit: run.lay.response_len * 1.0 / 1e3),
]


@pytest.mark.parametrize("override,phase,delta", WHAT_IF, ids=[w[0].rsplit(".", 1)[-1] for w in WHAT_IF])
def test_what_if_moves_the_phase_the_physics_names(override, phase, delta, fit, dims):
    base_run = profile("a3-128-true-weight")
    base, other = (timing.predict(r, dims, fit) for r in (base_run, profile("a3-128-true-weight", override)))
    changed = {k for k in base.phases if not math.isclose(base.phases[k].s, other.phases[k].s, abs_tol=1e-6)}
    assert phase in changed
    # syncs also come once per prefill chunk: a handful of steps more than the decode's
    assert other.phases[phase].s - base.phases[phase].s == pytest.approx(delta(base_run, fit), rel=0.01)


def test_the_on_policy_skip_saves_one_forward_pass(fit, dims):
    base = timing.predict(profile("a3-128-true-weight"), dims, fit)
    other = timing.predict(profile("a3-128-true-weight", "actor_rollout_ref.actor.recompute_old_log_prob=true",
                                   "actor_rollout_ref.tensor_cache.enable=false"), dims, fit)
    assert base.phases["old_log_prob"].s == 0
    old, ref = other.phases["old_log_prob"].parts["compute"], other.phases["ref"].parts["compute"]
    assert 0.9 * ref < old < 1.5 * ref  # a forward of the actor over the batch, in micro-batches of 4 not 8


def test_a_second_epoch_doubles_the_update_pass(fit, dims):
    """Each epoch runs every micro-batch again and fills and drains the pipeline again, once per mini-batch."""
    c = timing.CONSTANTS
    one = timing.update(profile("a3-128-true-weight"), dims, c, fit)
    two = timing.update(profile("a3-128-true-weight", "actor_rollout_ref.actor.ppo_epochs=2"), dims, c, fit)
    assert two.parts["compute"] == pytest.approx(2 * one.parts["compute"], rel=1e-9)
    assert two.parts["driver"] == one.parts["driver"]  # the batch is dispatched once


def test_rollout_sim_forced_lengths_cost_cap_steps_and_pool_is_no_slower():
    s = rollout_sim.Scenario("forced", 4, 8, 4, 100, 100, 8, prompt_len=10, buckets=(8,))
    lengths = rollout_sim.response_lengths(s, np.random.default_rng(0))
    assert (lengths == 100).all()
    seen = []
    ms = rollout_sim.decode(rollout_sim.Rollout(s, lengths), lambda b, kv: seen.append((b, kv)) or 1.0)
    assert ms == 100  # one ms a step, every sequence to the cap
    assert seen == [(8, 8 * 10 + 8 * 99 / 2)]  # one interval: 8 sequences, KV averaged over it
    varied = dataclasses.replace(s, mean=40)
    lengths = rollout_sim.response_lengths(varied, np.random.default_rng(0))
    step = lambda b, kv: 1.0 + b  # noqa: E731
    pooled, steps = rollout_sim.pooled_ms(varied, lengths, step)
    assert steps == lengths.max()
    assert pooled <= rollout_sim.decode(rollout_sim.Rollout(varied, lengths), step)


def test_dry_run_prints_the_prediction_and_a_what_if(tmp_path, capsys):
    args = [str(CONFIGS / "a3-128-true-weight.yaml"), *PATHS, "--dry-run", "--run-id", "t", "--logs",
            str(tmp_path), "--what-if", "actor_rollout_ref.tensor_cache.enable=false"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    table = out[out.index("step time (prediction"):]
    for phase in ("rollout", "ref", "update", "reshard", "offload", "step"):
        assert f"\n  {phase} " in table, phase
    assert "TPS per card" in table and "per die" in table and "dominant: rollout" in table
    what_if = out[out.index("what-if actor_rollout_ref.tensor_cache.enable=false"):]
    assert "TPS per card" in what_if and "\n  ref " in what_if
    assert cli.main([*args[:-1], "actor_rollout_ref.rollout.max_num_seqs=32"]) == 0  # the variant fails a check
    out = capsys.readouterr().out
    assert "what-if actor_rollout_ref.rollout.max_num_seqs=32: no prediction, the variant fails preflight:" \
        " actor_rollout_ref.rollout.max_num_seqs: one batch per engine fails" in out
    assert cli.main([str(CONFIGS / "cpu-tiny.yaml"), "--dry-run", "--run-id", "t", "--logs", str(tmp_path)]) == 0
    assert "no step-time prediction for launch.accelerator cpu" in capsys.readouterr().out


def test_every_constant_is_in_the_table_with_a_source(fit):
    rows = timing.table(fit)
    assert len({name for name, *_ in rows}) == len(rows)
    for name, value, unit, source in rows:
        assert source and unit, name
        assert math.isfinite(value), f"{name} is not set (calibrate)"
    assumed = [name for name, _, _, source in rows if source.startswith("assumed")]
    assert assumed == ["hccs_gb_per_s", "host_gb_per_s"]
