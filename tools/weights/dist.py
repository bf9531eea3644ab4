"""HF DeepSeek-V3 (bf16) -> Megatron-core `dist_checkpointing` in the torch_dist format.

This is the checkpoint verl loads with `megatron.use_dist_checkpointing=True` and
`dist_checkpointing_path`, and Megatron reshards it at load time, so one conversion serves every
TP/PP/EP layout. Megatron stores it through torch.distributed.checkpoint (DCP): each tensor under
its global key and global shape, as any set of chunks; the loader reads whichever chunks overlap the
shard a rank asks for. So we never build the model: every HF tensor (or a block of its rows) becomes
one chunk of the Megatron tensor it belongs to, read from the safetensors shard when DCP writes it.

Keys follow the sharded_state_dict() of the GPT model verl 0.4.0 builds for DeepSeek-V3
(`verl.models.mcore.model_initializer.DeepseekV3Model`, Transformer Engine layer spec, Megatron-core
0.12.3): MLA with the q/kv layernorms fused into `linear_q_up_proj` / `linear_kv_up_proj`
(`layer_norm_weight`), the dense MLP's norm fused into `linear_fc1`, experts under
`mlp.experts.experts.*` with the expert axis first, gate and up as the two halves of `linear_fc1`
(Megatron's swiglu layout). Every linear also gets the `_extra_state` object Megatron saves for it
(None: no FP8 state), so a loader that asks for them finds them.
"""

from __future__ import annotations

import io
import json
import math
import os
import queue
import random
import shutil
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from tools.model.dims import Dims, dims_from_config
from tools.weights.files import first_line
from tools.weights.hf import hf_shapes, layer_prefix, load_config
from tools.weights.io import (
    CheckpointError,
    ShardedReader,
    TensorSpan,
    pread_into,
    progress,
    read_json,
    reader_spans,
    sha256,
)

# What megatron.core.dist_checkpointing.save writes as metadata.json for this backend.
BACKEND_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                  "common_backend": "torch", "common_backend_version": 1}
COMMON_FILE = "common.pt"  # the non-sharded part of the state dict: empty for a model
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
CHUNK_BYTES = 256 << 20  # larger tensors are written as blocks of rows: bounds each writer's memory
FILE_BYTES = 4 << 30  # one .distcp file per this much input (at most MAX_FILES): writers take whole files
MAX_FILES = 64


@dataclass(frozen=True)
class Chunk:
    """Rows [row0, row1) of HF tensor `source`, placed at `offset` of the Megatron tensor."""

    source: str
    row0: int
    row1: int
    offset: tuple[int, ...]


@dataclass(frozen=True)
class DistTensor:
    key: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


def chunk_size(chunk: Chunk, tensor: DistTensor, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
    lead = len(tensor.shape) - len(hf_shape)  # the expert axis, absent from the HF tensor
    return (1,) * lead + (chunk.row1 - chunk.row0, *hf_shape[1:])


def plan(dims: Dims, shapes: dict[str, tuple[int, ...]], itemsize: int = 2,
         chunk_bytes: int = CHUNK_BYTES) -> list[DistTensor]:
    """Every Megatron tensor of the checkpoint, in a fixed order, with the HF chunks that fill it."""
    out: list[DistTensor] = []

    def add(key: str, shape: tuple[int, ...], *parts: tuple[str, tuple[int, ...]]) -> None:
        chunks = []
        for source, offset in parts:
            rows, *rest = shapes[source]
            axis = len(offset) - len(shapes[source])  # the row axis, after any expert axis
            step = max(1, chunk_bytes // max(1, itemsize * math.prod(rest)))
            for r in range(0, rows, step):
                at = list(offset)
                at[axis] += r
                chunks.append(Chunk(source, r, min(rows, r + step), tuple(at)))
        out.append(DistTensor(key, shape, tuple(chunks)))

    def whole(key: str, source: str) -> None:
        add(key, shapes[source], (source, (0,) * len(shapes[source])))

    def gated(key: str, hf: str | list[str]) -> None:
        """fc1 = [gate; up] (Megatron's swiglu halves), fc2 = down; a list of HF prefixes (experts)
        stacks them along a leading expert axis."""
        prefixes = [hf] if isinstance(hf, str) else hf
        inner, hidden = shapes[f"{prefixes[0]}.gate_proj.weight"]
        lead = () if isinstance(hf, str) else (len(prefixes),)
        at = [() if isinstance(hf, str) else (e,) for e in range(len(prefixes))]
        add(f"{key}.linear_fc1.weight", (*lead, 2 * inner, hidden),
            *[part for p, e in zip(prefixes, at, strict=True) for part in ((f"{p}.gate_proj.weight", (*e, 0, 0)),
                                                            (f"{p}.up_proj.weight", (*e, inner, 0)))])
        add(f"{key}.linear_fc2.weight", (*lead, hidden, inner),
            *[(f"{p}.down_proj.weight", (*e, 0, 0)) for p, e in zip(prefixes, at, strict=True)])

    whole("embedding.word_embeddings.weight", "model.embed_tokens.weight")
    for layer in range(dims.layers):
        hf, mc = layer_prefix(layer), f"decoder.layers.{layer}"
        att, hatt = f"{mc}.self_attention", f"{hf}.self_attn"
        whole(f"{mc}.input_layernorm.weight", f"{hf}.input_layernorm.weight")
        whole(f"{att}.linear_q_down_proj.weight", f"{hatt}.q_a_proj.weight")
        whole(f"{att}.linear_q_up_proj.weight", f"{hatt}.q_b_proj.weight")
        whole(f"{att}.linear_q_up_proj.layer_norm_weight", f"{hatt}.q_a_layernorm.weight")
        whole(f"{att}.linear_kv_down_proj.weight", f"{hatt}.kv_a_proj_with_mqa.weight")
        whole(f"{att}.linear_kv_up_proj.weight", f"{hatt}.kv_b_proj.weight")
        whole(f"{att}.linear_kv_up_proj.layer_norm_weight", f"{hatt}.kv_a_layernorm.weight")
        whole(f"{att}.linear_proj.weight", f"{hatt}.o_proj.weight")
        if not dims.is_moe(layer):
            whole(f"{mc}.mlp.linear_fc1.layer_norm_weight", f"{hf}.post_attention_layernorm.weight")
            gated(f"{mc}.mlp", f"{hf}.mlp")
            continue
        whole(f"{mc}.pre_mlp_layernorm.weight", f"{hf}.post_attention_layernorm.weight")
        whole(f"{mc}.mlp.router.weight", f"{hf}.mlp.gate.weight")
        whole(f"{mc}.mlp.router.expert_bias", f"{hf}.mlp.gate.e_score_correction_bias")
        gated(f"{mc}.mlp.experts.experts", [f"{hf}.mlp.experts.{e}" for e in range(dims.experts)])
        if dims.shared_experts:
            gated(f"{mc}.mlp.shared_experts", f"{hf}.mlp.shared_experts")
    whole("decoder.final_layernorm.weight", "model.norm.weight")
    if not dims.tie_embeddings:
        whole("output_layer.weight", "lm_head.weight")
    return out


def extra_state_keys(dims: Dims) -> list[str]:
    """DCP names of the `_extra_state` objects Megatron saves, one per linear (and TE's attention).

    A ShardedObject is stored under `<key>/shard_<offset>_<shape>`; experts carry the expert axis.
    """
    out = []
    for layer in range(dims.layers):
        mc = f"decoder.layers.{layer}"
        linears = [f"{mc}.self_attention.{n}" for n in ("linear_q_down_proj", "linear_q_up_proj",
                                                        "linear_kv_down_proj", "linear_kv_up_proj",
                                                        "linear_proj", "core_attention")]
        if not dims.is_moe(layer):
            linears += [f"{mc}.mlp.linear_fc1", f"{mc}.mlp.linear_fc2"]
        elif dims.shared_experts:
            linears += [f"{mc}.mlp.shared_experts.linear_fc1", f"{mc}.mlp.shared_experts.linear_fc2"]
        out += [f"{name}._extra_state/shard_0_1" for name in linears]
        if dims.is_moe(layer):
            out += [f"{mc}.mlp.experts.experts.linear_fc{i}._extra_state/shard_{e}_{dims.experts}"
                    for e in range(dims.experts) for i in (1, 2)]
    return out


def _none_object() -> bytes:
    """What Megatron stores for a ShardedObject whose data is None: torch.save of the list of data."""
    buffer = io.BytesIO()
    torch.save([None], buffer)
    return buffer.getvalue()


class _Source:
    """Reads row blocks of HF tensors with pread: nothing is mapped, so the bytes of a block leave
    memory once DCP has written it (a mapping would keep every page touched resident)."""

    def __init__(self, spans: dict[str, TensorSpan]):
        self.spans = spans
        self.fds: dict[Path, int] = {}
        self.lock = threading.Lock()

    def _fd(self, path: Path) -> int:
        with self.lock:
            if path not in self.fds:
                self.fds[path] = os.open(path, os.O_RDONLY)
            return self.fds[path]

    def rows(self, chunk: Chunk) -> torch.Tensor:
        span = self.spans[chunk.source]
        row = span.row_bytes()
        out = torch.empty((chunk.row1 - chunk.row0) * row, dtype=torch.uint8)
        pread_into(self._fd(span.path), out.numpy(), span.offset + chunk.row0 * row, span.path)
        return out.view(span.dtype).reshape(chunk.row1 - chunk.row0, *span.shape[1:])

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


class _LazySavePlanner(SavePlanner):
    """Write items made from the plan; each chunk's bytes are read from HF only when DCP writes it."""

    def __init__(self, tensors: list[DistTensor], objects: list[str], shapes: dict, dtypes: dict,
                 source: _Source, advance: Callable[[int], None] | None):
        self.tensors, self.objects, self.shapes, self.dtypes = tensors, objects, shapes, dtypes
        self.source, self.advance = source, advance
        self.chunks: dict[MetadataIndex, tuple[Chunk, tuple[int, ...]]] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        items = []
        for tensor in self.tensors:
            dtype = self.dtypes[tensor.chunks[0].source]
            for chunk in tensor.chunks:
                size = chunk_size(chunk, tensor, self.shapes[chunk.source])
                index = MetadataIndex(tensor.key, torch.Size(chunk.offset))
                self.chunks[index] = (chunk, size)
                items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(chunk.offset), sizes=torch.Size(size)),
                    properties=TensorProperties(dtype=dtype), size=torch.Size(tensor.shape))))
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        return SavePlan(items)

    def create_global_plan(self, all_plans):
        plans, metadata = create_default_global_save_plan(all_plans, rewrite_index_hints=False)
        metadata.mcore_data = {t.key: {} for t in self.tensors}  # what Megatron's planner records
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(_none_object())
        chunk, size = self.chunks[write_item.index]
        data = self.source.rows(chunk).reshape(size).contiguous()
        if self.advance:
            self.advance(data.numel() * data.element_size())
        return data


def file_count(total_bytes: int, file_bytes: int = FILE_BYTES) -> int:
    """How many .distcp files a checkpoint of `total_bytes` is split into: from the input alone, so
    the bytes written do not depend on how many threads write them."""
    return max(1, min(MAX_FILES, -(-total_bytes // file_bytes)))


class _DeterministicWriter(FileSystemWriter):
    """DCP stamps ids and paths into .metadata (StorageMeta); we store none, so the same input always
    gives the same bytes (Megatron does not read it). DCP writes one file per thread; here the items
    are split into `files` files (DCP's own size balancing) and `jobs` threads take them in turn."""

    def __init__(self, path: Path, files: int, jobs: int):
        super().__init__(path, thread_count=max(1, min(jobs, files)))
        self.files = files

    def write_data(self, plan, planner):
        todo: queue.Queue = queue.Queue()
        for i, bucket in enumerate(_split_by_size_and_type(self.files, plan.items)):
            name = f"{plan.storage_data.prefix}{i}.distcp"
            todo.put((self.fs.concat_path(self.path, name), name, bucket))
        return self._write_data(planner, todo)

    def storage_meta(self):
        return None

    def finish(self, metadata, results) -> None:
        # Writer threads report in the order they finish: store the item locations in file order.
        ordered = sorted((r for rs in results for r in rs),
                         key=lambda r: (r.storage_data.relative_path, r.storage_data.offset))
        super().finish(metadata, [ordered])


def _dtypes(src: Path, spans: dict[str, TensorSpan], names) -> dict[str, torch.dtype]:
    """The dtype of each tensor, from the safetensors headers (`reader_spans`), refusing non-weights."""
    out = {}
    for name in names:
        dtype = spans[name].dtype
        if dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"{src}: tensor {name!r} is {dtype}; torch_dist conversion takes"
                                  " bf16/fp16/fp32 weights (convert DeepSeek's FP8 release first:"
                                  " python -m tools.weights fp8-to-bf16)")
        out[name] = dtype
    return out


def check_source(reader: ShardedReader, dims: Dims) -> dict[str, tuple[int, ...]]:
    expected = hf_shapes(dims)
    for name, shape in expected.items():
        got = reader.shape(name)
        if got != shape:
            raise CheckpointError(f"{reader.dir}: tensor {name!r} has shape {list(got)},"
                                  f" config.json implies {list(shape)}")
    return expected


def header(config: dict, chunk_bytes: int) -> dict:
    return {"format": "torch_dist", "config": config, "chunk_bytes": chunk_bytes,
            "torch": torch.__version__.split("+")[0]}


def _finished(dst: Path, head: dict) -> bool:
    manifest = dst / "manifest.json"
    if not manifest.is_file():
        return False
    recorded = read_json(manifest, "manifest")
    files = recorded.get("files")
    return recorded.get("header") == json.loads(json.dumps(head)) and isinstance(files, dict) and bool(files) and all(
        (dst / rel).is_file() and sha256(dst / rel) == digest for rel, digest in files.items())


def hf_to_torch_dist(src: Path, dst: Path, *, resume: bool = False, jobs: int = 2,
                     chunk_bytes: int = CHUNK_BYTES, file_bytes: int = FILE_BYTES, say=print) -> None:
    """Convert; the checkpoint appears at `dst` only when complete (built in `<dst>.partial`).
    `jobs` threads write the .distcp files (each holds one chunk and torch's copy of it), then hash
    them; the bytes depend on `chunk_bytes` and `file_bytes`, not on `jobs`."""
    config = load_config(src)
    dims = dims_from_config(config, str(src / "config.json"))
    head = header(config, chunk_bytes)
    if dst.exists() and any(dst.iterdir()):
        if not resume:
            raise CheckpointError(f"{dst} is not empty; pass --resume to check a previous conversion there,"
                                  " or choose an empty destination")
        if _finished(dst, head):
            say(f"{dst}: already converted (manifest verified), nothing to do")
            return
        raise CheckpointError(f"{dst} holds something other than a finished conversion of {src};"
                              " choose an empty destination")
    reader = ShardedReader(src)
    shapes = check_source(reader, dims)
    spans = reader_spans(reader)
    dtypes = _dtypes(src, spans, shapes)
    tensors = plan(dims, shapes, chunk_bytes=chunk_bytes)
    objects = extra_state_keys(dims)
    total = sum(math.prod(shapes[n]) * dtypes[n].itemsize for n in shapes)
    partial = dst.with_name(dst.name + ".partial")
    # torch_dist is one logical unit (one .metadata for all files): an interrupted run starts over.
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    say(f"writing {len(tensors)} tensors ({total / 2**30:.2f} GiB) and {len(objects)} objects to {dst}")
    source = _Source(spans)
    planner = _LazySavePlanner(tensors, objects, shapes, dtypes, source, progress(total, "torch_dist"))
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp_save({}, storage_writer=_DeterministicWriter(partial, file_count(total, file_bytes), jobs),
                     planner=planner, no_dist=True)
    finally:
        source.close()
    torch.save({}, partial / COMMON_FILE)
    (partial / "metadata.json").write_text(json.dumps(BACKEND_CONFIG))
    written = sorted(p for p in partial.iterdir() if p.is_file())
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:  # hashlib lets go of the GIL
        files = dict(zip((p.name for p in written), pool.map(sha256, written), strict=True))
    manifest = {"header": head, "files": files}
    (partial / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    if dst.exists():
        dst.rmdir()  # empty (checked above)
    os.replace(partial, dst)
    say(f"done: {dst} ({len(files)} files)")


class _CompareLoadPlanner(LoadPlanner):
    """Read back every chunk the plan wrote and hand it to `check` (one chunk in memory at a time)."""

    def __init__(self, tensors: list[DistTensor], shapes: dict, dtypes: dict, check: Callable):
        self.tensors, self.shapes, self.dtypes, self.check = tensors, shapes, dtypes, check
        self.chunks: dict[MetadataIndex, Chunk] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for tensor in self.tensors:
            stored = self.metadata.state_dict_metadata.get(tensor.key)
            if stored is None or tuple(stored.size) != tensor.shape:
                self.check(tensor.key, None, f"missing or shaped {None if stored is None else list(stored.size)},"
                                             f" expected {list(tensor.shape)}")
                continue
            for chunk in tensor.chunks:
                index = MetadataIndex(tensor.key, torch.Size(chunk.offset))
                size = chunk_size(chunk, tensor, self.shapes[chunk.source])
                self.chunks[index] = chunk
                zero = torch.Size([0] * len(size))
                items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=zero,
                                      storage_index=index, storage_offsets=zero, lengths=torch.Size(size)))
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        pass

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        chunk = self.chunks[read_item.dest_index]
        return torch.empty(tuple(read_item.lengths), dtype=self.dtypes[chunk.source])

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self.check(read_item.dest_index.fqn, self.chunks[read_item.dest_index], tensor)


def _check_files(converted: Path) -> None:
    """DCP's .metadata readable, and every .distcp file it names there and long enough for the bytes it
    places in it: DCP's own errors name no file."""
    path = converted / ".metadata"
    try:
        metadata = FileSystemReader(converted).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found; is {converted} an hf-to-mcore torch_dist output?") from None
    except Exception as exc:  # noqa: BLE001 - an unpickling error can be of any type
        raise CheckpointError(f"{path}: not a readable torch_dist .metadata ({first_line(exc)});"
                              " convert again") from None
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(ends.items()):
        file = converted / rel
        if not file.is_file():
            raise CheckpointError(f"{file}: not found ({path} places data in it); convert again")
        if file.stat().st_size < end:
            raise CheckpointError(f"{file}: {file.stat().st_size} bytes, {path} places data up to byte {end}"
                                  " (truncated?); convert again")


def verify_torch_dist(src: Path, converted: Path, sample: int | None = None, seed: int = 0,
                      say=print) -> list[str]:
    """Compare every stored chunk (of `sample` random tensors, if given) bit-exact with the HF rows it
    came from; return the mismatches, each naming the Megatron key, its offset and the HF tensor."""
    dims = dims_from_config(load_config(src), str(src / "config.json"))
    reader = ShardedReader(src)
    shapes = check_source(reader, dims)
    dtypes = _dtypes(src, reader_spans(reader), shapes)
    manifest = converted / "manifest.json"
    if not manifest.is_file():
        raise CheckpointError(f"{converted}: no manifest.json from hf-to-mcore --format torch_dist")
    chunk_bytes = (read_json(manifest, "manifest").get("header") or {}).get("chunk_bytes")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise CheckpointError(f"{manifest}: no header.chunk_bytes; is {converted} an hf-to-mcore torch_dist output?")
    _check_files(converted)
    tensors = plan(dims, shapes, chunk_bytes=chunk_bytes)
    if sample is not None and sample < len(tensors):
        tensors = random.Random(seed).sample(tensors, sample)
    problems: list[str] = []

    def check(key: str, chunk: Chunk | None, got) -> None:
        if chunk is None:
            problems.append(f"{key}: {got}")
            return
        want = reader.slice(chunk.source)[chunk.row0:chunk.row1]
        if not torch.equal(got.reshape(want.shape), want):
            problems.append(f"{key} at {list(chunk.offset)}: differs from {chunk.source}"
                            f" rows {chunk.row0}:{chunk.row1}")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp_load({}, storage_reader=FileSystemReader(converted),
                     planner=_CompareLoadPlanner(tensors, shapes, dtypes, check), no_dist=True)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - DCP wraps a broken .metadata or .distcp in many types
            raise CheckpointError(f"{converted}: the torch_dist files cannot be read ({first_line(exc)});"
                                  " convert again") from None
    say(f"{converted}: {len(tensors)} tensors checked, {len(problems)} mismatches"
        + (f"; first: {problems[0]}" if problems else ""))
    return problems
