"""What a run's checkpoints cost: size, write time, disk and the share of the run spent saving. Pure arithmetic.

verl 0.6.1's Megatron checkpoint (verl/utils/checkpoint/megatron_checkpoint_manager.py) hands one sharded state
dict to Megatron's dist_checkpointing, which writes each shard once, from the rank that owns it:
- "model": the bf16 weights, once per parameter (2 bytes);
- "optimizer": the distributed optimizer's fp32 master weight and Adam's exp_avg and exp_avg_sq (12 bytes), once
  per parameter, and the LR scheduler's state;
- "extra": each rank's RNG states, plus the HF config and tokenizer; the trainer adds data.pt
  (the dataloader);
- "hf_model" (not in the default contents): a whole HF copy of the weights (2 bytes per parameter more).
The extras are kilobytes per rank and megabytes for the tokenizer: EXTRA_BYTES bounds them, so the size is the
parameter count times the bytes of the contents. Write time assumes the filesystem's bandwidth is the limit
(recipe.checkpoints.write_gb_per_s): verl saves synchronously, so the step that saves is that much longer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tools.launch.layout import Checkpoints
from tools.model.dims import Dims

GB, TB = 1e9, 1e12
# by verl's checkpoint.contents entry; "optimizer" is memory.ADAM_BYTES
BYTES_PER_PARAM = {"model": 2, "optimizer": 12, "hf_model": 2}
EXTRA_BYTES = 0.1 * GB  # RNG states of every rank, HF config + tokenizer (~10 MB), data.pt: an upper bound
DEFAULT_CONTENTS = ("model", "optimizer", "extra")  # verl 0.6.1's actor checkpoint.save_contents


def checkpoint_bytes(dims: Dims, contents: tuple[str, ...] = DEFAULT_CONTENTS) -> float:
    """Bytes of one checkpoint: every parameter once per content it is written in, plus the extras."""
    per_param = sum(BYTES_PER_PARAM.get(c, 0) for c in contents)
    return dims.total_params() * per_param + (EXTRA_BYTES if "extra" in contents else 0.0)


def write_seconds(nbytes: float, write_gb_per_s: float) -> float:
    """Seconds one save blocks training, when the filesystem's bandwidth is the limit."""
    return nbytes / (write_gb_per_s * GB)


def peak_disk_bytes(nbytes: float, keep: int | None) -> float | None:
    """Disk a run needs: K complete checkpoints plus the one being written, since our verl series prunes the
    oldest only after the new one is marked complete (verl/utils/checkpoint/completion.py); None when unbounded."""
    if keep is None or keep <= 0:
        return None
    return (keep + 1) * nbytes


def overhead(write_s: float, save_freq: int, step_s: float | None) -> float | None:
    """Share of the run spent saving: one write per save_freq steps (None without saves or a step time)."""
    if save_freq <= 0 or not step_s:
        return None
    return write_s / (save_freq * step_s)


def young_interval_s(write_s: float, mtbf_s: float) -> float:
    """Young's optimal time between checkpoints, sqrt(2 x write time x MTBF): it balances the time spent saving
    against the work lost to a failure (half an interval on average)."""
    return math.sqrt(2 * write_s * mtbf_s)


@dataclass(frozen=True)
class Cost:
    """One checkpoint's numbers for the printed table."""

    ck: Checkpoints
    params: int
    nbytes: float
    write_s: float
    disk_bytes: float | None
    overhead: float | None


def estimate(ck: Checkpoints, dims: Dims) -> Cost:
    nbytes = checkpoint_bytes(dims, ck.contents)
    write_s = write_seconds(nbytes, ck.write_gb_per_s)
    return Cost(ck, dims.total_params(), nbytes, write_s, peak_disk_bytes(nbytes, ck.keep),
                overhead(write_s, ck.save_freq, ck.step_s))


def render(cost: Cost, where: str) -> str:
    """The estimate as the dry run prints it; `where` is the directory verl saves to (trainer.default_local_dir)."""
    ck = cost.ck
    per_param = " + ".join(f"{BYTES_PER_PARAM[c]} B {c}" for c in ck.contents if c in BYTES_PER_PARAM)
    keep = "null" if ck.keep is None else ck.keep
    disk = (f"{cost.disk_bytes / TB:.2f} TB ({keep} kept + 1 being written)" if cost.disk_bytes is not None
            else f"unbounded (trainer.max_actor_ckpt_to_keep is {keep}: every checkpoint is kept)")
    if not ck.saves:
        cadence = f"off (trainer.save_freq {ck.save_freq})"
    elif cost.overhead is None:
        cadence = f"every {ck.save_freq} steps (no recipe.checkpoints.step_s: overhead not estimated)"
    else:
        cadence = (f"every {ck.save_freq} steps of {ck.step_s:g} s: {cost.overhead:.1%} of the run spent"
                   " saving")
    why = "recipe.checkpoints.dir/<run id>; every node mounts it" if ck.dir else "recipe.checkpoints.dir is null"
    rows = [("size", f"{cost.nbytes / TB:.2f} TB ({cost.params / 1e9:.1f}B params x ({per_param}))"),
            ("write time", f"{cost.write_s:.0f} s ({cost.write_s / 60:.1f} min) at {ck.write_gb_per_s:g} GB/s"),
            ("disk", disk), ("saves", cadence),
            ("where", f"{where} ({why})")]
    return "\n".join([f"checkpoint (estimate; contents {list(ck.contents)}):"]
                     + [f"  {k:<12} {v}" for k, v in rows])
