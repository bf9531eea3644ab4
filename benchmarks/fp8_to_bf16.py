"""fp8-to-bf16 speed and memory: our streaming converter against the usual reference-style dequant.

Builds synthetic DeepSeek-style FP8 shards (7168x2048 and 2048x7168 float8_e4m3fn expert weights with
fp32 `_scale_inv`, a bf16 norm and an fp32 router bias per shard; >= 2 GB in all) in a temp folder,
then converts them, each variant in a fresh subprocess (peak RSS = that process's VmHWM):
  ours, threads xN     tools.weights.fp8.convert with N worker threads (the shipped design)
  ours, processes x2   the same per-shard streaming on a 2-process pool, torch at 1 thread each
                       (the alternative to threads; RSS: the parent's plus N x the largest worker's)
  reference style      per shard: load it whole, scales expanded to full size with repeat_interleave,
                       fp32 multiply on one thread (torch.set_num_threads(1)), save_file
GB/s counts input (FP8 checkpoint) bytes. The last line is the headline: our speed-up over the
reference style (goal >= 3x); the peak RSS goal is one shard plus two of the largest tensors.

  python benchmarks/fp8_to_bf16.py [--gb 2.2] [--shards 4] [--workers 1,2,3] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from tools.weights.hf import FP8_BLOCK, scale_shape  # noqa: E402
from tools.weights.io import INDEX  # noqa: E402

SHAPES = [(7168, 2048), (2048, 7168)]  # DeepSeek-V3 routed expert gate/up and down projections


# ---------------------------------------------------------------- synthetic checkpoint

def random_fp8(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """Random e4m3 bytes without the NaN patterns (0x7f, 0xff), fast to make in bulk."""
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    raw[(raw & 0x7F) == 0x7F] -= 1
    return raw.view(torch.float8_e4m3fn)


def build(src: Path, gb: float, shards: int) -> dict:
    src.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    per_weight = SHAPES[0][0] * SHAPES[0][1]
    per_shard = max(1, round(gb * 1e9 / per_weight / shards))
    weight_map, total = {}, 0
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {f"model.layers.{s}.post_attention_layernorm.weight": torch.ones(7168, dtype=torch.bfloat16),
                   f"model.layers.{s}.mlp.gate.e_score_correction_bias": torch.zeros(256, dtype=torch.float32)}
        for e in range(per_shard):
            shape = SHAPES[e % 2]
            weight = f"model.layers.{s}.mlp.experts.{e}.proj.weight"
            tensors[weight] = random_fp8(shape, gen)
            tensors[weight + "_scale_inv"] = torch.rand(scale_shape(shape), generator=gen) * 1e-3 + 1e-4
        save_file(tensors, str(src / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (src / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {"model_type": "deepseek_v3", "quantization_config": {"weight_block_size": [FP8_BLOCK, FP8_BLOCK]}}
    (src / "config.json").write_text(json.dumps(config))
    (src / "tokenizer.json").write_text("{}")
    largest_shard = max((src / n).stat().st_size for n in set(weight_map.values()))
    return {"bytes": total, "largest_shard": largest_shard, "largest_bf16_tensor": per_weight * 2}


# ---------------------------------------------------------------- the variants (run in a child process)

def run_ours_threads(src: Path, dst: Path, workers: int) -> None:
    from tools.weights.fp8 import convert

    convert(src, dst, workers=workers, log=lambda line: None)


def _process_shard(args: tuple) -> str:
    from tools.weights.fp8 import convert_shard

    torch.set_num_threads(1)
    shard, dst = args
    return convert_shard(shard, dst)


def run_ours_processes(src: Path, dst: Path, workers: int) -> None:
    from concurrent.futures import ProcessPoolExecutor

    from tools.weights.fp8 import plan

    dst.mkdir(parents=True)
    todo = plan(src)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        list(pool.map(_process_shard, [(shard, dst) for shard in todo.shards]))


def run_reference(src: Path, dst: Path, workers: int) -> None:
    """What one-off conversion scripts do: whole shard in memory, full-size scales, fp32, one thread."""
    torch.set_num_threads(1)
    dst.mkdir(parents=True)
    index = json.loads((src / INDEX).read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(src / shard))
        out = {}
        for name, tensor in tensors.items():
            if name.endswith("_scale_inv"):
                continue
            if tensor.dtype == torch.float8_e4m3fn:
                scale = tensors[name + "_scale_inv"]
                m, n = tensor.shape
                full = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:m, :n]
                tensor = (tensor.float() * full).to(torch.bfloat16)
            out[name] = tensor
        save_file(out, str(dst / shard), metadata={"format": "pt"})
        del tensors, out


VARIANTS = {"threads": run_ours_threads, "processes": run_ours_processes, "reference": run_reference}


def child(variant: str, src: Path, dst: Path, workers: int) -> None:
    start = time.perf_counter()
    VARIANTS[variant](src, dst, workers)
    seconds = time.perf_counter() - start
    status = Path("/proc/self/status").read_text()
    hwm_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
    workers_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * (workers if variant == "processes" else 0)
    print(json.dumps({"seconds": seconds, "rss_mb": (hwm_kb + workers_kb) / 1024}))


# ---------------------------------------------------------------- driver

def measure(variant: str, src: Path, workers: int, tmp: Path, repeat: int) -> dict:
    """Best wall time of `repeat` fresh processes (writeback to this VM's disk is noisy), largest RSS."""
    results = []
    for _ in range(repeat):
        dst = tmp / f"out-{variant}-{workers}"
        os.sync()  # start each run without the previous run's dirty pages to write back
        proc = subprocess.run([sys.executable, __file__, "--child", variant, "--src", str(src), "--dst", str(dst),
                               "--workers", str(workers)], capture_output=True, text=True, check=True)
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        shutil.rmtree(dst)
    return {"seconds": min(r["seconds"] for r in results), "rss_mb": max(r["rss_mb"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.2, help="size of the synthetic FP8 checkpoint")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--workers", default="1,2,3", help="thread counts to measure for ours")
    parser.add_argument("--repeat", type=int, default=2, help="runs per variant; the best wall time counts")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dst", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.src, args.dst, int(args.workers))
    with tempfile.TemporaryDirectory(prefix="fp8-bench-") as tmp:
        src = Path(tmp) / "src"
        facts = build(src, args.gb, args.shards)
        gb = facts["bytes"] / 1e9
        runs = [(f"ours, threads x{w}", "threads", int(w)) for w in args.workers.split(",")]
        runs += [("ours, processes x2", "processes", 2), ("reference style (1 thread)", "reference", 1)]
        rows = [(label, measure(variant, src, workers, Path(tmp), args.repeat)) for label, variant, workers in runs]
    budget = (facts["largest_shard"] + 2 * facts["largest_bf16_tensor"]) / 2**20
    print(f"{gb:.2f} GB FP8 in {args.shards} shards; {os.cpu_count()} CPUs; best of {args.repeat} runs;"
          f" peak RSS goal (one shard + two largest bf16 tensors): {budget:.0f} MB")
    print(f"{'variant':28} {'wall s':>8} {'GB/s':>7} {'peak RSS MB':>12}")
    for label, r in rows:
        print(f"{label:28} {r['seconds']:8.2f} {gb / r['seconds']:7.2f} {r['rss_mb']:12.0f}")
    reference = rows[-1][1]["seconds"]
    best_label, best = min(rows[:-2], key=lambda row: row[1]["seconds"])
    print(f"headline: {best_label} is {reference / best['seconds']:.1f}x faster than the reference style")


if __name__ == "__main__":
    main()
