"""How long the "nothing changed" paths take on this checkout: forks status, forks apply and a
second `install` (targets: status under 1 s for six forks, apply no-op under 2 s, install no-op under
5 s). Run after `nox -s install -- --device cpu`: python benchmarks/noop_reruns.py [--device cpu]."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    py = sys.executable
    rows = [
        ("forks status (all forks)", timed([py, "-m", "tools.forks", "status"], args.repeat), 1.0),
        (f"forks apply --profile {args.device} (no-op)",
         timed([py, "-m", "tools.forks", "apply", "--profile", args.device], args.repeat), 2.0),
        (f"install --device {args.device} (no-op)",
         timed([py, "-m", "tools.install", "--device", args.device], args.repeat), 5.0),
    ]
    print(f"{'path':44} {'median s':>9} {'target s':>9} {'ratio':>6}")
    for name, seconds, target in rows:
        print(f"{name:44} {seconds:9.2f} {target:9.1f} {seconds / target:6.2f}")
    print(f"worst ratio to target: {max(s / t for _, s, t in rows):.2f}")


if __name__ == "__main__":
    main()
