"""Checkpoint I/O shared by the converters: sharded safetensors reading, atomic writes, manifests.

Every file a converter writes goes through `atomic_write` (temp file in the same folder + rename),
so an interrupted run never leaves a half-written file under its final name, and `Manifest` records
a sha256 per finished file, which is how a resumed run knows what it may skip.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """Bad input checkpoint or destination; the message names the tensor, file or field."""


class ShardedReader:
    """Lazy access to the tensors of a (possibly sharded) safetensors checkpoint directory."""

    def __init__(self, directory: Path):
        self.dir = directory
        index = directory / INDEX
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{directory}: no {INDEX} and no *.safetensors files")
            self.weight_map = {}
            for f in files:
                with safe_open(f, "pt") as handle:
                    self.weight_map.update(dict.fromkeys(handle.keys(), f.name))
        self._handles: dict[str, object] = {}

    def fresh(self) -> ShardedReader:
        """A reader over the same files with its own (unmapped) handles: dropping it releases the
        mapped pages a conversion touched, which would otherwise count towards its resident memory."""
        other = object.__new__(ShardedReader)
        other.dir, other.weight_map, other._handles = self.dir, self.weight_map, {}
        return other

    def names(self) -> list[str]:
        return list(self.weight_map)

    def shards(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def shard_of(self, name: str) -> str:
        try:
            return self.weight_map[name]
        except KeyError:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is not in the checkpoint") from None

    def _handle(self, shard: str):
        if shard not in self._handles:
            path = self.dir / shard
            if not path.is_file():
                raise CheckpointError(f"{self.dir}: {INDEX} names {shard}, which does not exist")
            self._handles[shard] = safe_open(path, "pt")
        return self._handles[shard]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(self.shard_of(name)).get_tensor(name)

    def slice(self, name: str):
        """A lazy view of tensor `name`: indexing it reads only the selected bytes."""
        return self._handle(self.shard_of(name)).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.slice(name).get_shape())

    def close(self) -> None:
        self._handles.clear()


@contextmanager
def atomic_write(path: Path) -> Iterator[Path]:
    """Yield a temp path beside `path`; rename it into place only when the block succeeds.

    The temp name is fixed, not random: torch.save records the file name inside its archive, and a
    resumed run must write the same bytes as an uninterrupted one. One writer per path.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.with_name(f".{path.name}.tmp"))
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class HashingWriter:
    """A binary file that also hashes what is written, so the manifest needs no second read."""

    def __init__(self, raw):
        self.raw = raw
        self.sha = hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        self.raw.write(data)
        return len(data)

    def flush(self) -> None:
        self.raw.flush()


class Manifest:
    """`manifest.json` of an output directory: what produced it and a sha256 per finished file."""

    def __init__(self, directory: Path, header: dict):
        self.dir = directory
        self.path = directory / MANIFEST
        self.header = json.loads(json.dumps(header))  # as it reads back from disk (tuples become lists)
        self.files: dict[str, str] = {}

    @classmethod
    def resume(cls, directory: Path, header: dict, resume: bool) -> Manifest:
        """Open the destination: empty, or (with resume) a previous run of the same conversion."""
        manifest = cls(directory, header)
        existing = [p for p in directory.iterdir()] if directory.is_dir() else []
        if not existing:
            return manifest
        if not resume:
            raise CheckpointError(f"{directory} is not empty; pass --resume to continue a previous run there,"
                                  " or choose an empty destination")
        if manifest.path.is_file():
            previous = json.loads(manifest.path.read_text())
            if previous.get("header") != manifest.header:
                raise CheckpointError(f"{directory} holds a different conversion ({manifest.path}: header differs);"
                                      " choose an empty destination")
            manifest.files = previous.get("files", {})
        return manifest

    def done(self, rel: str) -> bool:
        """A file counts as finished when it is recorded and its bytes still match."""
        path = self.dir / rel
        return rel in self.files and path.is_file() and sha256(path) == self.files[rel]

    def record(self, rel: str, digest: str | None = None) -> None:
        """Mark a finished file; pass the digest when the writer hashed the bytes as it wrote them."""
        self.files[rel] = digest or sha256(self.dir / rel)
        self.save()

    def save(self) -> None:
        with atomic_write(self.path) as tmp:
            tmp.write_text(json.dumps({"header": self.header, "files": dict(sorted(self.files.items()))},
                                      indent=2, sort_keys=True) + "\n")


def progress(total: int, desc: str, unit: str = "B") -> Callable[[int], None] | None:
    """A tqdm bar (bytes: GB/s and ETA) when stderr is a terminal; None otherwise."""
    import sys

    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1024)
    return bar.update
