"""Learning curves: the reward mean and the held-out validation accuracy per step, drawn from runs' TensorBoard events.

Every run saves its own (`logs/<run>/curves.png`, by the launcher at the end). Several runs (seeds of one setting)
can be drawn together:

  python -m tools.report.curves logs/cpu-tiny-fsdp-s0 logs/cpu-tiny-fsdp-s1 logs/cpu-tiny-fsdp-s2 \\
      --out docs/smoke-curves.png --title "nox -s smoke -- --profile fsdp --steps 30"
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from tools.report import summary

REWARD, VAL = "reward mean", summary.VAL_ACCURACY


def series(rows: list[dict[str, float]], column: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one column, leaving out the steps that did not log it."""
    points = [(r["step"], r[column]) for r in rows if r.get(column) is not None and not math.isnan(r[column])]
    return [s for s, _ in points], [v for _, v in points]


def ylim_top(peak: float) -> float:
    """The y axis ends at 0.25, 0.5 or 1: a rise from 0.1 to 0.2 stays visible, and runs compare on a few scales."""
    return next(top for top in (0.25, 0.5, 1.0) if peak <= top)


def plot(runs: dict[str, list[dict[str, float]]], out: Path, title: str = "") -> Path:
    """One figure: per run, the reward mean of the training rollouts (line) and the validation accuracy (markers)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    peak = max((v for rows in runs.values() for col in (REWARD, VAL) for v in series(rows, col)[1]), default=1.0)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, rows) in enumerate(runs.items()):
        colour = colours[i % len(colours)]
        label = f"{name}: " if len(runs) > 1 else ""
        ax.plot(*series(rows, REWARD), color=colour, alpha=0.55, label=f"{label}reward mean (train rollouts)")
        ax.plot(*series(rows, VAL), color=colour, marker="o", linewidth=2,
                label=f"{label}validation accuracy (held-out)")
    ax.set(xlabel="step (0 = before training)", ylabel="fraction correct (strict \\boxed{} reward)",
           ylim=(0, ylim_top(peak)), title=title or ", ".join(runs))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")  # written whole, then renamed: never a half-drawn file
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(out)
    return out


def read_run(run_dir: Path) -> list[dict[str, float]]:
    """A run's rows, as the summary has them, from its TensorBoard events (no layout needed for these columns)."""
    steps = summary.read_steps(run_dir / "tensorboard")
    if not steps:
        raise FileNotFoundError(f"{run_dir}: no TensorBoard step metrics under {run_dir / 'tensorboard'}")
    return summary.table(steps, samples=1, cards=1, dies_per_card=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.report.curves", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR", help="run folders (logs/<run>)")
    p.add_argument("--out", type=Path, help="the PNG to write (default: RUN_DIR/curves.png for one run)")
    p.add_argument("--title", default="", help="the figure's title (default: the run names)")
    args = p.parse_args(argv)
    if args.out is None and len(args.runs) > 1:
        p.error("--out is needed with more than one run")
    try:
        runs = {r.name: read_run(r) for r in args.runs}
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"curves: {plot(runs, args.out or args.runs[0] / 'curves.png', args.title)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
