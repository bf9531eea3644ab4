"""Rollout makespan across vLLM data-parallel engines, with and without rebalancing: a discrete-event
simulation (no GPU) of the plan in verl/workers/rollout/rebalance/plan.py against the reference's rule.
The simulator (engines, admission, lengths, pool, bound) is tools/perf/rollout_sim.py, which the step-time
model of the launcher's preflight (tools/perf/timing.py) runs too; the policies are here.

Model (all stated, none measured):
* N engines step in lockstep (vLLM DP synchronises every step), so a step costs the slowest engine's:
  t(b) = A + C * b ms for an engine running b sequences padded to its captured-graph bucket
  (buckets 1, 2, 4, ... up to max_num_seqs, as vLLM captures no larger graph; A = 30 ms, C = 0.12 ms:
  a step of one sequence costs almost as much as a step of 64). An engine with nothing left idles;
  every running sequence gains one token a step.
* The batch of S = prompts x samples sequences is split contiguously over the engines (verl's DP
  chunking: the samples of a prompt land on the same engine). An engine runs at most
  `max_num_seqs` sequences at once (FIFO admission, the rest wait).
* Response lengths are long-tailed and correlated within a prompt: log L = mu + sp * z_prompt +
  ss * z_sample, clipped to [1, cap], with mu fitted (bisection) so the clipped mean hits the target:
  1576 tokens with cap 3072 (the reference's rollout) and 9000 tokens with cap 32768.
* Every `--interval` steps a policy may move sequences. Moving a running sequence copies its KV
  (ceil((prompt + generated) / 128) blocks of 128 tokens at 70 KB a token, DeepSeek-V3's MLA cache
  over 61 layers) at 20 GB/s; all engines wait for the slowest copy (counted in the makespan).
  A waiting sequence moves for free (prompt ids only). KV capacity per engine holds max_num_seqs
  full-length sequences, so admission is bounded by max_num_seqs, not by KV.
  With `--kv-transfer reprefill` a moved running sequence is instead recomputed on the receiver, a
  prefill of its prompt + generated tokens at `--prefill-tok-per-s` per engine (5000 assumed, not
  measured); all engines wait for the slowest receiver's prefill. The cp columns are then that time.
Policies:
  none   no rebalance.
  ref    our reading of the reference's rule: target = bucket of the average load; engines above it
         give their excess, most recently admitted running sequences first, to engines below it in
         rank order, filling each to the target; receivers above 90 % KV are skipped, block fit unchecked.
  ours   plan_rebalance (same interval and cap): waiting sequences first, then the running ones with
         the fewest KV blocks; receivers kept under the cap.
Lower bound (valid for any policy, even free migration): a step costs at least A + C * (batch of its
busiest engine) >= A + C * r / N with r sequences running in all; in K steps at most
P(K) = min(K * N * max_num_seqs, sum_i min(L_i, K)) tokens can be decoded, so with T tokens in all
  bound = A * K_min + C * T / N,   K_min = the smallest K with P(K) >= T
(total work spread perfectly over N engines at no bucket padding, in the fewest steps possible).
The bound knows the lengths: when loads exceed max_num_seqs (rows "seqs<=M", engines run in waves)
no length-oblivious policy reaches it, so the table also shows `pool`: one FIFO queue feeding all
N x max_num_seqs slots with running sequences spread perfectly at every step and free moves, the
limit of rebalancing ever more often. Columns: makespans (s), ratios to the bound, sequences moved
(mv) and the part of the makespan spent copying KV (cp). Last line: the headline ratios.

  python benchmarks/rollout_sim.py [--interval 64] [--seed 0] [--kv-transfer ship|reprefill]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.perf.rollout_sim import (  # noqa: E402  (the simulator itself, shared with tools/perf/timing.py)
    Rollout,
    Scenario,
    decode,
    lower_bound_ms,
    pooled_ms,
    response_lengths,
)

PLAN_PATH = ROOT / "third_party/verl/verl/workers/rollout/rebalance/plan.py"

A_MS, C_MS = 30.0, 0.12
BLOCK_TOKENS, KV_BYTES_PER_TOKEN, LINK_BYTES_PER_S = 128, 61 * 576 * 2, 20e9
KV_CAP = 0.9


def load_plan():
    """plan.py alone (pure Python): importing it through the verl package costs seconds."""
    spec = importlib.util.spec_from_file_location("rebalance_plan", PLAN_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


plan = load_plan()


SCENARIOS = [
    Scenario("3K  N=64", 64, 512, 16, 1576, 3072, 256),
    Scenario("3K  N=128", 128, 512, 16, 1576, 3072, 256),
    Scenario("32K N=64", 64, 512, 16, 9000, 32768, 256),
    Scenario("32K N=128", 128, 512, 16, 9000, 32768, 256),
    Scenario("32K N=64 seqs<=64", 64, 512, 16, 9000, 32768, 64),  # KV-bound: engines run in waves
    Scenario("32K N=128 seqs<=32", 128, 512, 16, 9000, 32768, 32),
]


def step_ms(bucket: int, kv_tokens: float) -> float:
    """t(b) = A + C * bucket(b): the cost of a step does not depend on the KV read here."""
    return A_MS + C_MS * bucket if bucket else 0.0


def kv_blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def engine_loads(rollout: Rollout) -> tuple[list, list[list[int]]]:
    """What each engine reports: EngineLoad, and its running sequences in report order."""
    capacity = rollout.s.max_num_seqs * kv_blocks(rollout.s.prompt_len + rollout.s.cap)
    reports, orders = [], []
    for running, waiting in zip(rollout.running, rollout.waiting, strict=True):
        seqs = sorted(running, key=running.get)
        blocks = tuple(kv_blocks(rollout.s.prompt_len + rollout.generated(q)) for q in seqs)
        reports.append(plan.EngineLoad(len(seqs), len(waiting), sum(blocks), capacity, blocks))
        orders.append(seqs)
    return reports, orders


def ours(rollout: Rollout) -> list[tuple[int, int, list[int], int]]:
    """(src, dst, running seqs, waiting count) from plan_rebalance."""
    reports, orders = engine_loads(rollout)
    moves = plan.plan_rebalance(reports, rollout.buckets, KV_CAP).moves
    return [(m.src, m.dst, [orders[m.src][i] for i in m.seqs], m.waiting) for m in moves]


def reference(rollout: Rollout) -> list[tuple[int, int, list[int], int]]:
    """Average-load bucket; excess from the back of each donor's running list, receivers in rank order."""
    reports, orders = engine_loads(rollout)
    loads = [r.sequences for r in reports]
    target = plan.bucket_of(math.ceil(sum(loads) / len(loads)), rollout.buckets)
    slots = {e: target - n for e, n in enumerate(loads)
             if n < target and reports[e].used_blocks <= KV_CAP * reports[e].capacity_blocks}
    moves = []
    for src, n in enumerate(loads):
        excess, running, waiting = n - target, list(reversed(orders[src])), reports[src].waiting
        for dst in slots:
            if excess <= 0:
                break
            take = min(excess, slots[dst])
            if take <= 0:
                continue
            seqs, running = running[:take], running[take:]
            moves.append((src, dst, seqs, min(take - len(seqs), waiting)))
            waiting -= take - len(seqs)
            slots[dst] -= take
            excess -= take
    return moves


def apply_moves(rollout: Rollout, moves, reprefill_tok_per_ms: float | None = None) -> tuple[float, int]:
    """Carry out the moves; returns (move time in ms, sequences moved). The move time is the slowest
    engine's KV traffic, or with `reprefill_tok_per_ms` the slowest receiver's prefill of what it got."""
    traffic = [0] * rollout.s.engines
    prefill = [0] * rollout.s.engines
    moved = 0
    for src, dst, seqs, waiting in moves:
        for seq in seqs:
            nbytes = kv_blocks(rollout.s.prompt_len + rollout.generated(seq)) * BLOCK_TOKENS * KV_BYTES_PER_TOKEN
            traffic[src] += nbytes
            traffic[dst] += nbytes
            prefill[dst] += rollout.s.prompt_len + rollout.generated(seq)
            rollout.stop(src, seq)
            rollout.waiting[dst].appendleft(seq)  # a migrated sequence resumes first
            rollout.owner[seq] = dst
        for _ in range(waiting):
            seq = rollout.waiting[src].pop()  # the last in the donor's queue
            rollout.waiting[dst].append(seq)
            rollout.owner[seq] = dst
        moved += len(seqs) + waiting
    for e in sorted({m[0] for m in moves} | {m[1] for m in moves}):  # a donor may have freed slots
        rollout.admit(e)
    if reprefill_tok_per_ms is not None:
        return max(prefill) / reprefill_tok_per_ms, moved
    return 1e3 * max(traffic) / LINK_BYTES_PER_S, moved


def simulate(s: Scenario, lengths: np.ndarray, policy, interval: int,
             reprefill_tok_per_ms: float | None = None) -> tuple[float, float, int]:
    """Makespan in ms (steps plus KV copies), of it the copies in ms, and sequences moved."""
    rollout = Rollout(s, lengths)
    moves = {"ms": 0.0, "moved": 0}

    def check(r: Rollout) -> float:
        count_target = plan.bucket_of(math.ceil(r.left / s.engines), r.buckets)
        if plan.largest_bucket(r.loads(), r.buckets) <= count_target:  # nothing to gain
            return 0.0
        ms, n = apply_moves(r, policy(r), reprefill_tok_per_ms)
        moves["ms"], moves["moved"] = moves["ms"] + ms, moves["moved"] + n
        return ms

    makespan = decode(rollout, step_ms, interval, check if policy else None)
    return makespan, moves["ms"], moves["moved"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=int, default=64, help="engine steps between rebalance checks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-transfer", choices=("ship", "reprefill"), default="ship",
                        help="how a moved running sequence gets its KV: copied, or recomputed by a prefill")
    parser.add_argument("--prefill-tok-per-s", type=float, default=5000.0,
                        help="prefill throughput of one engine with --kv-transfer reprefill (assumed)")
    args = parser.parse_args()
    reprefill = args.prefill_tok_per_s / 1e3 if args.kv_transfer == "reprefill" else None
    start = time.perf_counter()
    print(f"t(b) = {A_MS:g} + {C_MS:g} * bucket(b) ms; buckets 1, 2, 4, .. up to max_num_seqs; "
          f"check every {args.interval} steps; KV cap {KV_CAP:.0%}; moved KV: {args.kv_transfer}"
          + (f" at {args.prefill_tok_per_s:g} prefill tokens/s" if reprefill else " at 20 GB/s"))
    print(f"{'scenario':20} {'seqs':>5} {'mean':>6} {'max':>6} {'bound s':>8} {'none s':>8} {'ref s':>8} "
          f"{'ours s':>8} {'pool s':>7} {'none/lb':>7} {'ref/lb':>7} {'ours/lb':>7} {'pool/lb':>7} "
          f"{'ref mv':>7} {'ours mv':>7} {'ref cp s':>8} {'ours cp s':>9}")
    worst_ours, worst_vs_pool, best_gain, worst_vs_none = 0.0, 0.0, 0.0, 0.0
    for s in SCENARIOS:
        lengths = response_lengths(s, np.random.default_rng(args.seed))
        bound = lower_bound_ms(lengths, s.engines, s.max_num_seqs, A_MS, C_MS)
        none, _, _ = simulate(s, lengths, None, args.interval)
        ref, ref_cp, ref_mv = simulate(s, lengths, reference, args.interval, reprefill)
        our, our_cp, our_mv = simulate(s, lengths, ours, args.interval, reprefill)
        pool, _ = pooled_ms(s, lengths, step_ms)
        print(f"{s.name:20} {len(lengths):5d} {lengths.mean():6.0f} {lengths.max():6d} {bound / 1e3:8.1f} "
              f"{none / 1e3:8.1f} {ref / 1e3:8.1f} {our / 1e3:8.1f} {pool / 1e3:7.1f} "
              f"{none / bound:7.3f} {ref / bound:7.3f} {our / bound:7.3f} {pool / bound:7.3f} "
              f"{ref_mv:7d} {our_mv:7d} {ref_cp / 1e3:8.2f} {our_cp / 1e3:9.2f}")
        if len(lengths) <= s.engines * s.max_num_seqs:  # no waves: the bound is reachable in principle
            worst_ours = max(worst_ours, our / bound)
        worst_vs_pool = max(worst_vs_pool, our / pool)
        worst_vs_none = max(worst_vs_none, our / none)
        best_gain = max(best_gain, none / our)
    print(f"({time.perf_counter() - start:.0f} s) headline: ours/bound <= {worst_ours:.3f} without waves (goal 1.10), "
          f"ours/pool <= {worst_vs_pool:.3f}, ours/none <= {worst_vs_none:.3f} (goal <= 1), "
          f"best speed-up over none {best_gain:.2f}x")


if __name__ == "__main__":
    main()
