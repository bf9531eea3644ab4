"""Throughput of a GRPO step, with the reference recipe's definitions (pure functions).

- system TPS per card = (prompt + response tokens of all samples) / (step time x cards)
- system TPS per die  = the same over dies (an Atlas A3 card has 2 dies)
- rollout TPS per card = response tokens / (rollout time x cards)
- train TPS per card   = all tokens / (update time x cards)
verl's own `perf/throughput` divides by the number of devices it sees (dies on A3): it is the per-die figure,
half the per-card one. Reference check: 8192 x (77.8 + 1576.6) / 859.68 / 128 = 123.16 per card, 61.58 per die.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("rollout", "old_log_prob", "ref", "reward", "adv", "update", "reshard", "offload")
# verl's timing_s/<name> keys (ray_trainer's marked_timer; the same names since 0.4.0) for our phase names; reshard
# and offload come from our forks (timing_s/reshard, timing_s/offload) and are 0 until then.
VERL_TIMERS = {"rollout": "gen", "old_log_prob": "old_log_prob", "ref": "ref", "reward": "reward", "adv": "adv",
               "update": "update_actor", "reshard": "reshard", "offload": "offload"}


@dataclass(frozen=True)
class StepStats:
    samples: int                    # prompts x n
    mean_prompt_tokens: float
    mean_response_tokens: float
    step_s: float
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def tokens(self) -> float:
        return self.samples * (self.mean_prompt_tokens + self.mean_response_tokens)

    @property
    def response_tokens(self) -> float:
        return self.samples * self.mean_response_tokens


def system_tps_per_card(s: StepStats, cards: int) -> float:
    return s.tokens / (s.step_s * cards)


def system_tps_per_die(s: StepStats, cards: int, dies_per_card: int = 2) -> float:
    return s.tokens / (s.step_s * cards * dies_per_card)


def rollout_tps_per_card(s: StepStats, cards: int) -> float:
    return s.response_tokens / (s.phases["rollout"] * cards)


def train_tps_per_card(s: StepStats, cards: int) -> float:
    return s.tokens / (s.phases["update"] * cards)


def verl_throughput(s: StepStats, devices: int) -> float:
    """What verl logs as perf/throughput: tokens / (step time x devices); on A3 devices are dies."""
    return s.tokens / (s.step_s * devices)


def from_verl(metrics: dict, samples: int) -> StepStats:
    """A StepStats from one step of verl's logged metrics (response_length/mean, timing_s/*)."""
    phases = {p: float(metrics.get(f"timing_s/{VERL_TIMERS[p]}", 0.0)) for p in PHASES}
    return StepStats(samples, float(metrics["prompt_length/mean"]), float(metrics["response_length/mean"]),
                     float(metrics["timing_s/step"]), phases)


def report(s: StepStats, cards: int, dies_per_card: int = 2) -> list[tuple[str, float]]:
    rows = [("system TPS per card", system_tps_per_card(s, cards)),
            ("system TPS per die", system_tps_per_die(s, cards, dies_per_card))]
    if s.phases.get("rollout"):
        rows.append(("rollout TPS per card", rollout_tps_per_card(s, cards)))
    if s.phases.get("update"):
        rows.append(("train TPS per card", train_tps_per_card(s, cards)))
    rows += [(f"{p} time (s)", s.phases.get(p, 0.0)) for p in PHASES]
    return rows
