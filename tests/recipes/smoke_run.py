"""The smoke command line as a user runs it, for the recipe tests: Ray ports of the run's own."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.gloo import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_smoke(profile: str, steps: int, work: Path, logs: Path, *overrides: str) -> dict:
    """`python -m tools.launch.smoke` as run "e2e" under `logs`, with free Ray head, dashboard, agent and metrics ports
    (should another Ray run on this machine); the launcher overrides come before the ports."""
    port, dash, agent, metrics = (free_port() for _ in range(4))
    started = time.time()
    cmd = [sys.executable, "-m", "tools.launch.smoke", "--profile", profile, "--steps", str(steps),
           "--work", str(work), "--logs", str(logs), "--run-id", "e2e", *overrides,
           f"launch.ray.port={port}", f"launch.ray.dashboard_port={dash}",
           f"launch.ray.extra_start_args=[--dashboard-agent-listen-port={agent},--metrics-export-port={metrics}]"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    return {"proc": proc, "run_dir": logs / "e2e", "port": port, "started": started, "profile": profile}
