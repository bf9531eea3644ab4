"""Fixtures for the launcher tests: inputs on disk (model dir, data files, a converted-checkpoint manifest)."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Ray on this machine stays on loopback: without this, Ray turns 127.0.0.1 into the host's outward address
# (services.resolve_ip_for_localhost) before connecting. Read when ray is first imported, so set it here.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "recipes" / "deepseek_r1" / "configs"
LEGACY_LAYOUT = {"tp": 4, "pp": 8, "ep": 8, "layers_per_stage": [7, 7, 8, 8, 8, 8, 8, 7], "tp_extend_ep": True}


def write_manifest(path: Path, layout: dict, finished: bool = True) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    files = {"iter_0000001/mp_rank_00_000_000/model_optim_rng.pt": "0" * 64}
    if finished:
        files["latest_checkpointed_iteration.txt"] = "1" * 64
    (path / "manifest.json").write_text(json.dumps({"header": {"format": "legacy", "layout": layout},
                                                    "files": files}))
    return path


def write_dist_manifest(path: Path, finished: bool = True) -> Path:
    """What `hf-to-mcore` (torch_dist, tools/weights/dist.py) records: no layout, metadata.json among the files."""
    path.mkdir(parents=True, exist_ok=True)
    files = {"__0_0.distcp": "0" * 64, ".metadata": "1" * 64, "common.pt": "2" * 64}
    if finished:
        files["metadata.json"] = "3" * 64
    (path / "manifest.json").write_text(json.dumps({"header": {"format": "torch_dist", "config": {},
                                                               "chunk_bytes": 1 << 28}, "files": files}))
    return path
