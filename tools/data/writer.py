"""Split examples into train/test deterministically and write them as parquet, atomically."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from tools.data.schema import SCHEMA, Example, make_row

SPLITS = ("train", "test")
PROGRESS_ABOVE = 10_000  # rows; smaller conversions finish before a bar is worth drawing


def held_out_count(n: int, test_ratio: float) -> int:
    """round(n * test_ratio), half up, but never an empty split that the ratio asks to be non-empty.

    With two or more rows, a ratio above 0 gives at least one test row and a ratio below 1 leaves
    at least one train row (verl fails on an empty validation set).
    """
    count = int(n * test_ratio + 0.5)
    if n >= 2 and test_ratio > 0:
        count = max(count, 1)
    if n >= 2 and test_ratio < 1:
        count = min(count, n - 1)
    return count


def split(examples: list[Example], test_ratio: float, seed: int) -> dict[str, list[Example]]:
    """{"train": [...], "test": [...]}, each in source order; the test rows are a seeded random pick."""
    # RandomState's stream is frozen by numpy's compatibility policy: same seed, same split, forever.
    order = np.random.RandomState(seed).permutation(len(examples))
    is_test = np.zeros(len(examples), dtype=bool)
    is_test[order[: held_out_count(len(examples), test_ratio)]] = True
    return {
        "train": [e for e, test in zip(examples, is_test, strict=True) if not test],
        "test": [e for e, test in zip(examples, is_test, strict=True) if test],
    }


def to_table(examples: list[Example], data_source: str, split_name: str, instruction: str) -> pa.Table:
    rows = tqdm(examples, desc=split_name, unit="row", file=sys.stderr, disable=len(examples) <= PROGRESS_ABOVE)
    return pa.Table.from_pylist([make_row(e, data_source, split_name, instruction) for e in rows], schema=SCHEMA)


def write_atomically(tables: dict[str, pa.Table], dst: Path) -> dict[str, Path]:
    """Write `dst/<split>.parquet` for each table; a reader sees old or new files, never a partial one."""
    dst.mkdir(parents=True, exist_ok=True)
    staged: dict[Path, str] = {}
    try:
        for name, table in tables.items():
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".parquet.tmp", dir=dst)
            os.close(fd)
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the parquet should read like any file
            staged[dst / f"{name}.parquet"] = tmp
            pq.write_table(table, tmp)
        for final, tmp in staged.items():
            os.replace(tmp, final)
    finally:
        for tmp in staged.values():
            if os.path.exists(tmp):
                os.unlink(tmp)
    return {name: dst / f"{name}.parquet" for name in tables}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
