"""HF DeepSeek-V3 <-> Megatron legacy per-rank checkpoints (what MindSpeed-LLM loads), and verify.

The layout is planned by pure functions: every tensor of every rank file is a `RankTensor`, a
concatenation of `Piece`s, each a slice of one HF tensor (optionally transposed). The writer, the
inverse (mcore-to-hf) and the verifier all walk the same plan, so they cannot disagree about the
mapping. Mapping (MindSpeed-LLM DeepSeek-V3 layer spec):

  linear_qkv = cat(q_a_proj, kv_a_proj_with_mqa), replicated   linear_proj (o_proj): split dim 1
  linear_qb / linear_kvb: split dim 0                          q_layernorm / k_layernorm: replicated
  linear_fc1 = per TP rank cat(gate_t, up_t); linear_fc2 split dim 1 (dense MLP and shared experts)
  router.weight, router.expert_bias (e_score_correction_bias): replicated
  experts.weight1 [H, E_local*2F] = cat over local experts of cat(gate, up).T
  experts.weight2 [E_local*F, H]  = cat over local experts of down.T
  with --moe-tp-extend-ep rank (ep, tp) holds expert group ep*TP+tp whole; without, EP groups then
  each expert's F split over TP. Embedding on the first stage, final norm and output on the last.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from tools.model.dims import Dims, dims_from_config
from tools.model.parallel import ParallelLayout, checked
from tools.weights.hf import hf_shapes, hf_tensors, load_config
from tools.weights.io import (
    CheckpointError,
    DirectWriter,
    Manifest,
    ShardedReader,
    TensorSpan,
    aligned_buffer,
    atomic_write,
    load_torch,
    pread_into,
    progress,
    read_json,
    reader_spans,
)

ITERATION = 1
LATEST = "latest_checkpointed_iteration.txt"


def ranks(layout: ParallelLayout) -> list[tuple[int, int, int]]:
    """(tp, pp, ep) of every rank file."""
    return [(t, p, e) for p in range(layout.pp) for e in range(layout.ep) for t in range(layout.tp)]


def rank_file(layout: ParallelLayout, tp: int, pp: int, ep: int) -> str:
    suffix = f"_{ep:03d}" if layout.ep > 1 else ""
    return f"iter_{ITERATION:07d}/mp_rank_{tp:02d}_{pp:03d}{suffix}/model_optim_rng.pt"


@dataclass(frozen=True)
class Piece:
    hf: str
    dim: int  # which HF dimension is sliced
    start: int
    stop: int
    transpose: bool = False


@dataclass(frozen=True)
class RankTensor:
    name: str
    pieces: tuple[Piece, ...]
    cat_dim: int = 0


def _split(hf: str, size: int, parts: int, index: int, dim: int, transpose: bool = False) -> Piece:
    step = size // parts
    return Piece(hf, dim, index * step, (index + 1) * step, transpose)


def _whole(hf: str, size: int) -> Piece:
    return Piece(hf, 0, 0, size)


def plan(dims: Dims, layout: ParallelLayout) -> dict[str, list[RankTensor]]:
    """Rank file (relative path) -> the tensors it holds, in order; `layout` as `checked` returns it."""
    stages = layout.stages(dims.layers)
    return {rank_file(layout, t, p, e): _rank_tensors(dims, layout, stages[p], t, p, e) for t, p, e in ranks(layout)}


def _rank_tensors(dims: Dims, layout: ParallelLayout, stage: range, tp: int, pp: int, ep: int) -> list[RankTensor]:
    T = layout.tp
    out: list[RankTensor] = []
    if pp == 0:
        out.append(RankTensor("embedding.word_embeddings.weight",
                              (_split("model.embed_tokens.weight", dims.vocab, T, tp, 0),)))
    for local, layer in enumerate(stage):
        hf, mc = f"model.layers.{layer}", f"decoder.layers.{local}"
        attn = f"{hf}.self_attn"
        out += [
            RankTensor(f"{mc}.input_layernorm.weight", (_whole(f"{hf}.input_layernorm.weight", dims.hidden),)),
            RankTensor(f"{mc}.self_attention.linear_qkv.weight",
                       (_whole(f"{attn}.q_a_proj.weight", dims.q_lora_rank),
                        _whole(f"{attn}.kv_a_proj_with_mqa.weight", dims.kv_lora_rank + dims.qk_rope))),
            RankTensor(f"{mc}.self_attention.q_layernorm.weight",
                       (_whole(f"{attn}.q_a_layernorm.weight", dims.q_lora_rank),)),
            RankTensor(f"{mc}.self_attention.k_layernorm.weight",
                       (_whole(f"{attn}.kv_a_layernorm.weight", dims.kv_lora_rank),)),
            RankTensor(f"{mc}.self_attention.linear_qb.weight",
                       (_split(f"{attn}.q_b_proj.weight", dims.heads * dims.qk_head, T, tp, 0),)),
            RankTensor(f"{mc}.self_attention.linear_kvb.weight",
                       (_split(f"{attn}.kv_b_proj.weight", dims.heads * (dims.qk_nope + dims.v_head), T, tp, 0),)),
            RankTensor(f"{mc}.self_attention.linear_proj.weight",
                       (_split(f"{attn}.o_proj.weight", dims.heads * dims.v_head, T, tp, 1),)),
            RankTensor(f"{mc}.pre_mlp_layernorm.weight",
                       (_whole(f"{hf}.post_attention_layernorm.weight", dims.hidden),)),
        ]
        if not dims.is_moe(layer):
            out += _gated_mlp(f"{mc}.mlp", f"{hf}.mlp", dims.intermediate, T, tp)
            continue
        out += [
            RankTensor(f"{mc}.mlp.router.weight", (_whole(f"{hf}.mlp.gate.weight", dims.experts),)),
            RankTensor(f"{mc}.mlp.router.expert_bias",
                       (_whole(f"{hf}.mlp.gate.e_score_correction_bias", dims.experts),)),
        ]
        if dims.shared_experts:
            out += _gated_mlp(f"{mc}.mlp.shared_experts", f"{hf}.mlp.shared_experts",
                              dims.moe_intermediate * dims.shared_experts, T, tp)
        out += _grouped_experts(dims, layout, f"{mc}.mlp.experts", f"{hf}.mlp.experts", tp, ep)
    if pp == layout.pp - 1:
        out.append(RankTensor("decoder.final_layernorm.weight", (_whole("model.norm.weight", dims.hidden),)))
        if not dims.tie_embeddings:
            out.append(RankTensor("output_layer.weight", (_split("lm_head.weight", dims.vocab, T, tp, 0),)))
    return out


def _gated_mlp(mc: str, hf: str, inner: int, T: int, tp: int) -> list[RankTensor]:
    return [
        RankTensor(f"{mc}.linear_fc1.weight", (_split(f"{hf}.gate_proj.weight", inner, T, tp, 0),
                                               _split(f"{hf}.up_proj.weight", inner, T, tp, 0))),
        RankTensor(f"{mc}.linear_fc2.weight", (_split(f"{hf}.down_proj.weight", inner, T, tp, 1),)),
    ]


def _grouped_experts(dims: Dims, layout: ParallelLayout, mc: str, hf: str, tp: int, ep: int) -> list[RankTensor]:
    F = dims.moe_intermediate
    per_rank, f_parts = dims.experts // layout.expert_group, layout.expert_tp
    group = ep * layout.tp + tp if layout.extend_ep else ep  # extend-EP: rank (ep, tp) holds group ep*TP+tp whole
    first, f_index = group * per_rank, 0 if layout.extend_ep else tp
    w1, w2 = [], []
    for e in range(first, first + per_rank):
        w1 += [_split(f"{hf}.{e}.gate_proj.weight", F, f_parts, f_index, 0, transpose=True),
               _split(f"{hf}.{e}.up_proj.weight", F, f_parts, f_index, 0, transpose=True)]
        w2.append(_split(f"{hf}.{e}.down_proj.weight", F, f_parts, f_index, 1, transpose=True))
    return [RankTensor(f"{mc}.weight1", tuple(w1), cat_dim=1), RankTensor(f"{mc}.weight2", tuple(w2), cat_dim=0)]


# ---------------------------------------------------------------- reading pieces


def read_piece(reader: ShardedReader, piece: Piece) -> torch.Tensor:
    """Only the bytes of the slice are read (safetensors slices are lazy)."""
    view = reader.slice(piece.hf)
    index = (slice(piece.start, piece.stop),) if piece.dim == 0 else (slice(None), slice(piece.start, piece.stop))
    tensor = view[index]
    return tensor.t() if piece.transpose else tensor


def build_tensor(reader: ShardedReader, spec: RankTensor) -> torch.Tensor:
    parts = [read_piece(reader, p) for p in spec.pieces]
    return torch.cat(parts, dim=spec.cat_dim) if len(parts) > 1 else parts[0].contiguous().clone()


def piece_shape(piece: Piece, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
    shape = list(hf_shape)
    shape[piece.dim] = piece.stop - piece.start
    return tuple(reversed(shape)) if piece.transpose else tuple(shape)


def piece_regions(spec: RankTensor, tensor: torch.Tensor, shapes: dict[str, tuple[int, ...]]):
    """(piece, the region of `tensor` that came from it, in the HF tensor's orientation)."""
    offset = 0
    for piece in spec.pieces:
        extent = piece_shape(piece, shapes[piece.hf])[spec.cat_dim]
        region = tensor.narrow(spec.cat_dim, offset, extent)
        offset += extent
        yield piece, (region.t() if piece.transpose else region)


def hf_region(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    return tensor.narrow(piece.dim, piece.start, piece.stop - piece.start)


# ---------------------------------------------------------------- hf -> legacy


def header(dims_config: dict, layout: ParallelLayout, reader: ShardedReader) -> dict:
    """What a destination was made from; a resumed run must match it exactly."""
    weight_map = json.dumps(reader.weight_map, sort_keys=True).encode()
    return {"format": "legacy", "layout": layout.to_manifest(),
            "config_sha256": hashlib.sha256(json.dumps(dims_config, sort_keys=True).encode()).hexdigest(),
            "weight_map_sha256": hashlib.sha256(weight_map).hexdigest()}


def _check_source(reader: ShardedReader, config: dict, dims: Dims) -> list[str]:
    """Refuse FP8 input; return the HF tensors the model does not use (reported, not converted)."""
    if config.get("quantization_config") or any(n.endswith("_scale_inv") for n in reader.names()):
        raise CheckpointError(f"{reader.dir} is an FP8 checkpoint (quantization_config / *_scale_inv):"
                              " convert it with `python -m tools.weights fp8-to-bf16` first")
    expected = hf_tensors(dims)
    for name, (shape, _) in expected.items():
        got = reader.shape(name)
        if got != shape:
            raise CheckpointError(f"{reader.dir}: tensor {name} has shape {list(got)},"
                                  f" config.json implies {list(shape)}")
    return sorted(set(reader.names()) - set(expected))


def _file_bytes(specs: list[RankTensor], shapes: dict, itemsize: int = 2) -> int:
    total = 0
    for spec in specs:
        for piece in spec.pieces:
            n = 1
            for d in piece_shape(piece, shapes[piece.hf]):
                n *= d
            total += n * itemsize
    return total


def hf_to_legacy(src: Path, dst: Path, layout: ParallelLayout, *, resume: bool = False, jobs: int = 2,
                 max_memory_gb: float = 16.0, direct_io: bool = True, say=print) -> Manifest:
    """Write the rank files. Each of `jobs` threads builds one file at a time in memory it keeps
    (`RankBuilder`) and streams it through torch.save into a `DirectWriter` (hashed as written,
    around the page cache unless `direct_io` is False); the bytes do not depend on either."""
    config = load_config(src)
    dims = dims_from_config(config, str(src / "config.json"))
    layout = checked(dims, layout)
    reader = ShardedReader(src)
    unused = _check_source(reader, config, dims)
    if unused:
        say(f"not part of the model, left out: {len(unused)} tensors ({', '.join(unused[:3])}...)")
    manifest = Manifest.resume(dst, header(config, layout, reader), resume)
    shapes = hf_shapes(dims)
    files = plan(dims, layout)
    sizes = {rel: _file_bytes(specs, shapes) for rel, specs in files.items()}
    spans = reader_spans(reader)  # from here on the shards are read with pread, not mapped
    reader.close()
    per_writer = RankBuilder.memory_needed(spans, shapes, files.values())
    budget = int(max_memory_gb * 2**30)
    biggest = max(sizes, key=sizes.get)
    if per_writer > budget:
        raise CheckpointError(f"--max-memory {max_memory_gb} GB is below the largest rank file {biggest}"
                              f" ({sizes[biggest] / 2**30:.2f} GB) with its staging buffers"
                              f" ({per_writer / 2**30:.2f} GB in all); raise it")
    # largest first: the last files to finish are small ones, so the writers end together
    todo = sorted((rel for rel in files if not manifest.done(rel)), key=lambda rel: -sizes[rel])
    say(f"{len(files)} rank files, {len(files) - len(todo)} already done;"
        f" {sum(sizes[r] for r in todo) / 2**30:.2f} GB to write")
    tick = progress(sum(sizes[r] for r in todo), "hf-to-mcore")
    # Each writer keeps its buffers warm between files (see RankBuilder), so the budget caps how
    # many writers run: together they never hold more than --max-memory.
    writers = max(1, min(jobs, len(todo), budget // per_writer))
    if writers < min(jobs, len(todo)):
        say(f"{writers} writer(s), not {jobs}: each holds up to {per_writer / 2**30:.2f} GB and"
            f" --max-memory is {max_memory_gb} GB")
    fds = {path: os.open(path, os.O_RDONLY) for path in {span.path for span in spans.values()}}
    builders: queue.SimpleQueue[RankBuilder] = queue.SimpleQueue()
    for _ in range(writers):
        builders.put(RankBuilder(spans, fds))
    lock = threading.Lock()

    def write(rel: str) -> None:
        builder = builders.get()
        try:
            state = builder.build(files[rel], shapes)  # views of the builder's arena: used before it is reused
            with atomic_write(dst / rel) as tmp, DirectWriter(tmp, builder.out_buffers, direct_io, builder.io) as out:
                torch.save({"model": state, "checkpoint_version": 3.0, "iteration": ITERATION}, out)
            digest = out.sha.hexdigest()  # hashed as written: no second read of the file
        finally:
            builders.put(builder)
        with lock:
            manifest.record(rel, digest)
        if tick:
            tick(sizes[rel])

    try:
        with ThreadPoolExecutor(max_workers=writers) as pool:
            futures = [pool.submit(write, rel) for rel in todo]
            try:
                for future in as_completed(futures):
                    future.result()
            except BaseException:
                pool.shutdown(cancel_futures=True)  # stop at the first failure; finished files stay recorded
                raise
    finally:
        while not builders.empty():
            builders.get().close()
        for fd in fds.values():
            os.close(fd)
    if not manifest.done(LATEST):
        with atomic_write(dst / LATEST) as tmp:
            tmp.write_text(f"{ITERATION}")
        manifest.record(LATEST)
    say(f"wrote {dst} ({len(files)} rank files, manifest.json)")
    return manifest


def _align(n: int, to: int = 64) -> int:
    return -(-n // to) * to


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class RankBuilder:
    """Builds the tensors of one rank file at a time, in memory it keeps for the next file.

    The same values as `build_tensor` (the plain reference, which tests compare it with), produced
    the way the hardware likes (bf16, one core of the 2-core development machine):
    - every output tensor is written once, into an arena reused from file to file: fresh
      allocations fault their pages in on first touch (2-3.5 GB/s), warm memory copies at 10+ GB/s;
    - HF bytes are read with pread, straight into their place when the slice is one byte range
      (a dim-0 split), and never through a memory map, whose pages would count as resident;
    - a transposed expert weight is gathered untransposed and turned by one copy into a contiguous
      destination from a transposed contiguous source, which torch does as a blocked transpose
      (2 GB/s), instead of a cat of transposed views (0.25-0.9 GB/s).
    Each output tensor has a storage of its own (torch.frombuffer over its slice of the arena), so
    torch.save writes the bytes it writes for freshly allocated tensors. One builder per writer.
    With `fds=None` it only measures: tensors live on the meta device and nothing is read.
    """

    OUT_BUFFER = 8 << 20  # each of the DirectWriter's two

    def __init__(self, spans: dict[str, TensorSpan], fds: dict[Path, int] | None):
        self.spans, self.fds = spans, fds
        self.buffers: dict[str, torch.Tensor] = {}
        self.peak: dict[str, int] = {}
        if fds is not None:  # one buffer is written out while the other fills
            self.out_buffers = (aligned_buffer(self.OUT_BUFFER), aligned_buffer(self.OUT_BUFFER))
            self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rank-file-io")

    def close(self) -> None:
        if self.fds is not None:
            self.io.shutdown()

    @classmethod
    def memory_needed(cls, spans: dict[str, TensorSpan], shapes: dict, files) -> int:
        """Bytes one builder holds at most over the given rank files (its arena and staging)."""
        dry = cls(spans, None)
        for specs in files:
            dry.build(specs, shapes)
        return sum(dry.peak.values()) + 2 * cls.OUT_BUFFER

    def _buffer(self, slot: str, nbytes: int) -> torch.Tensor:
        """uint8 memory of at least `nbytes` that stays with the builder (grown, never shrunk)."""
        self.peak[slot] = max(self.peak.get(slot, 0), nbytes)
        if self.fds is None:
            return torch.empty(nbytes, dtype=torch.uint8, device="meta")
        buf = self.buffers.get(slot)
        if buf is None or buf.numel() < nbytes:
            self.buffers.pop(slot, None)  # let the smaller one go before allocating the larger
            buf = self.buffers[slot] = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        return buf

    def _scratch(self, slot: str, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = _numel(shape) * dtype.itemsize
        return self._buffer(slot, nbytes)[:nbytes].view(dtype).view(shape)

    def _read(self, name: str, start: int, stop: int, dest: torch.Tensor) -> None:
        """Rows start:stop (dim 0) of HF tensor `name` into the contiguous tensor `dest`."""
        span = self.spans[name]
        if self.fds is None:
            return
        rows = span.row_bytes()
        target = dest.reshape(-1).view(torch.uint8).numpy()
        if target.nbytes != (stop - start) * rows:
            raise CheckpointError(f"{span.path}: tensor {name} rows {start}:{stop} do not fill {list(dest.shape)}")
        pread_into(self.fds[span.path], target, span.offset + start * rows, span.path)

    def build(self, specs: list[RankTensor], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        placed, offset = [], 0
        for spec in specs:
            dtype = self.spans[spec.pieces[0].hf].dtype
            for piece in spec.pieces[1:]:
                dtype = torch.promote_types(dtype, self.spans[piece.hf].dtype)  # as torch.cat would
            shape = list(piece_shape(spec.pieces[0], shapes[spec.pieces[0].hf]))
            shape[spec.cat_dim] = sum(piece_shape(p, shapes[p.hf])[spec.cat_dim] for p in spec.pieces)
            nbytes = _numel(shape) * dtype.itemsize
            placed.append((spec, dtype, tuple(shape), offset, nbytes))
            offset += _align(nbytes)
        arena = self._buffer("arena", offset)
        memory = memoryview(arena.numpy()) if self.fds is not None else None
        state = {}
        for spec, dtype, shape, at, nbytes in placed:
            if memory is None:
                out = torch.empty(shape, dtype=dtype, device="meta")
            else:
                out = torch.frombuffer(memory[at:at + nbytes], dtype=dtype).view(shape)
            self._fill(spec, out, shapes)
            state[spec.name] = out
        return state

    def _fill(self, spec: RankTensor, out: torch.Tensor, shapes: dict) -> None:
        if out.dim() == 2 and spec.cat_dim == 1 and all(p.transpose for p in spec.pieces):
            # cat(p.T for p, dim 1) == cat(p for p, dim 0).T: gather the pieces as rows, turn once
            stage = self._scratch("stage", (out.shape[1], out.shape[0]), out.dtype)
            row = 0
            for piece in spec.pieces:
                extent = piece_shape(piece, shapes[piece.hf])[1]
                self._put(stage.narrow(0, row, extent), piece, transpose=False)
                row += extent
            out.copy_(stage.t())
            return
        offset = 0
        for piece in spec.pieces:
            extent = piece_shape(piece, shapes[piece.hf])[spec.cat_dim]
            self._put(out.narrow(spec.cat_dim, offset, extent), piece, piece.transpose)
            offset += extent

    def _put(self, region: torch.Tensor, piece: Piece, transpose: bool) -> None:
        """Write `piece` (transposed if asked) into `region`, which has its shape."""
        span = self.spans[piece.hf]
        if piece.dim == 0 and not transpose and region.is_contiguous() and region.dtype == span.dtype:
            self._read(piece.hf, piece.start, piece.stop, region)  # straight into place
            return
        if piece.dim == 0:
            source = self._scratch("rows", (piece.stop - piece.start, *span.shape[1:]), span.dtype)
            self._read(piece.hf, piece.start, piece.stop, source)
        else:
            whole = self._scratch("whole", span.shape, span.dtype)
            self._read(piece.hf, 0, span.shape[0], whole)
            source = whole.narrow(piece.dim, piece.start, piece.stop - piece.start)
            if transpose and not source.is_contiguous():  # packed first, the transpose is the fast one
                packed = self._scratch("packed", source.shape, source.dtype)
                packed.copy_(source)
                source = packed
        region.copy_(source.t() if transpose else source)


# ---------------------------------------------------------------- legacy -> hf, verify


def _converted(directory: Path) -> tuple[ParallelLayout, dict]:
    manifest = directory / "manifest.json"
    if not manifest.is_file():
        raise CheckpointError(f"{directory}: no manifest.json; is it a directory written by hf-to-mcore?")
    head = read_json(manifest, "manifest").get("header")
    if not isinstance(head, dict) or not isinstance(head.get("layout"), dict):
        raise CheckpointError(f"{manifest}: no header.layout; is {directory} an hf-to-mcore --format legacy output?")
    return ParallelLayout.from_manifest(head["layout"]), head


def _load_rank(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"rank file {path} is missing")
    state = load_torch(path, "rank file (torch.save of a dict with 'model')")
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise CheckpointError(f"{path}: not a rank file written by hf-to-mcore (no 'model' dict)")
    return state["model"]


def legacy_to_hf(converted: Path, config_dir: Path, dst: Path, say=print) -> None:
    """Reassemble HF tensors from rank files, one pipeline stage at a time; one shard per stage."""
    config = load_config(config_dir)
    dims = dims_from_config(config)
    layout, _ = _converted(converted)
    shapes = hf_shapes(dims)
    files = plan(dims, layout)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for stage in range(layout.pp):
        tensors: dict[str, torch.Tensor] = {}
        for t, p, e in ranks(layout):
            if p != stage:
                continue
            rel = rank_file(layout, t, p, e)
            state = _load_rank(converted / rel)
            for spec in files[rel]:
                for piece, region in piece_regions(spec, state[spec.name], shapes):
                    if piece.hf not in tensors:
                        tensors[piece.hf] = torch.empty(shapes[piece.hf], dtype=region.dtype)
                    hf_region(tensors[piece.hf], piece).copy_(region)
        shard = f"model-{stage + 1:05d}-of-{layout.pp:05d}.safetensors"
        with atomic_write(dst / shard) as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        say(f"stage {stage}: {len(tensors)} tensors -> {shard}")
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                 indent=2) + "\n")
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def verify(src: Path, converted: Path, sample: int | None = None, seed: int = 0, say=print) -> list[str]:
    """Compare every rank file region with its HF source, bit-exact; returns mismatches (empty = ok)."""
    config = load_config(src)
    dims = dims_from_config(config)
    layout, _ = _converted(converted)
    reader = ShardedReader(src)
    shapes = hf_shapes(dims)
    chosen = set(shapes)
    if sample is not None and sample < len(shapes):
        chosen = set(random.Random(seed).sample(sorted(shapes), sample))
    mismatches, checked = [], set()
    files = plan(dims, layout)
    for rel, specs in files.items():
        state = None
        for spec in specs:
            if not any(p.hf in chosen for p in spec.pieces):
                continue
            state = state if state is not None else _load_rank(converted / rel)
            if spec.name not in state:
                mismatches.append(f"{rel}: {spec.name} is missing")
                continue
            for piece, region in piece_regions(spec, state[spec.name], shapes):
                if piece.hf not in chosen:
                    continue
                source = read_piece(reader, Piece(piece.hf, piece.dim, piece.start, piece.stop))
                if region.dtype != source.dtype or not torch.equal(region, source):
                    mismatches.append(f"{rel}: {spec.name} differs from {piece.hf}"
                                      f"[{piece.start}:{piece.stop} on dim {piece.dim}]")
                checked.add(piece.hf)
    say(f"verified {len(checked)} HF tensors against {len(files)} rank files:"
        f" {len(mismatches)} mismatches" + (f"; first: {mismatches[0]}" if mismatches else ""))
    return mismatches
