"""hf-to-mcore, mcore-to-hf and verify: argument parsing and the choice between the two formats."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tools.model.dims import dims_from_config
from tools.model.errors import ConfigError
from tools.model.parallel import ParallelLayout, checked
from tools.weights import legacy
from tools.weights.hf import load_config
from tools.weights.io import CheckpointError, ShardedReader, read_json, reader_spans, thread_count

LAYOUT_FLAGS = {"tp": "--tp", "pp": "--pp", "ep": "--ep", "num_layer_list": "--num-layer-list",
                "moe_tp_extend_ep": "--moe-tp-extend-ep"}


def register(sub) -> None:
    p = sub.add_parser(
        "hf-to-mcore", help="HF DeepSeek-V3 (bf16) -> Megatron checkpoint (torch_dist, or legacy rank files)",
        description="torch_dist (default): Megatron-core dist-checkpointing, which verl loads with"
        " megatron.use_dist_checkpointing=True and reshards at load (no layout to choose)."
        " legacy: the per-rank files MindSpeed-LLM loads, DIR/iter_0000001/mp_rank_{tp:02d}_{pp:03d}[_{ep:03d}]/"
        "model_optim_rng.pt and latest_checkpointed_iteration.txt, for the layout given by --tp/--pp/--ep."
        " Both write manifest.json (sha256 per file); every size comes from config.json.")
    p.add_argument("--src", type=Path, required=True, help="HF checkpoint directory (bf16; see fp8-to-bf16)")
    p.add_argument("--dst", type=Path, required=True, help="output directory (empty, or --resume)")
    p.add_argument("--format", choices=("torch_dist", "legacy"), default="torch_dist")
    p.add_argument("--tp", type=int, help="legacy: tensor parallel size (default 1)")
    p.add_argument("--pp", type=int, help="legacy: pipeline stages (default 1)")
    p.add_argument("--ep", type=int, help="legacy: expert parallel size (default 1)")
    p.add_argument("--num-layer-list", help="legacy: layers per pipeline stage, e.g. 7,7,8,8,8,8,8,7")
    p.add_argument("--moe-tp-extend-ep", action="store_true", default=None,
                   help="legacy: cut the experts into EP*TP groups instead of splitting each expert over TP")
    p.add_argument("--jobs", type=thread_count("writers"), default=os.cpu_count() or 1, metavar="N",
                   help="files built and written at once, as threads (default: one per core, here %(default)s);"
                   " the output bytes do not depend on it, and --max-memory caps it")
    p.add_argument("--max-memory", type=float, default=16.0, metavar="GB",
                   help="bound on the memory the writers hold; legacy runs fewer writers when it is tight,"
                   " torch_dist writes tensors in row blocks small enough")
    p.add_argument("--resume", action="store_true",
                   help="legacy: continue a previous run in --dst; torch_dist: verify a finished one")
    p.add_argument("--buffered-io", action="store_true",
                   help="legacy: write through the page cache; by default rank files bypass it (O_DIRECT) where the"
                   " file system allows, which saves a copy per byte and keeps the source shards cached. Same bytes")
    p.add_argument("--dry-run", action="store_true", help="check the input and print what would be written")
    p.set_defaults(func=run_hf_to_mcore)

    p = sub.add_parser("mcore-to-hf", help="legacy rank files -> HF safetensors (the inverse of hf-to-mcore)")
    p.add_argument("--src", type=Path, required=True, help="directory written by hf-to-mcore --format legacy")
    p.add_argument("--config", type=Path, required=True, help="directory holding the HF config.json")
    p.add_argument("--dst", type=Path, required=True)
    p.set_defaults(func=run_mcore_to_hf)

    p = sub.add_parser("verify", help="compare a converted checkpoint (either format) with the HF source, bit-exact")
    p.add_argument("--src", type=Path, required=True, help="the HF checkpoint that was converted")
    p.add_argument("--converted", type=Path, required=True, help="directory written by hf-to-mcore")
    p.add_argument("--sample", type=int, help="check N randomly chosen tensors instead of all")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_verify)




def converted_format(directory: Path) -> str:
    path = directory / "manifest.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no manifest.json written by hf-to-mcore")
    head = read_json(path, "manifest").get("header")
    if not isinstance(head, dict) or head.get("format") not in ("legacy", "torch_dist"):
        raise CheckpointError(f"{path}: not written by hf-to-mcore (no header.format legacy or torch_dist)")
    return head["format"]


def layout_args(args: argparse.Namespace) -> ParallelLayout:
    layers = None
    if args.num_layer_list:
        try:
            layers = [int(x) for x in args.num_layer_list.split(",")]
        except ValueError:
            raise ConfigError(f"--num-layer-list {args.num_layer_list!r}: integers separated by commas") from None
    return ParallelLayout(tp=args.tp or 1, pp=args.pp or 1, ep=args.ep or 1, extend_ep=bool(args.moe_tp_extend_ep),
                          layer_list=tuple(layers) if layers else None)


def run_hf_to_mcore(args: argparse.Namespace) -> int:
    if args.format == "torch_dist":
        return _torch_dist(args)
    dims = dims_from_config(load_config(args.src))
    if args.dry_run:
        layout = checked(dims, layout_args(args))
        reader_spans(ShardedReader(args.src))  # every shard header, as the conversion reads them
        for rel, specs in legacy.plan(dims, layout).items():
            print(f"{rel}: {len(specs)} tensors")
        return 0
    legacy.hf_to_legacy(args.src, args.dst, layout_args(args), resume=args.resume, jobs=args.jobs,
                        max_memory_gb=args.max_memory, direct_io=not args.buffered_io)
    return 0


def _torch_dist(args: argparse.Namespace) -> int:
    from tools.weights import dist  # torch.distributed.checkpoint takes seconds to import: only when used

    given = [flag for attr, flag in LAYOUT_FLAGS.items() if getattr(args, attr) not in (None, False)]
    if given:
        raise ConfigError(f"{given[0]} applies to --format legacy: a torch_dist checkpoint has no layout"
                          " (Megatron reshards it at load), drop the flag or add --format legacy")
    # Each writer holds one block being written and torch's copy of it. The block size must not
    # depend on --jobs (it shapes the output): the budget caps the writers instead.
    budget = int(args.max_memory * 2**30)
    chunk_bytes = max(1 << 20, min(dist.CHUNK_BYTES, budget // 2))
    jobs = max(1, min(args.jobs, budget // (2 * chunk_bytes)))
    if args.dry_run:
        dims = dims_from_config(load_config(args.src))
        shapes = dist.check_source(ShardedReader(args.src), dims)
        tensors = dist.plan(dims, shapes, chunk_bytes=chunk_bytes)
        print(f"{len(tensors)} tensors in {sum(len(t.chunks) for t in tensors)} chunks"
              f" (blocks of at most {chunk_bytes / 2**20:.0f} MiB), {len(dist.extra_state_keys(dims))} objects")
        for tensor in tensors:
            print(f"{tensor.key}: {list(tensor.shape)} from {len(tensor.chunks)} chunks")
        return 0
    dist.hf_to_torch_dist(args.src, args.dst, resume=args.resume, jobs=jobs, chunk_bytes=chunk_bytes)
    return 0


def run_mcore_to_hf(args: argparse.Namespace) -> int:
    if converted_format(args.src) != "legacy":
        raise CheckpointError(f"{args.src}: mcore-to-hf reads --format legacy output; check a torch_dist"
                              " conversion with `verify` instead")
    legacy.legacy_to_hf(args.src, args.config, args.dst)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    if converted_format(args.converted) == "torch_dist":
        from tools.weights import dist

        return 1 if dist.verify_torch_dist(args.src, args.converted, sample=args.sample, seed=args.seed) else 0
    return 1 if legacy.verify(args.src, args.converted, args.sample, args.seed) else 0
