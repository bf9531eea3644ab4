"""hf-to-mcore (legacy per-rank files) on a synthetic DeepSeek-V3-shaped model of about 4.8 GB.

Measured side by side in one run, each in a fresh process: a plain copy of the same shard bytes,
and the conversion (TP2 PP2 EP4, uneven layer list, two writers). Reports wall time, GB/s and peak
resident memory of each. Goals: conversion throughput at least 0.7 of the plain copy's, peak RSS
under 4 GB (Python included). The page cache is warm for both reads (the model was just written);
both times include flushing what they wrote to disk (os.sync).

  python benchmarks/hf_to_mcore.py [--workdir DIR] [--keep]
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


def run_measured(cmd: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in GiB) of a command run in its own process."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    _, status, usage = os.wait4(proc.pid, 0)
    os.sync()  # count the write-back too: a copy that only filled the page cache is not done
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return seconds, usage.ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, help="where to put the model (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the files afterwards")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-hf-to-mcore-"))
    src, copy, dst = work / "hf", work / "copy", work / "mcore"
    try:
        if not (src / "config.json").exists():
            from tools.weights.tiny import make_tiny

            print("writing the synthetic model ...", flush=True)
            make_tiny(src, overrides=MODEL, shards=8, seed=0)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        for d in (copy, dst):
            shutil.rmtree(d, ignore_errors=True)
        copy_cmd = [sys.executable, "-c", "import shutil,sys,pathlib; s,d=map(pathlib.Path,sys.argv[1:]);"
                    " d.mkdir(); [shutil.copyfile(f, d/f.name) for f in sorted(s.glob('*.safetensors'))]",
                    str(src), str(copy)]
        convert_cmd = [sys.executable, "-m", "tools.weights", "hf-to-mcore", "--src", str(src), "--dst", str(dst),
                       "--tp", "2", "--pp", "2", "--ep", "4", "--num-layer-list", "2,3", "--workers", "2"]
        copy_s, copy_rss = run_measured(copy_cmd)
        conv_s, conv_rss = run_measured(convert_cmd)
        written = sum(p.stat().st_size for p in dst.rglob("*.pt"))
        gb = size / 1e9
        print(f"\nsynthetic model: {gb:.2f} GB in 8 shards; rank files written: {written / 1e9:.2f} GB")
        print(f"{'run':28} {'seconds':>8} {'GB/s':>6} {'peak RSS GiB':>13}")
        print(f"{'plain copy of the shards':28} {copy_s:8.1f} {gb / copy_s:6.2f} {copy_rss:13.2f}")
        print(f"{'hf-to-mcore tp2 pp2 ep4':28} {conv_s:8.1f} {gb / conv_s:6.2f} {conv_rss:13.2f}")
        out_ratio = (written / conv_s) / (size / copy_s)
        print(f"bytes written per second, conversion / copy: {out_ratio:.2f} (the rank files replicate the"
              f" non-expert weights over EP, {written / size:.2f}x the input)")
        print(f"throughput ratio (input bytes, conversion / copy): {copy_s / conv_s:.2f} (goal >= 0.7);"
              f" peak RSS {conv_rss:.2f} GiB (goal < 4)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
