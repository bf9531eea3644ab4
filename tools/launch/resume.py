"""Continue a run from its last complete checkpoint: what `--resume RUN_DIR` finds, checks and refuses.

verl saves global_step_N folders under trainer.default_local_dir and, once every rank has returned from the save,
points latest_checkpointed_iteration.txt at the newest (our verl series: verl/utils/checkpoint/completion.py). So
the tracker names the last complete checkpoint; a folder newer than it is a save that a fault cut off. The checks
here are what such a checkpoint cannot follow: verl's Megatron checkpoint is one file per TP x PP x EP rank of the
saved layout, and its weights are the saved model's.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, fields
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from tools.launch.config import Recipe, value
from tools.launch.fields import KEY
from tools.model.dims import dims_from_config
from tools.model.errors import ConfigError

PARTIAL = ".partial"  # a cut-off save, renamed out of the way of the resumed run's save of that step
SAVED_MODEL = "actor/hf_config_and_tokenizer/config.json"  # verl saves the model's config.json with its weights
# What the checkpoint's files are cut by: a change here cannot be loaded (the world fixes the DP groups that
# gathered the optimizer state).
LAYOUT_KEYS = tuple(KEY[f] for f in ("train.tp", "train.pp", "train.ep", "train.etp", "train.vpp", "train.layer_list",
                                     "train.extend_ep", "train.distributed_optimizer", "nodes", "devices_per_node"))


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path
    saved_at: float  # when the tracker named it (its mtime)
    nbytes: int

    def describe(self) -> str:
        when = datetime.datetime.fromtimestamp(self.saved_at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"step {self.step} ({self.path}, saved {when}, {self.nbytes / 1e9:.3g} GB)"


def _completion():
    """The fork's rules of a complete checkpoint (verl/utils/checkpoint/completion.py: the tracker, the
    global_step_N folders), imported when needed as config.check_series imports the series' settings."""
    from verl.utils.checkpoint import completion

    return completion


def tracker_path(ckpt_dir: Path) -> Path:
    from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename

    return Path(get_checkpoint_tracker_filename(str(ckpt_dir)))


def tracked_step(ckpt_dir: Path) -> int | None:
    try:
        return _completion().tracked_step(str(ckpt_dir))
    except ValueError:
        text = tracker_path(ckpt_dir).read_text().strip()
        raise ConfigError(f"{tracker_path(ckpt_dir)} holds {text!r}, not a step: it was not written by verl's"
                          " trainer") from None


def latest(ckpt_dir: Path) -> Checkpoint | None:
    """The checkpoint the tracker names, or None when there is no complete one."""
    step = tracked_step(ckpt_dir)
    folder = ckpt_dir / f"global_step_{step}"
    if step is None or not folder.is_dir():
        return None
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return Checkpoint(step, folder, tracker_path(ckpt_dir).stat().st_mtime, size)


def partial(ckpt_dir: Path) -> list[Path]:
    """Folders of saves that did not complete: every global_step_N newer than the tracked step."""
    done = tracked_step(ckpt_dir)
    return [ckpt_dir / f"global_step_{s}" for s in _completion().saved_steps(str(ckpt_dir))
            if done is None or s > done]


def set_aside(folders: list[Path]) -> list[Path]:
    """Rename cut-off saves to global_step_N.partial[.K], kept for inspection: the resumed run saves step N anew."""
    moved = []
    for folder in folders:
        target, k = folder.with_name(folder.name + PARTIAL), 1
        while target.exists():
            target, k = folder.with_name(f"{folder.name}{PARTIAL}.{k}"), k + 1
        folder.rename(target)
        moved.append(target)
    return moved


def layout_changes(saved: DictConfig, now: DictConfig) -> list[str]:
    """Each layout key whose value differs from the saved run's, as a sentence with the fix."""
    return [f"{key} is {value(now, key)!r}, the checkpoint was saved with {value(saved, key)!r}: verl's Megatron"
            f" checkpoint holds one file per rank of its layout; set {key}={_literal(value(saved, key))}"
            for key in LAYOUT_KEYS if value(saved, key) != value(now, key)]


def model_changes(saved_config: dict, now_config: dict) -> list[str]:
    """The architecture numbers that differ between the checkpoint's config.json and the model of this config."""
    old, new = dims_from_config(saved_config, "checkpoint"), dims_from_config(now_config, "model")
    return [f"{f.metadata['key']} {getattr(old, f.name)} -> {getattr(new, f.name)}"
            for f in fields(old) if getattr(old, f.name) != getattr(new, f.name)]


def _literal(v) -> str:
    if isinstance(v, list | tuple):
        return "[" + ",".join(map(str, v)) + "]"
    return "null" if v is None else str(v)


def saved_config(run_dir: Path) -> DictConfig:
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there: not a run directory of tools.launch"
                          " (logs/<run id>)")
    return OmegaConf.load(path)


def checkpoint_dir(run_dir: Path) -> Path:
    """Where the run saved: verl.yaml's trainer.default_local_dir, as the launcher wrote it."""
    verl_yaml = run_dir / "verl.yaml"
    where = OmegaConf.select(OmegaConf.load(verl_yaml), "trainer.default_local_dir") if verl_yaml.is_file() else None
    if not where:
        raise ConfigError(f"--resume {run_dir}: {verl_yaml} names no trainer.default_local_dir: the run saved no"
                          " checkpoints; start a new run without --resume")
    return Path(str(where))


def find(run_dir: Path, recipe: Recipe, model_config: dict) -> tuple[Checkpoint, list[Path]]:
    """The checkpoint to continue from and the cut-off saves beside it, or ConfigError naming what is wrong and
    the fix: no complete checkpoint, a changed layout, a changed model."""
    ckpt_dir = checkpoint_dir(run_dir)
    found, cut = latest(ckpt_dir), partial(ckpt_dir)
    if found is None:
        seen = f"; cut-off saves there: {', '.join(p.name for p in cut)}" if cut else ""
        raise ConfigError(f"--resume {run_dir}: no complete checkpoint in {ckpt_dir} (no"
                          f" {tracker_path(ckpt_dir).name} naming a global_step_N folder){seen}. The run saved none"
                          " before it stopped (trainer.save_freq is"
                          f" {recipe.layout.checkpoints.save_freq}): start a new run without --resume")
    problems = layout_changes(saved_config(run_dir), recipe.cfg)
    saved_model = found.path / SAVED_MODEL
    if saved_model.is_file():
        import json

        changed = model_changes(json.loads(saved_model.read_text()), model_config)
        if changed:
            problems.append(f"actor_rollout_ref.model.path: the model differs from the checkpoint's ({saved_model}):"
                            f" {', '.join(changed)}; use the model the run started from")
    if problems:
        raise ConfigError(f"--resume {run_dir}: cannot continue from {found.describe()}: " + "; ".join(problems))
    return found, cut
