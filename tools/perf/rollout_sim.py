"""Decode steps of a rollout over lockstep vLLM data-parallel engines: a discrete-event simulation (no device).

Shared by benchmarks/rollout_sim.py (rebalancing policies against a bound) and tools/perf/timing.py (the
rollout phase of the step-time model). The model, all of it stated, none of it measured:
* N engines step in lockstep (vLLM DP synchronises every step), so a step costs the slowest engine's. The cost is
  a function of the largest captured-graph bucket in use (an engine running b sequences runs the smallest bucket
  >= b; vLLM captures no graph above max_num_seqs) and of the live KV tokens of the engine holding the most.
  An engine with nothing left idles; every running sequence gains one token a step.
* The batch of S = prompts x samples sequences is split contiguously over the engines (verl's DP chunking: the
  samples of a prompt land on the same engine). An engine runs at most `max_num_seqs` sequences at once (FIFO
  admission, the rest wait).
* Response lengths are long-tailed and correlated within a prompt: log L = mu + sp * z_prompt + ss * z_sample,
  clipped to [1, cap], with mu fitted (bisection) so that the clipped mean hits the target.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

POWERS = tuple(2**k for k in range(10))  # 1 .. 512: the graph buckets of an engine that captures powers of two
StepMs = Callable[[int, float], float]  # (bucket of the busiest engine, live KV tokens of the fullest) -> ms


@dataclass(frozen=True)
class Scenario:
    name: str
    engines: int
    prompts: int
    samples: int
    mean: float  # mean response tokens (of the clipped distribution)
    cap: int  # max response tokens
    max_num_seqs: int
    prompt_len: int = 512
    sigma_prompt: float = 0.6
    sigma_sample: float = 0.6
    buckets: tuple[int, ...] = POWERS  # captured decode batch sizes (those above max_num_seqs are never used)

    @property
    def graph_buckets(self) -> list[int]:
        """vLLM captures graphs up to max_num_seqs: a load beyond it is served in waves."""
        return [b for b in self.buckets if b <= self.max_num_seqs] or [self.max_num_seqs]


def bucket_of(batch: int, buckets: list[int]) -> int:
    """The captured batch size a decode step of `batch` sequences runs (0 when idle; the batch itself above every
    bucket, run eagerly). The rebalancing plan (verl/workers/rollout/rebalance/plan.py) uses the same rule."""
    if batch <= 0:
        return 0
    return next((b for b in buckets if b >= batch), batch)


def response_lengths(s: Scenario, rng: np.random.Generator) -> np.ndarray:
    """Long-tailed lengths, prompt-major (the samples of a prompt adjacent), clipped mean ~ s.mean; every length
    is the cap when s.mean is the cap (forced lengths, ignore_eos)."""
    if s.mean >= s.cap:
        return np.full(s.prompts * s.samples, s.cap, dtype=np.int64)

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


class Rollout:
    """Engines with FIFO admission; sequences decode one token per lockstep step. Per engine it keeps the sums
    that give its live KV tokens (prompt + generated of every running sequence) at any step."""

    def __init__(self, s: Scenario, lengths: np.ndarray):
        self.s, self.lengths, self.buckets = s, lengths, s.graph_buckets
        self.done_tokens = np.zeros(len(lengths), dtype=np.int64)  # generated before `since`
        self.since = np.zeros(len(lengths), dtype=np.int64)  # step it last started running here
        self.version = np.zeros(len(lengths), dtype=np.int64)  # invalidates finish events on a move
        per = len(lengths) // s.engines
        self.running = [dict() for _ in range(s.engines)]  # seq -> admission order
        self.waiting = [deque(range(e * per, (e + 1) * per)) for e in range(s.engines)]
        self.owner = [q // per for q in range(len(lengths))]
        self.count = np.zeros(s.engines, dtype=np.int64)  # running sequences
        self.kv_base = np.zeros(s.engines, dtype=np.int64)  # sum of (prompt + done - since) over running seqs
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
        self.count[engine] += 1
        self.kv_base[engine] += self.s.prompt_len + self.done_tokens[seq] - self.now
        finish = self.now + int(self.lengths[seq] - self.done_tokens[seq])
        heapq.heappush(self.finishes, (finish, seq, int(self.version[seq])))

    def stop(self, engine: int, seq: int) -> None:
        """Take a running sequence off its engine, keeping what it generated."""
        self.kv_base[engine] -= self.s.prompt_len + self.done_tokens[seq] - self.since[seq]
        self.count[engine] -= 1
        self.done_tokens[seq] = self.generated(seq)
        self.version[seq] += 1
        del self.running[engine][seq]

    def next_finish(self) -> int:
        while self.finishes and self.finishes[0][2] != self.version[self.finishes[0][1]]:
            heapq.heappop(self.finishes)
        return self.finishes[0][0]

    def finish_due(self) -> None:
        touched = set()
        while self.next_finish() == self.now:
            _, seq, _ = heapq.heappop(self.finishes)
            engine = self.owner[seq]
            self.kv_base[engine] -= self.s.prompt_len + self.done_tokens[seq] - self.since[seq]
            self.count[engine] -= 1
            del self.running[engine][seq]
            touched.add(engine)
            self.left -= 1
            if not self.left:
                return
        for e in sorted(touched):
            self.admit(e)

    def batch(self) -> int:
        return int(self.count.max())

    def kv_tokens(self, steps: int) -> float:
        """Live KV tokens of the fullest engine, averaged over the next `steps` steps."""
        return float((self.kv_base + self.count * (self.now + (steps - 1) / 2)).max())

    def loads(self) -> list[int]:
        return [len(r) + len(w) for r, w in zip(self.running, self.waiting, strict=True)]


def decode(rollout: Rollout, step_ms: StepMs, interval: int = 0,
           on_check: Callable[[Rollout], float] | None = None) -> float:
    """Makespan in ms of the rollout's decode. With `on_check`, it is called every `interval` steps while sequences
    are left (a rebalancing policy) and returns the ms it cost (counted in the makespan)."""
    makespan, next_check = 0.0, interval
    while rollout.left:
        event = min(rollout.next_finish(), next_check) if on_check else rollout.next_finish()
        steps = event - rollout.now
        if steps:
            makespan += steps * step_ms(bucket_of(rollout.batch(), rollout.buckets), rollout.kv_tokens(steps))
        rollout.now = event
        rollout.finish_due()
        if on_check and event == next_check and rollout.left:
            next_check += interval
            makespan += on_check(rollout)
    return makespan


def pooled_ms(s: Scenario, lengths: np.ndarray, step_ms: StepMs) -> tuple[float, int]:
    """The best a policy that does not know lengths can approach: one FIFO queue feeding all N x max_num_seqs
    slots, the running sequences spread perfectly at every step, moves free (the limit of rebalancing).
    Returns its makespan (ms) and steps."""
    buckets, slots = s.graph_buckets, s.engines * s.max_num_seqs
    finishes = [(int(n), 0) for n in lengths[:slots]]  # (finish step, start step)
    heapq.heapify(finishes)
    now, makespan, queued = 0, 0.0, deque(int(n) for n in lengths[slots:])
    context = float(s.prompt_len * len(finishes))  # live KV tokens of all engines together
    while finishes:
        event, live = finishes[0][0], len(finishes)
        kv = (context + live * (event - now - 1) / 2) / s.engines
        makespan += (event - now) * step_ms(bucket_of(math.ceil(live / s.engines), buckets), kv)
        context += live * (event - now)
        now = event
        while finishes and finishes[0][0] == now:
            _, start = heapq.heappop(finishes)
            context -= s.prompt_len + now - start
            if queued:
                heapq.heappush(finishes, (now + queued.popleft(), now))
                context += s.prompt_len
    return makespan, now


def lower_bound_ms(lengths: np.ndarray, engines: int, max_num_seqs: int, fixed_ms: float, per_seq_ms: float) -> float:
    """Any policy, even with free migration, for steps costing fixed_ms + per_seq_ms x batch: a step costs at
    least fixed_ms + per_seq_ms x (batch of its busiest engine) >= fixed_ms + per_seq_ms x r / N with r running in
    all; in K steps at most P(K) = min(K x N x max_num_seqs, sum_i min(L_i, K)) tokens are decoded, so with T
    tokens in all the bound is fixed_ms x K_min + per_seq_ms x T / N (K_min the smallest K with P(K) >= T)."""
    total, slots = int(lengths.sum()), engines * max_num_seqs
    lo, hi = int(lengths.max()), int(lengths.max()) + total // slots + 1
    while lo < hi:
        k = (lo + hi) // 2
        if min(k * slots, int(np.minimum(lengths, k).sum())) >= total:
            hi = k
        else:
            lo = k + 1
    return fixed_ms * lo + per_seq_ms * total / engines
