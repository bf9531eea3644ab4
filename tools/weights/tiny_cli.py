"""`make-tiny` command: see tools.weights.tiny."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tools.weights.tiny import make_tiny


def register(sub) -> None:
    p = sub.add_parser("make-tiny", help="write a small random DeepSeek-V3-architecture HF checkpoint",
                       description=__doc__.split(":")[0] + ": real key names and layouts, small odd sizes; bf16,"
                       " or FP8 with block scales (--fp8).")
    p.add_argument("--dst", type=Path, required=True, help="output directory")
    p.add_argument("--fp8", action="store_true", help="block-quantised float8_e4m3fn weights with _scale_inv")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=2, help="number of safetensors shards")
    p.add_argument("--split-scales", action="store_true", help="put every _scale_inv in a shard of its own")
    p.add_argument("--no-tokenizer", action="store_true", help="leave out the local character-level tokenizer")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="override a config field, e.g. --set num_hidden_layers=6 --set n_routed_experts=16")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    tensors = make_tiny(args.dst, fp8=args.fp8, overrides=overrides, seed=args.seed, shards=args.shards,
                        split_scales=args.split_scales, tokenizer=not args.no_tokenizer)
    print(f"wrote {args.dst}: {len(tensors)} tensors ({'fp8' if args.fp8 else 'bf16'})")
    return 0
