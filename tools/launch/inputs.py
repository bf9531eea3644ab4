"""Checks of what a run reads from disk: the HF model directory, the data files, the converted checkpoint.

`checkpoint_problems` is pure (a manifest dict against the layout); `input_checks` looks at the filesystem.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from tools.launch.config import missing_keys, value
from tools.launch.layout import Layout
from tools.launch.preflight import Check

MANIFEST = "manifest.json"
LATEST = "latest_checkpointed_iteration.txt"  # written last by `tools.weights hf-to-mcore`
CONVERT = ("python -m tools.weights hf-to-mcore --src <bf16 HF dir> --dst <dir> --format legacy"
           " --tp {tp} --pp {pp} --ep {ep} --num-layer-list {layers}{extend}")

HOW_TO_SET = {
    "actor_rollout_ref.model.path": "the HF model directory (config.json + tokenizer)",
    "data.train_files": "a parquet file made by `python -m tools.data`",
    "data.val_files": "a parquet file made by `python -m tools.data`",
    "recipe.weights.mcore_checkpoint": "the output directory of `python -m tools.weights hf-to-mcore`",
}


def convert_command(lay: Layout) -> str:
    layers = ",".join(map(str, lay.layer_list)) if lay.layer_list else "<list>"
    return CONVERT.format(tp=lay.tp, pp=lay.pp, ep=lay.ep, layers=layers,
                          extend=" --moe-tp-extend-ep" if lay.extend_ep else "")


def checkpoint_problems(manifest: dict, lay: Layout) -> list[str]:
    """Why a converted checkpoint does not fit this layout (empty when it does)."""
    header = manifest.get("header", {})
    got = header.get("layout")
    if header.get("format") != "legacy" or not isinstance(got, dict):
        return [f"manifest header is not an hf-to-mcore legacy conversion (format={header.get('format')!r})"]
    want = {"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "tp_extend_ep": lay.extend_ep,
            "layers_per_stage": list(lay.layer_list) if lay.layer_list else got.get("layers_per_stage")}
    problems = [f"{k} is {got.get(k)!r}, the config needs {v!r}" for k, v in want.items() if got.get(k) != v]
    if LATEST not in manifest.get("files", {}):
        problems.append(f"conversion unfinished ({LATEST} not recorded): rerun it with --resume")
    return problems


def _exists(key: str, raw) -> Check:
    paths = raw if isinstance(raw, list) else [raw]
    missing = [p for p in paths if not Path(str(p)).expanduser().exists()]
    return Check("input exists", key, ", ".join(map(str, paths)), "path exists", not missing,
                 f"not found: {', '.join(map(str, missing))}" if missing else "")


def input_checks(cfg: DictConfig, lay: Layout) -> list[Check]:
    checks = []
    missing = set(missing_keys(cfg))
    for key in sorted(missing):
        checks.append(Check("required setting", key, f"{key} = ???", "set on the command line or in the config", False,
                            f"add {key}=<{HOW_TO_SET.get(key, 'value')}>"))
    for key in ("actor_rollout_ref.model.path", "data.train_files", "data.val_files"):
        if key not in missing:
            checks.append(_exists(key, value(cfg, key)))
    if value(cfg, "recipe.weights.load", False) and "recipe.weights.mcore_checkpoint" not in missing:
        checks.append(weights_check(value(cfg, "recipe.weights.mcore_checkpoint"), lay))
    return checks


def weights_check(path, lay: Layout) -> Check:
    key, rule = "recipe.weights.mcore_checkpoint", "converted for this layout (manifest.json)"
    if not path:
        return Check("converted checkpoint", key, "null", rule, False,
                     f"recipe.weights.load is true: convert with `{convert_command(lay)}`")
    manifest = Path(str(path)).expanduser() / MANIFEST
    if not manifest.is_file():
        return Check("converted checkpoint", key, str(path), rule, False,
                     f"no {MANIFEST} there: not converted; run `{convert_command(lay)}`")
    problems = checkpoint_problems(json.loads(manifest.read_text()), lay)
    return Check("converted checkpoint", key, str(path), rule, not problems,
                 "; ".join(problems) + (f"; reconvert: `{convert_command(lay)}`" if problems else ""))
