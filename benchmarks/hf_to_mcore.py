"""hf-to-mcore (legacy per-rank files and torch_dist) on a synthetic DeepSeek-V3-shaped model of 4.9 GB.

Measured side by side in one run, each in a fresh process: a plain copy of the same shard bytes,
and the conversions (legacy: TP2 PP2 EP4, uneven layer list; torch_dist: layout-free), each at every
--jobs given (default 1, 2 and one per core).
Reports wall time, GB/s, CPU time and peak resident memory of each. Goals: conversion throughput at
least 0.7 of the plain copy's, peak RSS under 4 GB (Python included). The page cache is warm for
both reads (the model was just written); all runs start with nothing dirty (os.sync) and their
times include flushing what they wrote to disk (os.sync). The runs are repeated --repeat times,
alternating, and the best time of each is compared: on a shared machine the best time is the one
least disturbed by other work. The CPU seconds say what a run costs whatever else the machine was
doing.

  python benchmarks/hf_to_mcore.py [--workdir DIR] [--keep] [--repeat N] [--jobs 1,2,8]
                                   [--format legacy|torch_dist|both]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = {  # DeepSeek-V3's structure at about 1/140 of its size
    "vocab_size": 32000, "hidden_size": 2048, "num_hidden_layers": 5, "first_k_dense_replace": 1,
    "intermediate_size": 5632, "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 1,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 512, "kv_lora_rank": 256,
    "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "n_group": 8, "topk_group": 4,
}


def run_measured(cmd: list[str]) -> tuple[float, float, float]:
    """(seconds, CPU seconds, peak RSS in GiB) of a command run in its own process."""
    os.sync()  # start with nothing dirty: neither run pays for the other's (or the model's) write-back
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    os.sync()  # count the write-back too: a copy that only filled the page cache is not done
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, help="where to put the model (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the files afterwards")
    parser.add_argument("--repeat", type=int, default=3, help="measure the copy and the conversion N times each")
    cores = os.cpu_count() or 1
    parser.add_argument("--jobs", default=f"1,2,{cores}",
                        help="hf-to-mcore --jobs values to measure, comma-separated (default 1,2,cores)")
    parser.add_argument("--format", choices=("legacy", "torch_dist", "both"), default="both")
    args = parser.parse_args()
    jobs_list = sorted({int(j) for j in args.jobs.split(",")})
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-hf-to-mcore-"))
    src, copy = work / "hf", work / "copy"
    try:
        if not (src / "config.json").exists():
            print("writing the synthetic model ...", flush=True)
            # in a process of its own: a parent that held the model would pass its peak RSS on to
            # the measured children (ru_maxrss survives fork and exec)
            subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path;"
                            " from tools.weights.tiny import make_tiny;"
                            f" make_tiny(Path(sys.argv[1]), overrides={MODEL!r}, shards=8, seed=0)", str(src)],
                           cwd=ROOT, check=True)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        copy_cmd = [sys.executable, "-c", "import shutil,sys,pathlib; s,d=map(pathlib.Path,sys.argv[1:]);"
                    " d.mkdir(); [shutil.copyfile(f, d/f.name) for f in sorted(s.glob('*.safetensors'))]",
                    str(src), str(copy)]
        formats = ("legacy", "torch_dist") if args.format == "both" else (args.format,)
        runs_of = [(f, j) for f in formats for j in jobs_list]
        layout = {"legacy": ["--tp", "2", "--pp", "2", "--ep", "4", "--num-layer-list", "2,3"], "torch_dist": []}
        dsts = {r: work / f"mcore-{r[0]}-jobs{r[1]}" for r in runs_of}
        commands = {r: [sys.executable, "-m", "tools.weights", "hf-to-mcore", "--src", str(src), "--dst", str(dsts[r]),
                        "--format", r[0], *layout[r[0]], "--jobs", str(r[1])] for r in runs_of}
        copies: list = []
        runs: dict[tuple, list] = {r: [] for r in runs_of}
        for _ in range(max(1, args.repeat)):
            for d in (copy, *dsts.values()):
                shutil.rmtree(d, ignore_errors=True)
            copies.append(run_measured(copy_cmd))
            for r in runs_of:
                runs[r].append(run_measured(commands[r]))
        (copy_s, copy_cpu, copy_rss) = min(copies)
        gb = size / 1e9
        print(f"\nsynthetic model: {gb:.2f} GB in 8 shards; best of {len(copies)} runs"
              f" (copy seconds: {' '.join(f'{c[0]:.1f}' for c in copies)})")
        print(f"{'run':36} {'seconds':>8} {'GB/s':>6} {'CPU s':>6} {'peak RSS GiB':>13} {'written GB':>11}")
        print(f"{'plain copy of the shards':36} {copy_s:8.1f} {gb / copy_s:6.2f} {copy_cpu:6.1f} {copy_rss:13.2f}"
              f" {gb:11.2f}")
        for r in runs_of:
            f, jobs = r
            conv_s, conv_cpu, _ = min(runs[r])
            rss = max(c[2] for c in runs[r])
            written = sum(p.stat().st_size for p in dsts[r].rglob("*") if p.is_file())
            name = ("hf-to-mcore legacy tp2pp2ep4" if f == "legacy" else "hf-to-mcore torch_dist") + f" --jobs {jobs}"
            print(f"{name:36} {conv_s:8.1f} {gb / conv_s:6.2f} {conv_cpu:6.1f} {rss:13.2f} {written / 1e9:11.2f}")
            print(f"  {f} --jobs {jobs}: throughput ratio (input bytes, conversion / copy) {copy_s / conv_s:.2f}"
                  " (goal >= 0.7);"
                  f" bytes written per second / copy's {(written / conv_s) / (size / copy_s):.2f};"
                  f" peak RSS {rss:.2f} GiB (goal < 4); seconds {' '.join(f'{c[0]:.1f}' for c in runs[r])}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
