"""The two CPU smoke profiles side by side on this machine: cpu-tiny (the A3 path: Megatron TP2 x PP2 on 4 ranks,
TensorCache, directed weight sync into an HF engine per rank) and cpu-tiny-fsdp (FSDP on 2 ranks, verl's HF rollout),
the same steps of the same data, run one after the other through `python -m tools.smoke`.

Prints wall time and the mean phase times per step (the first step is left out of the means: it pays for start-up),
and last the A3 path's step time over the FSDP profile's.

  python benchmarks/smoke_profiles.py [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("step time (s)", "rollout time (s)", "ref time (s)", "update time (s)")


def run(profile: str, steps: int, logs: Path) -> tuple[float, list[dict]]:
    started = time.time()
    subprocess.run([sys.executable, "-m", "tools.smoke", "--profile", profile, "--steps", str(steps),
                    "--logs", str(logs), "--run-id", profile], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.time() - started, json.loads((logs / profile / "summary.json").read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as logs:
        for profile in ("megatron", "fsdp"):
            results[profile] = run(profile, args.steps, Path(logs))
    print(f"{'profile':<10} {'wall (s)':>9} " + " ".join(f"{c:>17}" for c in PHASES))
    means = {}
    for profile, (wall, rows) in results.items():
        later = rows[1:] or rows
        means[profile] = {c: statistics.mean(r.get(c, float("nan")) for r in later) for c in PHASES}
        print(f"{profile:<10} {wall:>9.1f} " + " ".join(f"{means[profile][c]:>17.2f}" for c in PHASES))
    drift = [(r["logprob diff mean"], r["logprob diff max"]) for r in results["megatron"][1]]
    print("A3 path, rollout vs update log-prob difference per step (mean, max): "
          + ", ".join(f"({a:.4f}, {b:.4f})" for a, b in drift))
    ratio = means["megatron"]["step time (s)"] / means["fsdp"]["step time (s)"]
    print(f"A3 path (megatron) step time / FSDP profile step time: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
