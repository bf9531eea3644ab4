"""The end-of-run summary: verl's per-step metrics read back from the run's TensorBoard events.

verl logs every step's metrics to TensorBoard when `trainer.logger` has `tensorboard` (the launcher points
TENSORBOARD_DIR at <run dir>/tensorboard). Reading them back, rather than parsing console lines, gives the
exact logged values; the same table serves the A3 run and the CPU smoke run.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from tools.report import metrics

REWARD = "critic/score/mean"  # verl's mean sequence score (our reward: 1 correct, 0 otherwise)
# verl's validation (trainer.val_before_train, trainer.test_freq): the mean score of val_kwargs.n samples per held-out
# prompt, one tag per data source (`acc` where a reward returns it, else `reward`)
VAL_TAG = re.compile(r"^val-core/[^/]+/(acc|reward)/mean@\d+$")
VAL_ACCURACY = "val accuracy"


@dataclass(frozen=True)
class Step:
    step: int
    values: dict[str, float]

    @property
    def reward(self) -> float:
        return self.values.get(REWARD, math.nan)

    @property
    def val_accuracy(self) -> float:
        """The held-out accuracy validated at this step (the mean over data sources), NaN where none ran."""
        found = [v for tag, v in self.values.items() if VAL_TAG.match(tag)]
        return sum(found) / len(found) if found else math.nan


def read_steps(tb_dir: Path) -> list[Step]:
    """Every step's scalars from the TensorBoard event files under `tb_dir`, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    by_step: dict[int, dict[str, float]] = {}
    for events in sorted(Path(tb_dir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})  # 0: keep every point
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            for point in acc.Scalars(tag):
                by_step.setdefault(point.step, {})[tag] = point.value
    return [Step(s, by_step[s]) for s in sorted(by_step)]


def throughput(step: Step, samples: int, cards: int, dies_per_card: int) -> list[tuple[str, float]]:
    """The A3 run's metric lines (tools/report/metrics.py) for one step; empty when verl logged no timings."""
    try:
        stats = metrics.from_verl(step.values, samples)
    except KeyError:
        return []
    return metrics.report(stats, cards, dies_per_card)


# Columns of metrics that only some paths log: the rollout-versus-update log-prob drift, where the rollout returns its
# log-probs (verl's rollout_corr metrics, trainer/ppo/rollout_corr_helper.py: per sequence, the mean log-prob of the
# rollout minus the update's), and the weight sync's checksum, where the sync is verified (verl series).
OPTIONAL_COLUMNS = (("logprob diff |seq|", "rollout_corr/log_ppl_abs_diff"),
                    ("logprob diff seq max", "rollout_corr/log_ppl_diff_max"),
                    ("rollout kl", "rollout_corr/kl"),
                    ("sync mismatches", "rollout/weight_sync_mismatches"),
                    # the manual lifecycle on vLLM: the KV cache freed after the rollout, re-created before the next
                    ("kv freed (MiB)", "rollout/kv_cache_freed_mib"),
                    ("kv made (MiB)", "rollout/kv_cache_mib"),
                    ("kv freed rss (MiB)", "rollout/kv_cache_freed_rss_mib"))
# The rollout rebalance's figures, where a profile turns it on, in a table of their own: per engine, averaged over
# the engines that report (verl/workers/rollout/rebalance/loop.py:rebalance_metrics). The makespan in engine steps
# goes beside its yardsticks, the same on every engine: the busiest engine's own samples decoded there unmoved, and
# the fewest steps any placement needs (the longest answer, or all tokens over all engines' slots). The yardsticks
# count one decode step a token; the makespan also counts the steps of the prompts' (chunked) prefill.
REBALANCE_COLUMNS = (("moved", "rollout/rebalance/moved"),
                     ("failed", "rollout/rebalance/failed"),
                     ("kv bytes sent", "rollout/rebalance/kv_bytes_sent"),
                     ("busy (s)", "rollout/rebalance/busy_s"),
                     ("idle (s)", "rollout/rebalance/idle_s"),
                     ("makespan (s)", "rollout/rebalance/makespan_s"),
                     ("makespan (steps)", "rollout/rebalance/steps"),
                     ("unmoved (steps)", "rollout/rebalance/largest_load_steps"),
                     ("bound (steps)", "rollout/rebalance/lower_bound_steps"))
# every engine's busy seconds (rollout/rebalance/engine_busy_s/<engine>): the busiest and the idlest in the table
ENGINE_BUSY = "rollout/rebalance/engine_busy_s/"
ENGINE_BUSY_COLUMNS = ("busiest (s)", "idlest (s)")
REBALANCE_TITLE = ("rollout rebalance per step (busy, idle: an engine's mean; unmoved: the busiest engine's own samples"
                   " decoded there; bound: what no placement beats; both count a step a token, the makespan also the"
                   " prefill's steps)")


def engine_busy(values: dict[str, float]) -> dict[str, float]:
    busy = [v for k, v in values.items() if k.startswith(ENGINE_BUSY)]
    return dict(zip(ENGINE_BUSY_COLUMNS, (max(busy), min(busy)), strict=True)) if busy else {}


def table(steps: list[Step], samples: int, cards: int, dies_per_card: int) -> list[dict[str, float]]:
    """One row per step: reward, response length, step time, TPS per card and per die, phase times."""
    rows = []
    for s in steps:
        row = {"step": s.step, "reward mean": s.reward, VAL_ACCURACY: s.val_accuracy,
               "response length": s.values.get("response_length/mean", math.nan),
               "step time (s)": s.values.get("timing_s/step", math.nan)}
        row.update(throughput(s, samples, cards, dies_per_card))
        row.update({name: s.values[tag] for name, tag in OPTIONAL_COLUMNS + REBALANCE_COLUMNS if tag in s.values})
        row.update(engine_busy(s.values))
        rows.append(row)
    return rows


def render(rows: list[dict[str, float]], run_dir: Path, tb_dir: Path) -> str:
    """The summary as text: a rich table of the main columns, one of the checks a path logs, then where the run's
    files are."""
    from rich.console import Console

    columns = ["step", "reward mean", VAL_ACCURACY, "response length", "step time (s)", "system TPS per card",
               "system TPS per die", "rollout time (s)", "ref time (s)", "update time (s)"]
    # the A3 path's reshard and offload phases (0 elsewhere)
    columns += [c for c in ("reshard time (s)", "offload time (s)") if any(r.get(c, 0) for r in rows)]
    # what only some paths log (the log-prob drift, the sync check, the KV cache), in a second table of checks
    rebalance_names = [name for name, _ in REBALANCE_COLUMNS] + list(ENGINE_BUSY_COLUMNS)
    checks, rebalance = (["step"] + [name for name in names if any(name in r for r in rows)]
                         for names in ([name for name, _ in OPTIONAL_COLUMNS], rebalance_names))
    console = Console(width=240, record=True, force_terminal=False)
    with console.capture() as cap:
        trained = sum(r["step"] > 0 for r in rows)  # step 0: the validation before training, when it runs
        console.print(_table(f"run summary: {trained} step(s)", columns, rows))
        if len(checks) > 1:
            console.print(_table("checks per step", checks, rows))
        if len(rebalance) > 1:
            console.print(_table(REBALANCE_TITLE, rebalance, rows))
    lines = [cap.get().rstrip()]
    rewards = [r["reward mean"] for r in rows if not math.isnan(r["reward mean"])]
    if len(rewards) >= 2:
        lines.append(f"reward mean: first {rewards[0]:.3f}, last {rewards[-1]:.3f}, best {max(rewards):.3f}")
    vals = [(r["step"], r[VAL_ACCURACY]) for r in rows if not math.isnan(r[VAL_ACCURACY])]
    if vals:
        (first, before), (last, after) = vals[0], vals[-1]
        lines.append(f"val accuracy (held-out): step {first} {before:.3f}, step {last} {after:.3f}")
    lines += [f"logs: {run_dir}/ (trainer.log, config.yaml, verl.yaml, summary.json, curves.png)",
              f"tensorboard: tensorboard --logdir {tb_dir}"]
    return "\n".join(lines) + "\n"


def _table(title: str, columns: list[str], rows: list[dict[str, float]]):
    from rich.table import Table

    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(*[_cell(r.get(c, math.nan)) for c in columns])
    return t


def _cell(v) -> str:
    if isinstance(v, int):
        return str(v)
    return "-" if v is None or math.isnan(v) else f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"


def write(rows: list[dict[str, float]], path: Path) -> None:
    """summary.json: the rows as logged (NaN as null), written whole or not at all."""
    clean = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(clean, indent=1) + "\n")
    tmp.replace(path)
