"""hf-to-mcore (legacy per-rank files), mcore-to-hf and verify on tiny DeepSeek-V3 checkpoints."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import stack
from tools.model.dims import dims_from_config
from tools.model.errors import ConfigError
from tools.model.parallel import ParallelLayout, checked
from tools.weights import legacy
from tools.weights.hf import hf_shapes, load_config
from tools.weights.io import CheckpointError, DirectWriter, ShardedReader, aligned_buffer, reader_spans
from tools.weights.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[2]
# 5 layers (1 dense), 16 experts: every required layout fits, with an uneven layer list.
TINY = {"num_hidden_layers": 5, "n_routed_experts": 16}
LAYOUTS = {
    "tp1-pp1-ep1": ParallelLayout(),
    "tp2-pp2-ep2": ParallelLayout(tp=2, pp=2, ep=2, layer_list=(2, 3)),
    "tp4-pp2-ep4-extend": ParallelLayout(tp=4, pp=2, ep=4, layer_list=(3, 2), extend_ep=True),
}
quiet = {"say": lambda *a: None}


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("hf")
    make_tiny(src, overrides=TINY, shards=3)
    return src


def _rank(directory: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(directory / "iter_0000001" / name / "model_optim_rng.pt", weights_only=True)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_round_trip_is_bit_exact(hf, tmp_path, layout):
    converted, back = tmp_path / "mcore", tmp_path / "back"
    legacy.hf_to_legacy(hf, converted, LAYOUTS[layout], **quiet)
    assert legacy.verify(hf, converted, **quiet) == []
    legacy.legacy_to_hf(converted, hf, back, **quiet)
    source, result = ShardedReader(hf), ShardedReader(back)
    assert sorted(source.names()) == sorted(result.names())
    for name in source.names():
        a, b = source.get(name), result.get(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_file_layout_and_header(hf, tmp_path):
    legacy.hf_to_legacy(hf, tmp_path, LAYOUTS["tp2-pp2-ep2"], **quiet)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    names = sorted(p.name for p in (tmp_path / "iter_0000001").iterdir())
    assert names == [f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(2)]
    state = _rank(tmp_path, "mp_rank_01_000_001")
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == 1
    model = state["model"]
    assert "embedding.word_embeddings.weight" in model and "output_layer.weight" not in model
    assert "output_layer.weight" in _rank(tmp_path, "mp_rank_00_001_000")["model"]
    assert "decoder.layers.2.self_attention.linear_qkv.weight" in _rank(tmp_path, "mp_rank_00_001_000")["model"]


def test_mapping_of_attention_mlp_and_experts(hf, tmp_path):
    src = ShardedReader(hf)
    dims = dims_from_config(load_config(hf))
    legacy.hf_to_legacy(hf, tmp_path, LAYOUTS["tp2-pp2-ep2"], **quiet)
    model = _rank(tmp_path, "mp_rank_01_000_001")["model"]  # tp 1, stage 0 (layers 0-1), ep 1
    a = "model.layers.0.self_attn"
    assert torch.equal(model["decoder.layers.0.self_attention.linear_qkv.weight"],
                       torch.cat([src.get(f"{a}.q_a_proj.weight"), src.get(f"{a}.kv_a_proj_with_mqa.weight")]))
    half = dims.heads * dims.v_head // 2
    assert torch.equal(model["decoder.layers.0.self_attention.linear_proj.weight"],
                       src.get(f"{a}.o_proj.weight")[:, half:])
    inner = dims.intermediate // 2  # layer 0 is dense: fc1 = cat(gate_t, up_t) for tp 1
    gate, up = src.get("model.layers.0.mlp.gate_proj.weight"), src.get("model.layers.0.mlp.up_proj.weight")
    assert torch.equal(model["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[inner:], up[inner:]]))
    # layer 1 is MoE; ep 1 of 2 holds experts 8..15, each expert's F split over TP (tp 1: second half)
    f = dims.moe_intermediate // 2
    e8 = "model.layers.1.mlp.experts.8"
    w1 = model["decoder.layers.1.mlp.experts.weight1"]
    assert w1.shape == (dims.hidden, 8 * 2 * f)
    assert torch.equal(w1[:, : 2 * f], torch.cat([src.get(f"{e8}.gate_proj.weight")[f:],
                                                  src.get(f"{e8}.up_proj.weight")[f:]]).t())
    w2 = model["decoder.layers.1.mlp.experts.weight2"]
    assert torch.equal(w2[:f], src.get(f"{e8}.down_proj.weight")[:, f:].t())
    assert torch.equal(model["decoder.layers.1.mlp.router.expert_bias"],
                       src.get("model.layers.1.mlp.gate.e_score_correction_bias"))


def test_tp_extend_ep_gives_each_rank_whole_experts(hf, tmp_path):
    src = ShardedReader(hf)
    legacy.hf_to_legacy(hf, tmp_path, LAYOUTS["tp4-pp2-ep4-extend"], **quiet)
    model = _rank(tmp_path, "mp_rank_03_001_002")["model"]  # group ep*TP+tp = 11 -> expert 11; stage 1: layer 3
    w1 = model["decoder.layers.0.mlp.experts.weight1"]
    e = "model.layers.3.mlp.experts.11"
    assert torch.equal(w1, torch.cat([src.get(f"{e}.gate_proj.weight"), src.get(f"{e}.up_proj.weight")]).t())


def test_killed_run_resumes_to_identical_bytes(hf, tmp_path, monkeypatch):
    clean, resumed = tmp_path / "clean", tmp_path / "resumed"
    legacy.hf_to_legacy(hf, clean, LAYOUTS["tp2-pp2-ep2"], jobs=1, **quiet)
    real_save, calls = torch.save, []

    def dying_save(obj, path, *args, **kw):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real_save(obj, path, *args, **kw)

    monkeypatch.setattr(legacy.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        legacy.hf_to_legacy(hf, resumed, LAYOUTS["tp2-pp2-ep2"], jobs=1, **quiet)
    monkeypatch.setattr(legacy.torch, "save", real_save)
    assert not list(resumed.rglob("*.tmp")), "no half-written file under any name"
    assert 2 <= len(list(resumed.rglob("model_optim_rng.pt"))) < 8  # a worker may finish one more file
    with pytest.raises(CheckpointError, match="--resume"):
        legacy.hf_to_legacy(hf, resumed, LAYOUTS["tp2-pp2-ep2"], **quiet)
    first = next(resumed.rglob("model_optim_rng.pt"))
    first.write_bytes(b"corrupted")  # a finished file that no longer matches its sha256 is redone
    legacy.hf_to_legacy(hf, resumed, LAYOUTS["tp2-pp2-ep2"], resume=True, **quiet)
    files = sorted(p.relative_to(clean) for p in clean.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(resumed) for p in resumed.rglob("*") if p.is_file())
    for rel in files:
        assert (clean / rel).read_bytes() == (resumed / rel).read_bytes(), rel


def test_resume_refuses_a_different_conversion(hf, tmp_path):
    legacy.hf_to_legacy(hf, tmp_path, LAYOUTS["tp1-pp1-ep1"], **quiet)
    with pytest.raises(CheckpointError, match="different conversion"):
        legacy.hf_to_legacy(hf, tmp_path, LAYOUTS["tp2-pp2-ep2"], resume=True, **quiet)


@pytest.mark.parametrize("layout, message", [
    (ParallelLayout(pp=2, layer_list=(2, 2)), "summing to num_hidden_layers 5"),
    (ParallelLayout(pp=2, layer_list=(5,)), "--pp 2 positive entries"),
    (ParallelLayout(pp=2), "not divisible by --pp 2"),
    (ParallelLayout(tp=3), "num_attention_heads 4 is not divisible by --tp = 3"),
    (ParallelLayout(tp=2, ep=16, extend_ep=True), "n_routed_experts 16 is not divisible by --ep * --tp"),
    (ParallelLayout(ep=3), "n_routed_experts 16 is not divisible by --ep = 3"),
    (ParallelLayout(tp=2, etp=1), "expert_tensor_parallel_size is 1: each expert is split over --tp 2"),
])
def test_bad_layouts_name_the_field(hf, tmp_path, layout, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*")):
        legacy.hf_to_legacy(hf, tmp_path / "out", layout, **quiet)
    assert not (tmp_path / "out").exists()


def test_fp8_source_is_refused(tmp_path):
    make_tiny(tmp_path / "fp8", fp8=True, overrides=TINY)
    with pytest.raises(CheckpointError, match="fp8-to-bf16"):
        legacy.hf_to_legacy(tmp_path / "fp8", tmp_path / "out", LAYOUTS["tp1-pp1-ep1"], **quiet)


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    src = tmp_path / "hf"
    make_tiny(src, overrides=TINY, shards=1)
    shard = next(src.glob("*.safetensors"))
    tensors = load_file(shard)
    cut = tensors["model.layers.2.self_attn.o_proj.weight"][:, :-1].contiguous()
    tensors["model.layers.2.self_attn.o_proj.weight"] = cut
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=r"model.layers.2.self_attn.o_proj.weight has shape \[200, 95\]"):
        legacy.hf_to_legacy(src, tmp_path / "out", LAYOUTS["tp1-pp1-ep1"], **quiet)
    del tensors["model.layers.2.self_attn.o_proj.weight"]
    save_file(tensors, str(shard))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.self_attn.o_proj.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'model.layers.2.self_attn.o_proj.weight' is not in the checkpoint"):
        legacy.hf_to_legacy(src, tmp_path / "out2", LAYOUTS["tp1-pp1-ep1"], **quiet)


def test_verify_names_the_first_mismatch(hf, tmp_path):
    legacy.hf_to_legacy(hf, tmp_path, LAYOUTS["tp2-pp2-ep2"], **quiet)
    path = tmp_path / "iter_0000001/mp_rank_00_001_001/model_optim_rng.pt"
    state = torch.load(path, weights_only=True)
    state["model"]["decoder.layers.1.mlp.experts.weight2"][3, 5] += 1
    torch.save(state, path)
    mismatches = legacy.verify(hf, tmp_path, **quiet)
    assert len(mismatches) == 1
    assert mismatches[0].startswith("iter_0000001/mp_rank_00_001_001/model_optim_rng.pt:"
                                    " decoder.layers.1.mlp.experts.weight2 differs from model.layers.3.mlp.experts.8")
    assert legacy.verify(hf, tmp_path, sample=5, seed=1, **quiet) in ([], mismatches)


def test_memory_budget_below_one_rank_file_is_refused(hf, tmp_path):
    with pytest.raises(CheckpointError, match="--max-memory 0.0001 GB is below the largest rank file .* staging"):
        legacy.hf_to_legacy(hf, tmp_path, LAYOUTS["tp1-pp1-ep1"], max_memory_gb=0.0001, **quiet)


def test_cli_end_to_end(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "tools.weights", *args], cwd=ROOT, capture_output=True,
                              text=True)

    assert cli("make-tiny", "--dst", str(tmp_path / "hf"), "--set", "num_hidden_layers=5",
               "--set", "n_routed_experts=16").returncode == 0
    dry = cli("hf-to-mcore", "--src", str(tmp_path / "hf"), "--dst", str(tmp_path / "mc"), "--format", "legacy",
              "--tp", "2", "--pp", "2", "--ep", "2", "--num-layer-list", "2,3", "--dry-run")
    assert dry.returncode == 0 and dry.stdout.count("model_optim_rng.pt") == 8
    assert not (tmp_path / "mc").exists()
    run = cli("hf-to-mcore", "--src", str(tmp_path / "hf"), "--dst", str(tmp_path / "mc"), "--format", "legacy",
              "--tp", "2", "--pp", "2", "--ep", "2", "--num-layer-list", "2,3")
    assert run.returncode == 0, run.stderr
    assert cli("verify", "--src", str(tmp_path / "hf"), "--converted", str(tmp_path / "mc")).returncode == 0
    bad = cli("hf-to-mcore", "--src", str(tmp_path / "hf"), "--dst", str(tmp_path / "mc2"), "--format", "legacy",
              "--tp", "3")
    assert bad.returncode == 2 and "num_attention_heads 4 is not divisible by --tp = 3" in bad.stderr
    for command in ("hf-to-mcore", "mcore-to-hf", "verify", "make-tiny"):
        assert cli(command, "--help").returncode == 0


# ---------------------------------------------------------------- the fast writer against the plain reference


def _reference_bytes(hf: Path, layout: ParallelLayout, rel: str) -> bytes:
    """A rank file the plain way: build_tensor (torch.cat of safetensors slices), torch.save to BytesIO."""
    dims = dims_from_config(load_config(hf))
    layout = checked(dims, layout)
    reader = ShardedReader(hf)
    state = {spec.name: legacy.build_tensor(reader, spec) for spec in legacy.plan(dims, layout)[rel]}
    buf = io.BytesIO()
    torch.save({"model": state, "checkpoint_version": 3.0, "iteration": legacy.ITERATION}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("direct_io", [True, False])
def test_rank_files_are_the_bytes_of_a_plain_torch_save(hf, tmp_path, layout, direct_io):
    """Arena tensors, pread, the blocked transposes, O_DIRECT and its padding change no byte."""
    manifest = legacy.hf_to_legacy(hf, tmp_path, LAYOUTS[layout], direct_io=direct_io, **quiet)
    ranks = [rel for rel in manifest.files if rel.endswith(".pt")]
    assert len(ranks) == {"tp1-pp1-ep1": 1, "tp2-pp2-ep2": 8, "tp4-pp2-ep4-extend": 32}[layout]
    for rel in ranks:
        expected = _reference_bytes(hf, LAYOUTS[layout], rel)
        assert (tmp_path / rel).read_bytes() == expected, rel
        assert manifest.files[rel] == hashlib.sha256(expected).hexdigest(), rel


def test_builder_matches_build_tensor_with_large_pieces(tmp_path):
    """Sizes where torch takes its blocked-transpose path (>= 3600 elements per piece), and fp32 router bias."""
    src = tmp_path / "hf"
    make_tiny(src, overrides={"num_hidden_layers": 2, "n_routed_experts": 4, "hidden_size": 256,
                              "moe_intermediate_size": 96, "intermediate_size": 192}, shards=2, tokenizer=False)
    dims = dims_from_config(load_config(src))
    reader = ShardedReader(src)
    spans = reader_spans(reader)
    shapes = hf_shapes(dims)
    fds = {p: os.open(p, os.O_RDONLY) for p in {s.path for s in spans.values()}}
    builder = legacy.RankBuilder(spans, fds)
    try:
        for layout in (ParallelLayout(tp=2, ep=2), ParallelLayout(tp=2, pp=2, ep=2, extend_ep=True)):
            for rel, specs in legacy.plan(dims, checked(dims, layout)).items():
                state = builder.build(specs, shapes)
                for spec in specs:
                    want = legacy.build_tensor(reader, spec)
                    got = state[spec.name]
                    assert got.dtype == want.dtype and got.shape == want.shape, (rel, spec.name)
                    assert torch.equal(got, want), (rel, spec.name)
                    assert got.untyped_storage().nbytes() == want.numel() * want.element_size()  # a storage of its own
    finally:
        builder.close()
        for fd in fds.values():
            os.close(fd)


def test_a_tight_memory_budget_runs_fewer_writers_with_the_same_bytes(hf, tmp_path):
    free = legacy.hf_to_legacy(hf, tmp_path / "free", LAYOUTS["tp2-pp2-ep2"], jobs=2, **quiet)
    dims = dims_from_config(load_config(hf))
    layout = checked(dims, LAYOUTS["tp2-pp2-ep2"])
    reader = ShardedReader(hf)
    one = legacy.RankBuilder.memory_needed(reader_spans(reader), hf_shapes(dims), legacy.plan(dims, layout).values())
    said = []
    tight = legacy.hf_to_legacy(hf, tmp_path / "tight", LAYOUTS["tp2-pp2-ep2"], jobs=2,
                                max_memory_gb=1.5 * one / 2**30, say=said.append)
    assert any(line.startswith("1 writer(s), not 2") for line in said), said
    assert tight.files == free.files


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 3 * 8192 + 17])
@pytest.mark.parametrize("buffers", [1, 2])
def test_direct_writer_writes_and_hashes_exactly_what_it_is_given(tmp_path, size, buffers):
    from concurrent.futures import ThreadPoolExecutor

    data = bytes(range(256)) * (size // 256 + 1)
    data = data[:size]
    with ThreadPoolExecutor(1) as pool:
        with DirectWriter(tmp_path / "f", tuple(aligned_buffer(8192) for _ in range(buffers)), io=pool) as out:
            for i in range(0, size, 3000):  # writes that straddle buffer and block boundaries
                assert out.write(memoryview(data)[i:i + 3000]) == len(data[i:i + 3000])
    assert (tmp_path / "f").read_bytes() == data
    assert out.sha.hexdigest() == hashlib.sha256(data).hexdigest()


def test_direct_writer_falls_back_where_o_direct_is_refused(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    with DirectWriter(tmp_path / "f") as out:
        out.write(b"x" * 5000)
    assert not out.direct and (tmp_path / "f").read_bytes() == b"x" * 5000


def test_a_failed_write_leaves_no_file(hf, tmp_path, monkeypatch):
    def broken_save(obj, f, *args, **kw):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(legacy.torch, "save", broken_save)
    with pytest.raises(OSError, match="No space"):
        legacy.hf_to_legacy(hf, tmp_path, LAYOUTS["tp2-pp2-ep2"], **quiet)
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "manifest.json"]


def test_direct_writer_carries_on_when_direct_writes_are_refused(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        stack.missing("os.O_DIRECT (this platform has none)", "run on Linux, as CI does")
    import fcntl

    real_write, refused = os.write, []

    def picky_write(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(22, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", picky_write)
    data = os.urandom(3 * 8192 + 100)
    with DirectWriter(tmp_path / "f", (aligned_buffer(8192),)) as out:
        out.write(data)
    assert not out.direct and len(refused) <= 1  # refused once (where open took O_DIRECT), then page cache
    assert (tmp_path / "f").read_bytes() == data and out.sha.hexdigest() == hashlib.sha256(data).hexdigest()


def test_jobs_change_the_speed_not_the_bytes(hf, tmp_path):
    one = legacy.hf_to_legacy(hf, tmp_path / "one", LAYOUTS["tp2-pp2-ep2"], jobs=1, **quiet)
    two = legacy.hf_to_legacy(hf, tmp_path / "two", LAYOUTS["tp2-pp2-ep2"], jobs=2, **quiet)
    assert len(one.files) == 9 and one.files == two.files  # 8 rank files + latest, by sha256
    for rel in one.files:
        assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "two" / rel).read_bytes(), rel
    assert legacy.verify(hf, tmp_path / "two", **quiet) == []
