"""`python -m tools.weights`: checkpoint conversion for DeepSeek-V3/R1 (argument parsing only).

Each command lives in its own module, which registers its sub-parser and sets `func`.
"""

from __future__ import annotations

import argparse
import sys

from tools.model.errors import ConfigError
from tools.weights import convert_cli, fp8, tiny_cli, warm_start_cli
from tools.weights.io import CheckpointError

DESCRIPTION = """\
Prepare DeepSeek-V3/R1 weights for the recipe.

  python -m tools.weights fp8-to-bf16 --src DeepSeek-V3 --dst DeepSeek-V3-bf16
  python -m tools.weights hf-to-mcore --src DeepSeek-V3-bf16 --dst dist_ckpt/     # torch_dist, any layout
  python -m tools.weights hf-to-mcore --src DeepSeek-V3-bf16 --dst ckpt/ --format legacy \\
      --tp 4 --pp 8 --ep 8 --num-layer-list 7,7,8,8,8,8,8,7 --moe-tp-extend-ep
  python -m tools.weights verify --src DeepSeek-V3-bf16 --converted ckpt/ --sample 64
  python -m tools.weights make-tiny --dst tiny/ [--fp8]
  python -m tools.weights warm-start --src tiny/ --train arith/train.parquet --dst tiny-warm/   # SFT, the RL start

Outputs are written atomically with a manifest.json (sha256 per file); --resume continues an
interrupted run, verifying and skipping finished files (torch_dist is one unit: it appears only when
complete, and an interrupted run starts over). Exit codes: 0 ok, 1 verification found a
mismatch, 2 bad input or usage: one line that names the file and what is wrong with it.
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.weights", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (fp8, convert_cli, tiny_cli, warm_start_cli):
        module.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CheckpointError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file the readers (tools/weights/files.py) do not see: a destination, mostly
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
