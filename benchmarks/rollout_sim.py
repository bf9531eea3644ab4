"""Rollout makespan across vLLM data-parallel engines, with and without rebalancing: a discrete-event
simulation (no GPU) of the plan in verl/workers/rollout/rebalance/plan.py against the reference's rule.

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
import heapq
import importlib.util
import math
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PLAN_PATH = ROOT / "third_party/verl/verl/workers/rollout/rebalance/plan.py"

A_MS, C_MS = 30.0, 0.12
POWERS = [2**k for k in range(10)]  # 1 .. 512
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


@dataclass(frozen=True)
class Scenario:
    name: str
    engines: int
    prompts: int
    samples: int
    mean: float
    cap: int
    max_num_seqs: int
    prompt_len: int = 512
    sigma_prompt: float = 0.6
    sigma_sample: float = 0.6


SCENARIOS = [
    Scenario("3K  N=64", 64, 512, 16, 1576, 3072, 256),
    Scenario("3K  N=128", 128, 512, 16, 1576, 3072, 256),
    Scenario("32K N=64", 64, 512, 16, 9000, 32768, 256),
    Scenario("32K N=128", 128, 512, 16, 9000, 32768, 256),
    Scenario("32K N=64 seqs<=64", 64, 512, 16, 9000, 32768, 64),  # KV-bound: engines run in waves
    Scenario("32K N=128 seqs<=32", 128, 512, 16, 9000, 32768, 32),
]


def graph_buckets(s: Scenario) -> list[int]:
    """vLLM captures graphs up to max_num_seqs: a load beyond it is served in waves."""
    return [b for b in POWERS if b <= s.max_num_seqs]


def step_ms(batch: int, buckets: list[int]) -> float:
    return A_MS + C_MS * plan.bucket_of(batch, buckets) if batch else 0.0


def kv_blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def response_lengths(s: Scenario, rng: np.random.Generator) -> np.ndarray:
    """Long-tailed lengths, prompt-major (the samples of a prompt adjacent), clipped mean ~ s.mean."""
    def draw(mu, z_prompt, z_sample):
        raw = np.exp(mu + s.sigma_prompt * z_prompt[:, None] + s.sigma_sample * z_sample)
        return np.clip(np.rint(raw), 1, s.cap).astype(np.int64).ravel()

    fit = np.random.default_rng(12345)
    zp, zs = fit.standard_normal(4096), fit.standard_normal((4096, s.samples))
    lo, hi = 0.0, math.log(s.cap) + 3
    for _ in range(60):  # the clipped mean grows with mu
        mu = (lo + hi) / 2
        lo, hi = (mu, hi) if draw(mu, zp, zs).mean() < s.mean else (lo, mu)
    return draw(mu, rng.standard_normal(s.prompts), rng.standard_normal((s.prompts, s.samples)))


def lower_bound_ms(lengths: np.ndarray, engines: int, max_num_seqs: int) -> float:
    """A * K_min + C * T / N (module docstring): K_min by bisection on the concave P(K)."""
    total, slots = int(lengths.sum()), engines * max_num_seqs
    lo, hi = int(lengths.max()), int(lengths.max()) + total // slots + 1
    while lo < hi:
        k = (lo + hi) // 2
        if min(k * slots, int(np.minimum(lengths, k).sum())) >= total:
            hi = k
        else:
            lo = k + 1
    return A_MS * lo + C_MS * total / engines


def pooled_ms(s: Scenario, lengths: np.ndarray) -> float:
    """The best a policy that does not know lengths can approach: one FIFO queue feeding all N x
    max_num_seqs slots, the running sequences spread perfectly at every step, moves free."""
    buckets, slots = graph_buckets(s), s.engines * s.max_num_seqs
    finishes = [int(n) for n in lengths[:slots]]
    heapq.heapify(finishes)
    now, makespan, queued = 0, 0.0, deque(int(n) for n in lengths[slots:])
    while finishes:
        event = finishes[0]
        makespan += (event - now) * step_ms(math.ceil(len(finishes) / s.engines), buckets)
        now = event
        while finishes and finishes[0] == now:
            heapq.heappop(finishes)
            if queued:
                heapq.heappush(finishes, now + queued.popleft())
    return makespan


class Rollout:
    """Engines with FIFO admission; sequences decode one token per lockstep step."""

    def __init__(self, s: Scenario, lengths: np.ndarray):
        self.s, self.lengths, self.buckets = s, lengths, graph_buckets(s)
        self.done_tokens = np.zeros(len(lengths), dtype=np.int64)  # generated before `since`
        self.since = np.zeros(len(lengths), dtype=np.int64)  # step it last started running here
        self.version = np.zeros(len(lengths), dtype=np.int64)  # invalidates finish events on a move
        per = len(lengths) // s.engines
        self.running = [dict() for _ in range(s.engines)]  # seq -> admission order
        self.waiting = [deque(range(e * per, (e + 1) * per)) for e in range(s.engines)]
        self.finishes: list[tuple[int, int, int]] = []
        self.now, self.left, self.order = 0, len(lengths), 0
        for e in range(s.engines):
            self.admit(e)

    def generated(self, seq: int) -> int:
        return int(self.done_tokens[seq] + self.now - self.since[seq])

    def admit(self, engine: int) -> None:
        while self.waiting[engine] and len(self.running[engine]) < self.s.max_num_seqs:
            self.start(engine, self.waiting[engine].popleft())

    def start(self, engine: int, seq: int) -> None:
        self.since[seq], self.order = self.now, self.order + 1
        self.running[engine][seq] = self.order
        finish = self.now + int(self.lengths[seq] - self.done_tokens[seq])
        heapq.heappush(self.finishes, (finish, seq, int(self.version[seq])))

    def stop(self, engine: int, seq: int) -> None:
        """Take a running sequence off its engine, keeping what it generated."""
        self.done_tokens[seq] = self.generated(seq)
        self.version[seq] += 1
        del self.running[engine][seq]

    def next_finish(self) -> int:
        while self.finishes and self.finishes[0][2] != self.version[self.finishes[0][1]]:
            heapq.heappop(self.finishes)
        return self.finishes[0][0]

    def finish_due(self, owner: list[int]) -> None:
        touched = set()
        while self.next_finish() == self.now:
            _, seq, _ = heapq.heappop(self.finishes)
            del self.running[owner[seq]][seq]
            touched.add(owner[seq])
            self.left -= 1
            if not self.left:
                return
        for e in sorted(touched):
            self.admit(e)

    def batch(self) -> int:
        return max(len(r) for r in self.running)

    def loads(self) -> list[int]:
        return [len(r) + len(w) for r, w in zip(self.running, self.waiting, strict=True)]

    def engine_loads(self) -> tuple[list, list[list[int]]]:
        """What each engine reports: EngineLoad, and its running sequences in report order."""
        capacity = self.s.max_num_seqs * kv_blocks(self.s.prompt_len + self.s.cap)
        reports, orders = [], []
        for running, waiting in zip(self.running, self.waiting, strict=True):
            seqs = sorted(running, key=running.get)
            blocks = tuple(kv_blocks(self.s.prompt_len + self.generated(q)) for q in seqs)
            reports.append(plan.EngineLoad(len(seqs), len(waiting), sum(blocks), capacity, blocks))
            orders.append(seqs)
        return reports, orders


def ours(rollout: Rollout) -> list[tuple[int, int, list[int], int]]:
    """(src, dst, running seqs, waiting count) from plan_rebalance."""
    reports, orders = rollout.engine_loads()
    moves = plan.plan_rebalance(reports, rollout.buckets, KV_CAP).moves
    return [(m.src, m.dst, [orders[m.src][i] for i in m.seqs], m.waiting) for m in moves]


def reference(rollout: Rollout) -> list[tuple[int, int, list[int], int]]:
    """Average-load bucket; excess from the back of each donor's running list, receivers in rank order."""
    reports, orders = rollout.engine_loads()
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


def apply_moves(rollout: Rollout, moves, owner: list[int], reprefill_tok_per_ms: float | None = None
                ) -> tuple[float, int]:
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
            owner[seq] = dst
        for _ in range(waiting):
            seq = rollout.waiting[src].pop()  # the last in the donor's queue
            rollout.waiting[dst].append(seq)
            owner[seq] = dst
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
    per = len(lengths) // s.engines
    owner = [q // per for q in range(len(lengths))]
    makespan = copying = 0.0
    moved, next_check = 0, interval
    while rollout.left:
        event = min(rollout.next_finish(), next_check) if policy else rollout.next_finish()
        makespan += (event - rollout.now) * step_ms(rollout.batch(), rollout.buckets)
        rollout.now = event
        rollout.finish_due(owner)
        if policy and event == next_check and rollout.left:
            next_check += interval
            count_target = plan.bucket_of(math.ceil(rollout.left / s.engines), rollout.buckets)
            if plan.largest_bucket(rollout.loads(), rollout.buckets) > count_target:  # else nothing to gain
                ms, n = apply_moves(rollout, policy(rollout), owner, reprefill_tok_per_ms)
                makespan, copying, moved = makespan + ms, copying + ms, moved + n
    return makespan, copying, moved


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
        bound = lower_bound_ms(lengths, s.engines, s.max_num_seqs)
        none, _, _ = simulate(s, lengths, None, args.interval)
        ref, ref_cp, ref_mv = simulate(s, lengths, reference, args.interval, reprefill)
        our, our_cp, our_mv = simulate(s, lengths, ours, args.interval, reprefill)
        pool = pooled_ms(s, lengths)
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
