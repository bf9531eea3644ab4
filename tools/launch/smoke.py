"""The recipe end to end on this machine's CPUs: tiny model, synthetic data, a few GRPO steps.

  python -m tools.launch.smoke                 # 3 steps (what `nox -s smoke` runs)
  python -m tools.launch.smoke --steps 20      # watch the reward
  python -m tools.launch.smoke --dry-run       # prepare nothing, print the launcher's plan

Inputs are made once and reused (under --work, default .cache/smoke): a random-init DeepSeek-V3-architecture
model with a local tokenizer (`python -m tools.weights make-tiny`) and easy arithmetic problems in the deepscaler
parquet schema (`python -m tools.data synthetic-arith`). Each is written to a `.partial` folder and renamed when
complete, so an interrupted preparation is redone, never half-used. Then `python -m tools.launch` runs
recipes/deepseek_r1/configs/cpu-tiny.yaml with a local Ray cluster it starts and stops, and prints the
per-step summary. Extra key=value arguments are launcher overrides (e.g. data.train_batch_size=4).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "recipes/deepseek_r1/configs/cpu-tiny.yaml"
MODEL, DATA = "tiny", "arith"  # folders under --work
# Easy problems (sums of two numbers up to 20): the strict reward gives a tiny model a reachable target.
ARITH_ARGS = ("--n", "2000", "--ops", "+", "--max-operand", "20", "--max-terms", "2")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.launch.smoke", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="launcher (OmegaConf) overrides")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps (trainer.total_training_steps; default 3)")
    p.add_argument("--work", type=Path, default=ROOT / ".cache/smoke", help="where the model and data are made")
    p.add_argument("--logs", type=Path, default=ROOT / "logs", help="where run folders go (default logs/)")
    p.add_argument("--run-id", help="run name (default cpu-tiny-<UTC time>)")
    p.add_argument("--dry-run", action="store_true", help="make nothing, run nothing: the launcher's plan")
    return p


def complete(dst: Path, make) -> Path:
    """Run make(partial_dir) unless dst exists; rename the finished folder to dst."""
    if dst.is_dir():
        return dst
    partial = dst.with_name(dst.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    make(partial)
    partial.rename(dst)
    return dst


def prepare(work: Path, say=print) -> tuple[Path, Path]:
    """The tiny model and the arithmetic data under `work` (made once)."""
    from tools.data.cli import main as data_main
    from tools.weights.tiny import make_tiny

    def model(dst: Path) -> None:
        say(f"making the tiny model in {dst.with_suffix('')}")
        make_tiny(dst)

    def data(dst: Path) -> None:
        say(f"making the arithmetic data in {dst.with_suffix('')}")
        if data_main(["synthetic-arith", "--dst", str(dst), *ARITH_ARGS]) != 0:
            raise SystemExit("synthetic-arith failed (its message is above)")

    return complete(work / MODEL, model), complete(work / DATA, data)


def launcher_args(args: argparse.Namespace, model: Path, data: Path) -> list[str]:
    out = [str(CONFIG), f"actor_rollout_ref.model.path={model}", f"data.train_files={data / 'train.parquet'}",
           f"data.val_files={data / 'test.parquet'}", f"trainer.total_training_steps={args.steps}",
           *args.overrides, "--master-addr", "127.0.0.1", "--logs", str(args.logs)]
    if args.run_id:
        out += ["--run-id", args.run_id]
    if args.dry_run:
        out.append("--dry-run")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_intermixed_args(argv)
    if args.steps < 1:
        print(f"error: --steps is {args.steps}; give 1 or more", file=sys.stderr)
        return 2
    from tools.launch.cli import main as launch

    model, data = (args.work / MODEL, args.work / DATA) if args.dry_run else prepare(args.work)
    return launch(launcher_args(args, model, data))


if __name__ == "__main__":
    sys.exit(main())
