"""Checkpoint I/O shared by the converters: sharded safetensors reading, atomic writes, manifests.

Input files are read through tools.weights.files (the one place that turns an unreadable file into a
CheckpointError naming it).

Every file a converter writes goes through `atomic_write` (temp file in the same folder + rename),
so an interrupted run never leaves a half-written file under its final name, and `Manifest` records
a sha256 per finished file, which is how a resumed run knows what it may skip.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tools.weights.files import (  # noqa: F401 - CheckpointError and the readers are used from here too
    CheckpointError,
    load_torch,
    open_safetensors,
    read_json,
    safetensors_header,
)

INDEX = "model.safetensors.index.json"
MANIFEST = "manifest.json"


class ShardedReader:
    """Lazy access to the tensors of a (possibly sharded) safetensors checkpoint directory."""

    def __init__(self, directory: Path):
        self.dir = directory
        index = directory / INDEX
        if index.is_file():
            weight_map = read_json(index, "safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: not a safetensors index: no weight_map object of tensor -> file")
            self.weight_map: dict[str, str] = weight_map
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{directory}: no {INDEX} and no *.safetensors files")
            self.weight_map = {}
            for f in files:
                head, _ = safetensors_header(f)
                self.weight_map.update(dict.fromkeys((k for k in head if k != "__metadata__"), f.name))
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
            self._handles[shard] = open_safetensors(path)
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
            previous = read_json(manifest.path, "manifest")
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


# ---------------------------------------------------------------- direct reads (no memory mapping)

SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class TensorSpan:
    """Where a tensor's bytes lie in a safetensors file: `offset` from the start of the file."""

    __slots__ = ("path", "offset", "nbytes", "dtype", "shape")

    def __init__(self, path: Path, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]):
        self.path, self.offset, self.nbytes, self.dtype, self.shape = path, offset, nbytes, dtype, shape

    def row_bytes(self) -> int:
        """Bytes of one index along dim 0 (the whole tensor for a scalar)."""
        n = self.dtype.itemsize
        for d in self.shape[1:]:
            n *= d
        return n


def safetensors_spans(path: Path) -> dict[str, TensorSpan]:
    """Every tensor of one safetensors file, from its header alone (8-byte length + JSON)."""
    head, start = safetensors_header(path)
    spans = {}
    for name, entry in head.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has dtype {entry['dtype']}, which this tool does not read")
        begin, end = entry["data_offsets"]
        spans[name] = TensorSpan(path, start + begin, end - begin, dtype, tuple(entry["shape"]))
    return spans


def reader_spans(reader: ShardedReader) -> dict[str, TensorSpan]:
    """`safetensors_spans` of every shard a reader's index names, for the tensors the index maps there."""
    spans: dict[str, TensorSpan] = {}
    for shard in reader.shards():
        path = reader.dir / shard
        if not path.is_file():
            raise CheckpointError(f"{reader.dir}: {INDEX} names {shard}, which does not exist")
        found = safetensors_spans(path)
        spans.update({name: span for name, span in found.items() if reader.weight_map.get(name) == shard})
    return spans


def pread_into(fd: int, buffer, offset: int, path: object = "file") -> None:
    """Fill the writable `buffer` from `fd` at `offset` (positional: threads may share the fd).

    One copy from the page cache into memory the caller keeps warm; no mapping, so nothing read
    stays resident after the caller drops its buffer."""
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise CheckpointError(f"{path}: ends before byte {offset + len(view)} (truncated?)")
        done += got


BLOCK = 4096  # O_DIRECT wants buffers, offsets and lengths in multiples of the device's block; 4 KiB covers 512 too


def aligned_buffer(nbytes: int) -> memoryview:
    """Page-aligned anonymous memory (what O_DIRECT needs), `nbytes` rounded up to a block."""
    import mmap

    return memoryview(mmap.mmap(-1, -(-max(nbytes, 1) // BLOCK) * BLOCK))


class DirectWriter:
    """A new binary file written around the page cache (O_DIRECT) and hashed as written.

    Large outputs that this machine will not read back soon (converted checkpoints) otherwise pay a
    copy into the page cache, the kernel's write-back of it later, and the eviction of pages that
    were worth keeping (the source shards). Here the bytes go through page-aligned `buffers` (kept
    by the caller between files so they stay warm) and the device reads them from there. Each piece
    is hashed right after it is copied, while it is still in the CPU cache. With two buffers and an
    `io` executor, one buffer is written out while the next fills. The tail is padded to a block for
    the device and the file truncated to its true length. Where the file system refuses O_DIRECT
    (tmpfs, some FUSE and network file systems) or `direct` is False, the same bytes are written
    the ordinary way. `close()` (or the `with` block) finishes the file.
    """

    PIECE = 1 << 20  # copied and hashed at a time: stays in L2 between the two

    def __init__(self, path: Path | str, buffers: tuple[memoryview, ...] | None = None, direct: bool = True,
                 io=None):
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o666)
                self.direct = True
            except OSError:
                pass
        if not self.direct:
            self.fd = os.open(path, flags, 0o666)
        self.buffers = list(buffers) if buffers else [aligned_buffer(16 << 20)]
        if any(len(b) % BLOCK or len(b) != len(self.buffers[0]) for b in self.buffers):
            raise ValueError(f"DirectWriter buffers must have one size, a multiple of {BLOCK} bytes")
        self.io = io if len(self.buffers) > 1 else None
        self.pending = None  # the write of the other buffer, when one is under way
        self.buf = self.buffers[0]
        self.fill = 0
        self.size = 0
        self.sha = hashlib.sha256()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        pos, total = 0, len(view)
        while pos < total:
            take = min(total - pos, len(self.buf) - self.fill, self.PIECE)
            end = self.fill + take
            self.buf[self.fill:end] = view[pos:pos + take]
            self.sha.update(self.buf[self.fill:end])
            self.fill, pos = end, pos + take
            if self.fill == len(self.buf):
                self._hand_off()
        self.size += total
        return total

    def flush(self) -> None:
        """Nothing reaches the file before `close()` but whole buffers; torch.save calls this."""

    def _write_out(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            try:
                done += os.write(self.fd, view[done:])
            except OSError as exc:
                # some file systems accept O_DIRECT at open and refuse the writes (alignment):
                # carry on through the page cache; a refused write wrote nothing
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                import fcntl

                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                self.direct = False

    def _wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def _hand_off(self) -> None:
        """The current buffer is full: write it (in the background if there is another to fill)."""
        self._wait()
        if self.io is None:
            self._write_out(self.buf)
        else:
            self.pending = self.io.submit(self._write_out, self.buf)
            self.buffers.append(self.buffers.pop(0))
            self.buf = self.buffers[0]
        self.fill = 0

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            self._wait()
            if self.fill:
                tail = self.fill
                if self.direct:
                    padded = -(-tail // BLOCK) * BLOCK
                    self.buf[tail:padded] = bytes(padded - tail)
                    self._write_out(self.buf[:padded])
                else:
                    self._write_out(self.buf[:tail])
                os.ftruncate(self.fd, self.size)  # drops the padding, if the tail was written with it
        finally:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> DirectWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:  # a failed write leaves a partial file for the caller to delete
            self.fill = 0
            try:
                self._wait()
            except Exception:  # noqa: S110 - the first error is the one to raise
                pass
        self.close()


def thread_count(noun: str) -> Callable[[str], int]:
    """An argparse type for a number of threads >= 1; the error names what they are (`writers`, `workers`)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of {noun}; give N >= 1"
                                             " (default: one per core)")
        return value

    return parse
