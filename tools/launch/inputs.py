"""Checks of what a run reads from disk (the HF model directory, the data files, the converted checkpoint) and of
where it writes its checkpoints.

`checkpoint_problems` is pure (a manifest dict against the layout, or against the torch_dist format when verl
loads with use_dist_checkpointing); `input_checks` looks at the filesystem.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from tools.launch.config import Recipe
from tools.launch.fields import KEY
from tools.launch.layout import Layout
from tools.launch.preflight import Check

MANIFEST = "manifest.json"
LATEST = "latest_checkpointed_iteration.txt"  # written last by `tools.weights hf-to-mcore`
CONVERT = ("python -m tools.weights hf-to-mcore --src <bf16 HF dir> --dst <dir> --format legacy"
           " --tp {tp} --pp {pp} --ep {ep} --num-layer-list {layers}{extend}")
CONVERT_DIST = "python -m tools.weights hf-to-mcore --src <bf16 HF dir> --dst <dir>"  # torch_dist, no layout
DIST_METADATA = "metadata.json"  # Megatron's dist_checkpointing backend file (tools/weights/dist.py writes it)

HOW_TO_SET = {
    "actor_rollout_ref.model.path": "the HF model directory (config.json + tokenizer)",
    "data.train_files": "a parquet file made by `python -m tools.data`",
    "data.val_files": "a parquet file made by `python -m tools.data`",
    "recipe.weights.mcore_checkpoint": "the output directory of `python -m tools.weights hf-to-mcore`",
}


def convert_command(lay: Layout, dist: bool = False) -> str:
    if dist:
        return CONVERT_DIST
    train = lay.train
    layers = ",".join(map(str, train.layer_list)) if train.layer_list else "<list>"
    return CONVERT.format(tp=train.tp, pp=train.pp, ep=train.ep, layers=layers,
                          extend=" --moe-tp-extend-ep" if train.extend_ep else "")


def checkpoint_problems(manifest: dict, lay: Layout, dist: bool = False) -> list[str]:
    """Why a converted checkpoint does not fit this layout (empty when it does). With `dist` (verl loads through
    Megatron's dist_checkpointing) it must be torch_dist, which has no layout: Megatron reshards it at load."""
    header = manifest.get("header", {})
    if dist:
        if header.get("format") != "torch_dist":
            return [f"{KEY['inputs.actor_dist']} is true, so verl reads it with Megatron's dist_checkpointing,"
                    f" which needs an hf-to-mcore torch_dist conversion (manifest format={header.get('format')!r})"]
        if DIST_METADATA not in manifest.get("files", {}):
            return [f"conversion incomplete ({DIST_METADATA} not recorded): convert again into an empty --dst"]
        return []
    got = header.get("layout")
    if header.get("format") != "legacy" or not isinstance(got, dict):
        return [f"manifest header is not an hf-to-mcore legacy conversion (format={header.get('format')!r})"]
    want = lay.train.to_manifest()  # as hf-to-mcore records it; without a layer list any split is taken
    if not lay.train.layer_list:
        want["layers_per_stage"] = got.get("layers_per_stage")
    problems = [f"{k} is {got.get(k)!r}, the config needs {v!r}" for k, v in want.items() if got.get(k) != v]
    if LATEST not in manifest.get("files", {}):
        problems.append(f"conversion unfinished ({LATEST} not recorded): rerun it with --resume")
    return problems


def _exists(key: str, raw) -> Check:
    paths = raw if isinstance(raw, list) else [raw]
    missing = [p for p in paths if not Path(str(p)).expanduser().exists()]
    return Check("input exists", key, ", ".join(map(str, paths)), "path exists", not missing,
                 f"not found: {', '.join(map(str, missing))}" if missing else "")


def input_checks(recipe: Recipe) -> list[Check]:
    inp, lay = recipe.inputs, recipe.layout
    checks = []
    missing = set(inp.missing)
    for key in sorted(missing):
        checks.append(Check("required setting", key, f"{key} = ???", "set on the command line or in the config", False,
                            f"add {key}=<{HOW_TO_SET.get(key, 'value')}>"))
    for name, path in (("inputs.model_path", inp.model_path), ("inputs.train_files", inp.train_files),
                       ("inputs.val_files", inp.val_files)):
        if KEY[name] not in missing:
            checks.append(_exists(KEY[name], path))
    if inp.weights_load and KEY["inputs.mcore_checkpoint"] not in missing:
        path = inp.mcore_checkpoint
        checks.append(weights_check(path, lay, dict((role, use) for role, use, _ in inp.dist)["actor"]))
        for role, use, dist_path in inp.dist:  # verl reads dist_checkpointing_path: it must be the checkpoint checked
            if use and dist_path != path:
                checks.append(Check("verl loads the checked checkpoint", KEY[f"inputs.{role}_dist_path"],
                                    str(dist_path), "dist_checkpointing_path == recipe.weights.mcore_checkpoint",
                                    False, "leave it as ${recipe.weights.mcore_checkpoint}"))
    if lay.checkpoints.saves and lay.checkpoints.dir:
        checks.append(checkpoint_dir_check(lay.checkpoints.dir))
    return checks


def checkpoint_dir_check(path: str) -> Check:
    """recipe.checkpoints.dir exists on this (the head) node and takes a new file: a temp file is created there and
    removed. Every other node must mount the same directory; this node cannot see theirs."""
    key, rule = "recipe.checkpoints.dir", "a writable directory on this node (and mounted on every node)"
    where = Path(str(path)).expanduser()
    mount = "mount the shared filesystem at that path on every node"
    if not where.is_dir():
        what = "not a directory" if where.exists() else "not found"
        return Check("checkpoint dir", key, str(path), rule, False,
                     f"{what} here: {mount}, or create it there (mkdir -p {where})")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".write-check-", dir=where)
    except OSError as exc:
        return Check("checkpoint dir", key, str(path), rule, False,
                     f"cannot create a file there ({exc.strerror}): give the run's user write access, or {mount}"
                     " read-write")
    os.close(fd)
    os.unlink(tmp)
    return Check("checkpoint dir", key, str(path), rule, True)


def weights_check(path, lay: Layout, dist: bool = False) -> Check:
    """The converted checkpoint at `path`: for this layout (legacy), or torch_dist with `dist`
    (use_dist_checkpointing)."""
    key = "recipe.weights.mcore_checkpoint"
    rule = "torch_dist conversion (manifest.json)" if dist else "converted for this layout (manifest.json)"
    how = convert_command(lay, dist)
    if not path:
        return Check("converted checkpoint", key, "null", rule, False,
                     f"recipe.weights.load is true: convert with `{how}`")
    manifest = Path(str(path)).expanduser() / MANIFEST
    if not manifest.is_file():
        return Check("converted checkpoint", key, str(path), rule, False,
                     f"no {MANIFEST} there: not converted; run `{how}`")
    problems = checkpoint_problems(json.loads(manifest.read_text()), lay, dist)
    return Check("converted checkpoint", key, str(path), rule, not problems,
                 "; ".join(problems) + (f"; reconvert: `{how}`" if problems else ""))
