"""`warm-start` command: see tools.weights.warm_start."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from tools.weights import warm_start

EPILOG = """\
Typical use (what `nox -s smoke` does, with its own sizes):

  python -m tools.data synthetic-arith --dst arith/ --n 441 --ops + --max-operand 20 --max-terms 2 --unique \\
      --test-ratio 0.15 --instruction 'Answer in \\boxed{}.'
  python -m tools.weights make-tiny --dst tiny/
  python -m tools.weights warm-start --src tiny/ --train arith/train.parquet --held-out arith/test.parquet \\
      --dst tiny-warm/

The output appears only when complete (written to DST.partial, then renamed); an existing DST is refused.
"""


def register(sub) -> None:
    p = sub.add_parser("warm-start", help="fine-tune a small HF checkpoint on a task's \\boxed{} answers (SFT)",
                       description=warm_start.__doc__.split("\n\n")[0].split(": ", 1)[1].capitalize() + "\n\n" + EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, required=True, help="the HF checkpoint to start from (e.g. make-tiny's)")
    p.add_argument("--train", type=Path, required=True, help="train.parquet written by python -m tools.data")
    p.add_argument("--held-out", type=Path, help="test.parquet: greedy accuracy before and after, in the report")
    p.add_argument("--dst", type=Path, required=True, help="output directory (must not exist)")
    for f in fields(warm_start.Settings):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                       help=f"{f.metadata['help']} (default {f.default})".replace("%", "%%"))  # argparse formats
    p.add_argument("--dry-run", action="store_true", help="check the inputs and settings; train and write nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = warm_start.Settings(**{f.name: getattr(args, f.name) for f in fields(warm_start.Settings)})
    if args.dry_run:
        rows = len(warm_start.check_inputs(args.src, args.train, args.dst, settings, args.held_out))
        print(f"dry run: would fine-tune {args.src} for {settings.steps} steps of {settings.batch_size} on {rows} rows"
              f" of {args.train} and write {args.dst}; nothing written")
        return 0
    report = warm_start.warm_start(args.src, args.train, args.dst, settings, held_out=args.held_out)
    print(f"wrote {args.dst}: final loss {report['loss'][-1]:.3f} ({warm_start.REPORT} has the curve)")
    return 0
