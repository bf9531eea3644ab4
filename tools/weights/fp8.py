"""`fp8-to-bf16`: dequantise DeepSeek-V3/R1's block-wise FP8 release into a plain bf16 HF checkpoint.

DeepSeek ships most linear weights as float8_e4m3fn with a float32 `<name>_scale_inv` holding one
factor per 128x128 block (edge blocks partial): the real weight is `fp8 * scale_inv` blockwise. This
command writes that product rounded to bf16 (bit-identical to the fp32 multiply of DeepSeek's own
`weight_dequant`), drops the scales, copies every other tensor byte for byte (the fp32 router bias
stays fp32) and every other file, and writes an index and a config.json without
`quantization_config`.

How it stays fast and small:
- each output shard is streamed: its safetensors header is known from the input headers, so tensors
  are read and written in row chunks of whole 128-row blocks; no shard and no full-size fp32 copy
  of a weight (or of its expanded scales) is ever held in memory;
- torch's fp8->fp32 cast is scalar code; moving the e4m3 bits into float16's fields is exact and
  about 10x faster (see `_e4m3_over_256`);
- shards run on a thread pool: torch ops, hashing and file I/O release the GIL, and threads share
  one progress bar, one cancellation flag and the manifest. benchmarks/fp8_to_bf16.py on 2 cores
  (2.2 GB): 2 threads ~5.5 s at ~290 MB peak RSS; 2 processes ~4.9 s but ~650 MB (each loads torch),
  above the one-shard-plus-two-tensors memory goal, so threads;
- every file is written under a temp name and renamed when complete, and manifest.json records its
  sha256, so `--resume` verifies finished shards and redoes only the rest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import struct
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from tools.model.errors import ConfigError
from tools.weights.hf import FP8_BLOCK, load_config, scale_shape
from tools.weights.io import (
    INDEX,
    MANIFEST,
    CheckpointError,
    HashingWriter,
    Manifest,
    ShardedReader,
    atomic_write,
    progress,
    read_json,
    safetensors_header,
    thread_count,
)

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = "F8_E4M3"
# Bytes per element of safetensors dtypes, in the order safetensors' own save_file lays tensors out
# (widest first, so every tensor stays aligned); the streamed shards use the same layout.
DTYPE_SIZES = {"U64": 8, "I64": 8, "F64": 8, "F32": 4, "U32": 4, "I32": 4, "BF16": 2, "F16": 2, "U16": 2,
               "I16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
SCALE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
CHUNK_ELEMENTS = 1 << 20  # ~1M elements per dequant step: the fp32 temporary (4 MB) stays in cache
COPY_BYTES = 1 << 24
# One shard per core: on 2 cores 2 threads beat 1 and 3 (benchmarks/fp8_to_bf16.py); the cap of 8 is
# where a shared disk, not the CPU, is expected to limit (not measured).
DEFAULT_WORKERS = max(1, min(8, os.cpu_count() or 1))
E4M3_MAX_OVER_256 = 448.0 / 256  # largest finite e4m3 value, as `_e4m3_over_256` yields it


# ---------------------------------------------------------------- dequantisation

def _e4m3_over_256(rows: torch.Tensor) -> torch.Tensor:
    """fp32 of float8_e4m3fn `rows` divided by 256 exactly.

    e4m3 (bias 7) and float16 (bias 15) differ by 8 in the exponent bias, so the byte's exponent and
    mantissa bits shifted into float16's fields read as value * 2^-8, subnormals included; float16 ->
    fp32 is an exact vectorised cast. The NaN bytes (0x7f, 0xff) would read as +-1.875, so a chunk
    holding one takes torch's (slow, NaN-preserving) cast instead.
    """
    bits = rows.view(torch.int8).to(torch.int16)  # sign-extended: a negative byte sets bits 8..15
    bits <<= 7  # exponent and mantissa land in bits 7..14; the sign on bits 14 and 15
    bits &= ~(1 << 14)  # keep the sign on bit 15 only
    values = bits.view(torch.float16).float()
    low, high = torch.aminmax(values)
    if float(high) > E4M3_MAX_OVER_256 or float(low) < -E4M3_MAX_OVER_256:
        return rows.float() / 256
    return values


def column_scales(scale: torch.Tensor, n: int) -> torch.Tensor:
    """[blocks_m, n] fp32: each block's scale repeated along its 128 columns (1/128 of the weight's size)."""
    return scale.float().repeat_interleave(FP8_BLOCK, dim=1)[:, :n].contiguous()


def block_scales(scale: torch.Tensor, n: int) -> tuple[torch.Tensor, bool]:
    """Column scales for `dequantize_rows` and whether they carry the 256 that `_e4m3_over_256` divides by.

    Multiplying by 256 (a power of two) leaves the product, hence its rounding, unchanged; only scales
    above ~1e36 would overflow, and those take torch's exact fp8 cast instead.
    """
    cols = column_scales(scale, n)
    scaled = cols * 256
    if torch.equal(scaled.isinf(), cols.isinf()):
        return scaled, True
    return cols, False


def dequantize_rows(rows: torch.Tensor, col_scales: torch.Tensor, out: torch.Tensor, over_256: bool) -> None:
    """out (bf16) = rows (fp8, starting on a block boundary) * their blocks' scales, rounded once.

    The multiply broadcasts each block's column scales over its 128 rows: no full-size scale tensor.
    """
    r, n = rows.shape
    values = _e4m3_over_256(rows) if over_256 else rows.float()
    whole = r // FP8_BLOCK
    if whole:
        values[:whole * FP8_BLOCK].view(whole, FP8_BLOCK, n).mul_(col_scales[:whole, None, :])
    if r % FP8_BLOCK:  # the partial last block of the tensor
        values[whole * FP8_BLOCK:].mul_(col_scales[whole])
    out.copy_(values)


def chunk_rows(n: int) -> int:
    """Rows per dequant step: whole 128-row blocks, about CHUNK_ELEMENTS elements."""
    return max(1, CHUNK_ELEMENTS // (FP8_BLOCK * max(n, 1))) * FP8_BLOCK


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 of a whole block-quantised [m, n] weight (the converter streams the same steps from disk)."""
    m, n = weight.shape
    cols, over_256 = block_scales(scale, n)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    step = chunk_rows(n)
    for r0 in range(0, m, step):
        r1 = min(r0 + step, m)
        dequantize_rows(weight[r0:r1], cols[r0 // FP8_BLOCK:], out[r0:r1], over_256)
    return out


# ---------------------------------------------------------------- safetensors headers

@dataclass(frozen=True)
class Stored:
    """Where one tensor's bytes lie in a safetensors file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset of the first byte
    nbytes: int


def read_header(path: Path) -> tuple[dict[str, Stored], dict[str, str]]:
    """The tensors of a safetensors file (name -> Stored) and its `__metadata__`."""
    header, base = safetensors_header(path)
    header = dict(header)
    metadata = header.pop("__metadata__", None) or {}
    tensors = {name: Stored(path, h["dtype"], tuple(h["shape"]), base + h["data_offsets"][0],
                            h["data_offsets"][1] - h["data_offsets"][0]) for name, h in header.items()}
    return tensors, metadata


def header_bytes(tensors: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]) -> bytes:
    """Length prefix + JSON header for (name, dtype, shape, nbytes) laid out in this order.

    Compact JSON, `__metadata__` first, padded with spaces to 8 bytes: the layout save_file writes.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def save_order(name: str, dtype: str) -> tuple[int, str]:
    """safetensors' layout: widest dtypes first (keeps every tensor aligned), then by name."""
    order = list(DTYPE_SIZES)
    return (order.index(dtype) if dtype in order else len(order), name)


# ---------------------------------------------------------------- the plan

@dataclass(frozen=True)
class OutTensor:
    """One tensor of an output shard: `source` dequantised with `scale`, or copied when scale is None."""

    name: str
    source: Stored
    scale: Stored | None

    @property
    def dtype(self) -> str:
        return "BF16" if self.scale else self.source.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.source.shape) * 2 if self.scale else self.source.nbytes


@dataclass(frozen=True)
class ShardPlan:
    name: str  # the input shard's file name, kept for the output
    tensors: list[OutTensor]  # in the order they are written
    metadata: dict[str, str]

    @property
    def in_bytes(self) -> int:
        return sum(t.source.nbytes for t in self.tensors)

    @property
    def out_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class Plan:
    src: Path
    shards: list[ShardPlan]  # non-empty ones; a shard holding only scales has no output
    weight_map: dict[str, str]  # output index, without the scales
    index_metadata: dict
    config: dict  # without quantization_config
    files: list[str]  # other files to copy, relative to src

    @property
    def dequantised(self) -> int:
        return sum(t.scale is not None for s in self.shards for t in s.tensors)

    def fingerprint(self) -> str:
        """Identifies the conversion (tensors, shapes, grouping) for the manifest, wherever src lives."""
        text = json.dumps([(s.name, [(t.name, t.dtype, t.source.shape) for t in s.tensors]) for s in self.shards])
        return hashlib.sha256(text.encode()).hexdigest()


def plan(src: Path) -> Plan:
    """Read config, index and every shard header; check every FP8 weight has a matching scale."""
    config = load_config(src)
    _check_block_size(config, src)
    reader = ShardedReader(src)
    headers, metadata = _headers(src, reader.shards())
    stored = {}
    for name, shard in reader.weight_map.items():
        if name not in headers[shard]:
            raise CheckpointError(f"{src / INDEX} places {name!r} in {shard}, whose header lacks it;"
                                  " re-download that shard or regenerate the index")
        stored[name] = headers[shard][name]
    outputs = _out_tensors(src, reader.weight_map, stored)
    shards = []
    for shard in reader.shards():
        members = sorted((t for t in outputs if reader.weight_map[t.name] == shard),
                         key=lambda t: save_order(t.name, t.dtype))
        if members:
            shards.append(ShardPlan(shard, members, metadata[shard] or {"format": "pt"}))
    weight_map = {t.name: reader.weight_map[t.name] for t in outputs}
    index = read_json(src / INDEX, "safetensors index") if (src / INDEX).is_file() else {}
    index_metadata = index.get("metadata") or {}
    index_metadata = {**index_metadata, "total_size": sum(s.out_bytes for s in shards)}
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    return Plan(src, shards, weight_map, index_metadata, config, _other_files(src))


def _check_block_size(config: dict, src: Path) -> None:
    block = (config.get("quantization_config") or {}).get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
    if list(block) != [FP8_BLOCK, FP8_BLOCK]:
        raise ConfigError(f"{src / 'config.json'}: quantization_config.weight_block_size is {block}; this"
                          f" converter handles DeepSeek's [{FP8_BLOCK}, {FP8_BLOCK}] blocks only")


def _headers(src: Path, shards: list[str]) -> tuple[dict[str, dict[str, Stored]], dict[str, dict[str, str]]]:
    headers, metadata = {}, {}
    for shard in shards:
        if not (src / shard).is_file():
            raise CheckpointError(f"{src / INDEX} names {shard}, which is not in {src}; download it or fix the index")
        headers[shard], metadata[shard] = read_header(src / shard)
    return headers, metadata


def _out_tensors(src: Path, weight_map: dict[str, str], stored: dict[str, Stored]) -> list[OutTensor]:
    """Every non-scale tensor, paired with its scale when it is FP8; a clear error for what does not fit."""
    out = []
    for name, where in stored.items():
        if name.endswith(SCALE_SUFFIX):
            weight = stored.get(name[:-len(SCALE_SUFFIX)])
            if weight is None or not weight.dtype.startswith("F8_"):
                raise CheckpointError(f"{name!r} ({weight_map[name]}) scales no FP8 weight"
                                      f" {name[:-len(SCALE_SUFFIX)]!r}; the checkpoint is not DeepSeek's FP8"
                                      " layout, or a shard is missing from the index")
            continue
        if not where.dtype.startswith("F8_"):
            out.append(OutTensor(name, where, None))
            continue
        out.append(OutTensor(name, where, _scale_of(name, weight_map, stored)))
    return out


def _scale_of(name: str, weight_map: dict[str, str], stored: dict[str, Stored]) -> Stored:
    weight = stored[name]
    scale = stored.get(name + SCALE_SUFFIX)
    if weight.dtype != FP8_DTYPE or len(weight.shape) != 2:
        raise CheckpointError(f"FP8 weight {name!r} ({weight_map[name]}) is {weight.dtype} of shape"
                              f" {list(weight.shape)}; only 2-D float8_e4m3fn (F8_E4M3) weights are supported")
    if scale is None:
        raise CheckpointError(f"FP8 weight {name!r} ({weight_map[name]}) has no {name + SCALE_SUFFIX!r} in the"
                              f" checkpoint's {INDEX}, so it cannot be dequantised; re-download the checkpoint"
                              " (every shard and the index)")
    expected = scale_shape(weight.shape)
    if scale.shape != expected:
        raise CheckpointError(f"{name + SCALE_SUFFIX!r} ({weight_map[name + SCALE_SUFFIX]}) has shape"
                              f" {list(scale.shape)}, but FP8 weight {name!r} of shape {list(weight.shape)} needs"
                              f" {list(expected)} (one scale per {FP8_BLOCK}x{FP8_BLOCK} block, edges partial);"
                              " the scale belongs to another tensor or another block size")
    if scale.dtype not in SCALE_DTYPES:
        raise CheckpointError(f"{name + SCALE_SUFFIX!r} is {scale.dtype}; expected F32 (or BF16/F16)")
    return scale


def _other_files(src: Path) -> list[str]:
    """Tokenizer, generation config, code, docs...: everything but weights, index, config and hidden folders."""
    skip = {INDEX, "config.json", MANIFEST}
    files = []
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if (path.is_file() and path.suffix != ".safetensors" and str(rel) not in skip
                and not any(part.startswith(".") for part in rel.parts[:-1])):
            files.append(str(rel))
    return files


# ---------------------------------------------------------------- streaming one shard

class Cancelled(Exception):
    """Another shard failed (or the run was interrupted): stop this one; its temp file is removed."""


def _read(f, start: int, nbytes: int) -> torch.Tensor:
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    f.seek(start)
    if nbytes and f.readinto(buffer.numpy()) != nbytes:
        raise CheckpointError(f"{f.name} is truncated (needs bytes up to {start + nbytes}); re-download it")
    return buffer


def _read_scale(where: Stored) -> torch.Tensor:
    with open(where.file, "rb") as f:
        return _read(f, where.start, where.nbytes).view(SCALE_DTYPES[where.dtype]).view(where.shape)


def _write_dequantised(tensor: OutTensor, out: HashingWriter, advance: Callable[[int], None],
                       cancel: threading.Event) -> None:
    m, n = tensor.source.shape
    cols, over_256 = block_scales(_read_scale(tensor.scale), n)
    step = chunk_rows(n)
    with open(tensor.source.file, "rb") as f:
        for r0 in range(0, m, step):
            if cancel.is_set():
                raise Cancelled
            r1 = min(r0 + step, m)
            rows = _read(f, tensor.source.start + r0 * n, (r1 - r0) * n).view(torch.float8_e4m3fn).view(r1 - r0, n)
            bf16 = torch.empty(r1 - r0, n, dtype=torch.bfloat16)
            dequantize_rows(rows, cols[r0 // FP8_BLOCK:], bf16, over_256)
            out.write(bf16.view(torch.int16).numpy().data)
            advance(rows.numel())


def _copy(tensor: OutTensor, out: HashingWriter, advance: Callable[[int], None], cancel: threading.Event) -> None:
    where = tensor.source
    with open(where.file, "rb") as f:
        for offset in range(0, where.nbytes, COPY_BYTES):
            if cancel.is_set():
                raise Cancelled
            size = min(COPY_BYTES, where.nbytes - offset)
            out.write(_read(f, where.start + offset, size).numpy().data)
            advance(size)


def convert_shard(shard: ShardPlan, dst: Path, advance: Callable[[int], None] = lambda n: None,
                  cancel: threading.Event | None = None) -> str:
    """Stream one output shard into place (temp file + rename); returns its sha256."""
    cancel = cancel or threading.Event()
    layout = [(t.name, t.dtype, t.source.shape, t.nbytes) for t in shard.tensors]
    with atomic_write(dst / shard.name) as tmp, open(tmp, "wb") as raw:
        out = HashingWriter(raw)
        out.write(header_bytes(layout, shard.metadata))
        for tensor in shard.tensors:
            (_write_dequantised if tensor.scale else _copy)(tensor, out, advance, cancel)
    return out.sha.hexdigest()


# ---------------------------------------------------------------- the whole conversion

def convert(src: Path, dst: Path, *, workers: int = DEFAULT_WORKERS, resume: bool = False, dry_run: bool = False,
            log: Callable[[str], None] = print) -> Plan:
    """Convert src (FP8) into dst (bf16); see the module docstring. Returns the plan it followed."""
    src, dst = Path(src), Path(dst)
    _check_places(src, dst)
    todo = plan(src)
    manifest = Manifest.resume(dst, {"command": "fp8-to-bf16", "plan_sha256": todo.fingerprint()}, resume)
    if dry_run:
        _describe(todo, manifest, log)
        return todo
    dst.mkdir(parents=True, exist_ok=True)
    for stale in dst.glob(".*.tmp"):  # temp files of a killed run (atomic_write names them so)
        stale.unlink()
    _convert_shards(todo, dst, manifest, workers)
    for rel in todo.files:
        _finish(manifest, rel, lambda tmp, rel=rel: shutil.copyfile(src / rel, tmp))
    _finish(manifest, "config.json", lambda tmp: tmp.write_text(json.dumps(todo.config, indent=2) + "\n"))
    index = {"metadata": todo.index_metadata, "weight_map": todo.weight_map}
    _finish(manifest, INDEX, lambda tmp: tmp.write_text(json.dumps(index, indent=2) + "\n"))  # last: marks done
    return todo


def _check_places(src: Path, dst: Path) -> None:
    source, dest = src.resolve(), dst.resolve()
    if dest == source or source in dest.parents:
        raise CheckpointError(f"--dst {dst} lies inside --src {src}; choose a destination outside the checkpoint")


def _convert_shards(todo: Plan, dst: Path, manifest: Manifest, workers: int) -> None:
    """Run the shards on a thread pool; on the first error stop the rest and raise it."""
    advance = progress(sum(s.in_bytes for s in todo.shards), "fp8-to-bf16") or (lambda n: None)
    cancel, lock = threading.Event(), threading.Lock()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fp8") as pool:
        futures = [pool.submit(_shard_task, shard, dst, manifest, lock, advance, cancel) for shard in todo.shards]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:  # an error or Ctrl-C: running shards stop at their next chunk, queued ones never start
            cancel.set()
            pool.shutdown(wait=True, cancel_futures=True)
    errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
    if errors:  # the first real one: Cancelled only follows it
        raise next((e for e in errors if not isinstance(e, Cancelled)), errors[0])


def _shard_task(shard: ShardPlan, dst: Path, manifest: Manifest, lock: threading.Lock,
                advance: Callable[[int], None], cancel: threading.Event) -> None:
    if manifest.done(shard.name):  # verified against its recorded sha256
        advance(shard.in_bytes)
        return
    digest = convert_shard(shard, dst, advance, cancel)
    with lock:  # recorded before this worker moves on: a kill loses only the shards in flight
        manifest.record(shard.name, digest)


def _finish(manifest: Manifest, rel: str, write: Callable[[Path], object]) -> None:
    if manifest.done(rel):
        return
    with atomic_write(manifest.dir / rel) as tmp:
        write(tmp)
    manifest.record(rel)


def _describe(todo: Plan, manifest: Manifest, log: Callable[[str], None]) -> None:
    finished = [s.name for s in todo.shards if manifest.done(s.name)]
    copied = sum(len(s.tensors) for s in todo.shards) - todo.dequantised
    gb_in, gb_out = sum(s.in_bytes for s in todo.shards) / 1e9, todo.index_metadata["total_size"] / 1e9
    log(f"{todo.src}: {len(todo.shards)} shards, {todo.dequantised} FP8 weights to dequantise, {copied} tensors"
        f" to copy, {gb_in:.2f} GB in -> {gb_out:.2f} GB out")
    log(f"  already finished and verified: {len(finished)} shard(s); to write: {len(todo.shards) - len(finished)}")
    log(f"  files copied: {', '.join(todo.files) or '(none)'}; config.json without quantization_config; new {INDEX}")
    log("dry run: nothing written")


# ---------------------------------------------------------------- command line

DESCRIPTION = """\
Dequantise DeepSeek-V3/R1's FP8 release into a bf16 HF checkpoint.

DeepSeek stores most linear weights as float8_e4m3fn plus `<name>_scale_inv` (fp32, one value per
128x128 block, shape [ceil(rows/128), ceil(cols/128)], possibly in another shard: the index is
followed). Each weight becomes bf16(fp8 * scale_inv), exactly what DeepSeek's fp32 dequant kernel
gives. Scales are dropped; every other tensor is copied unchanged (the fp32 router bias stays fp32);
output shards keep the input shard names; model.safetensors.index.json and config.json (without
quantization_config) are rewritten; tokenizer and other files are copied.

Memory stays near a few chunks per worker: shards are streamed row block by row block. Every file is
written under a temp name and renamed when complete; manifest.json records its sha256, so after an
interruption `--resume` verifies finished shards, skips them and converts the rest.

  python -m tools.weights fp8-to-bf16 --src DeepSeek-V3 --dst DeepSeek-V3-bf16 --workers 2
"""




def register(sub) -> None:
    p = sub.add_parser("fp8-to-bf16", help="dequantise DeepSeek's block-wise FP8 checkpoint into bf16",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, required=True, help="HF checkpoint with FP8 weights and _scale_inv")
    p.add_argument("--dst", type=Path, required=True, help="output directory (empty, or a previous run with --resume)")
    p.add_argument("--workers", type=thread_count("workers"), default=DEFAULT_WORKERS,
                   help=f"shards converted at once, as threads (default: one per core, at most 8: {DEFAULT_WORKERS});"
                   " each holds only a few MB")
    p.add_argument("--resume", action="store_true", help="continue a previous run into --dst, keeping verified shards")
    p.add_argument("--dry-run", action="store_true", help="check the input and show what would be written")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    done = convert(args.src, args.dst, workers=args.workers, resume=args.resume, dry_run=args.dry_run)
    if not args.dry_run:
        print(f"wrote {args.dst}: {len(done.shards)} shards, {done.dequantised} weights dequantised to bf16")
    return 0
