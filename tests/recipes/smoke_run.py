"""The smoke command line as a user runs it, for the recipe tests: Ray ports of the run's own."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.gloo import free_port

ROOT = Path(__file__).resolve().parents[2]


def smoke_command(profile: str, steps: int, work: Path, logs: Path, *overrides: str, run_id: str = "e2e") -> list[str]:
    """`python -m tools.smoke` as run `run_id` under `logs`, with free Ray head, dashboard, agent and metrics
    ports (should another Ray run on this machine); the launcher overrides come before the ports."""
    port, dash, agent, metrics = (free_port() for _ in range(4))
    return [sys.executable, "-m", "tools.smoke", "--profile", profile, "--steps", str(steps),
            "--work", str(work), "--logs", str(logs), "--run-id", run_id, *overrides,
            f"launch.ray.port={port}", f"launch.ray.dashboard_port={dash}",
            f"launch.ray.extra_start_args=[--dashboard-agent-listen-port={agent},--metrics-export-port={metrics}]"]


def run_smoke(profile: str, steps: int, work: Path, logs: Path, *overrides: str, run_id: str = "e2e") -> dict:
    """The smoke command run to its end: its process, run dir, Ray port and start time."""
    started = time.time()
    cmd = smoke_command(profile, steps, work, logs, *overrides, run_id=run_id)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    port = int(next(a for a in cmd if a.startswith("launch.ray.port=")).split("=")[1])
    return {"proc": proc, "run_dir": logs / run_id, "port": port, "started": started, "profile": profile}
