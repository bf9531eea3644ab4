"""Step time of the A3 profiles as the launcher's model predicts it (tools/perf/timing.py): its constants, its
fit on the reference's true-weight step, its errors on the two held-out published runs, our profiles next to
their physical limit, and what each of our changes is worth to a3-128-true-weight (reverted alone; the rollout
rebalance is modelled at its limit, timing.Options.rebalance). Last, the rollout rebalance at 3K and 32K responses:
the step's rollout off and on, at the profile's mean length and with every answer the longest.

  python benchmarks/step_time.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.launch import config  # noqa: E402
from tools.perf import reference_runs as refs  # noqa: E402
from tools.perf import timing  # noqa: E402

PROFILES = ("a3-128-true-weight", "a3-128-random-init")
REBALANCE = "actor_rollout_ref.rollout.rebalance.enable"
# 32K answers on a3-128-true-weight: the budget and model length follow, the mean is rollout_sim.py's 32K scenario
LONG_ANSWERS = ("data.max_response_length=32768", "actor_rollout_ref.rollout.max_model_len=33792",
                "actor_rollout_ref.rollout.max_num_batched_tokens=33792", "recipe.timing.response_tokens=9000")
# (our change, the overrides that revert it on a3-128-true-weight, option changes that are not config keys)
CHANGES = [
    ("TensorCache", ("actor_rollout_ref.tensor_cache.enable=false",), {}),
    ("directed weight sync", ("actor_rollout_ref.rollout.reshard.experts=gather",
                              "actor_rollout_ref.rollout.reshard.tp_pp=gather"), {}),
    ("manual rollout lifecycle", ("actor_rollout_ref.rollout.lifecycle=sleep",), {}),
    ("on-policy old_log_prob skip", ("actor_rollout_ref.actor.recompute_old_log_prob=true",), {}),
    ("DP syncs on device", (refs.VLLM + "dp_sync_on_device=false",), {}),
    ("TorchAir graph decode", ("recipe.rollout.torchair_graph=false", refs.TORCHAIR + "enable_multistream_mla=false",
                               refs.VLLM + "multistream_overlap_shared_expert=false",
                               refs.TORCHAIR + "enable_kv_nz=false", refs.TORCHAIR + "graph_batch_sizes=[]"), {}),
    ("MLA + shared-expert multistream", (refs.TORCHAIR + "enable_multistream_mla=false",
                                         refs.VLLM + "multistream_overlap_shared_expert=false"), {}),
    ("KV cache in NZ", (refs.TORCHAIR + "enable_kv_nz=false",), {}),
    ("packed micro-batches", (), {"packed": False}),
    ("8 recompute layers (the reference's table: 4)",
     ("actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=4",), {}),
    ("rollout rebalance (at its limit)", (REBALANCE + "=false",), {}),
]


def profile_run(name: str, overrides=(), **opts) -> timing.Run:
    run = timing.run_from_config(config.load(refs.CONFIGS / f"{name}.yaml", list(overrides)))
    return dataclasses.replace(run, opts=dataclasses.replace(run.opts, **opts))


def main() -> None:
    fit, dims = refs.fit(), refs.TRUE_WEIGHT.dims()
    print("constants (tools/perf/timing.py):")
    for name, value, unit, source in timing.table(fit):
        print(f"  {name:<20} {value:10.4g} {unit:<14} {source}")
    print("\npublished vs predicted (s); fitted on the first run only:")
    for pub in (refs.TRUE_WEIGHT, *refs.HELD_OUT):
        errors = refs.errors(pub, timing.predict(pub.run(), dims, fit))
        print(f"  {pub.name}: " + ", ".join(f"{k} {p:.1f}/{q:.1f} ({q / p - 1:+.0%})" for k, (p, q) in errors.items()))
    base = None
    for name in PROFILES:
        pred = timing.predict(profile_run(name), dims, fit)
        base = base or pred
        print("\n" + timing.render(pred, f"{name}:"))
    print("\nour changes on a3-128-true-weight (step s with the change reverted or added, minus the profile's):")
    rows = []
    for change, overrides, opts in CHANGES:
        other = timing.predict(profile_run(PROFILES[0], overrides, **opts), dims, fit)
        moved = max(base.phases, key=lambda k: abs(other.phases[k].s - base.phases[k].s))
        rows.append((other.step_s - base.step_s, change, other.tps_card, moved))
    for delta, change, tps, moved in sorted(rows, key=lambda r: -abs(r[0])):
        print(f"  {change:<46} {delta:+8.1f} s  TPS/card {tps:6.1f}  ({moved})")
    print("\nthe rollout rebalance on a3-128-true-weight, at its limit (rollout s and step s, off -> on):")
    for label, overrides in (("3K answers, mean 1577", ()), ("32K answers, mean 9000", LONG_ANSWERS)):
        off, on = (timing.predict(profile_run(PROFILES[0], (*overrides, f"{REBALANCE}={v}")), dims, fit)
                   for v in ("false", "true"))
        before, after = off.phases["rollout"].s, on.phases["rollout"].s
        print(f"  {label:<24} rollout {before:7.1f} -> {after:7.1f} s ({after / before:.2f}x), "
              f"step {off.step_s:7.1f} -> {on.step_s:7.1f} s")
    print("  (the reference measured 6200 -> about 2300 s for a 32K rollout at TP2 DP128, lengths not published)")
    top = max(rows, key=lambda r: abs(r[0]))
    print(f"headline: a3-128-true-weight predicted {base.tps_card:.1f} TPS/card vs the reference's 123.16"
          f" ({base.tps_card / 123.16:.2f}x), {base.tps_card / base.limit_tps_card:.0%} of its limit"
          f" ({base.limit_tps_card:.0f}); largest of our changes: {top[1]} ({top[0]:+.0f} s without it)")


if __name__ == "__main__":
    main()
