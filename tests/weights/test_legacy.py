"""hf-to-mcore (legacy per-rank files), mcore-to-hf and verify on tiny DeepSeek-V3 checkpoints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools.weights import legacy
from tools.weights.io import CheckpointError, ShardedReader
from tools.weights.model import ConfigError, dims_from_config, load_config
from tools.weights.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[2]
# 5 layers (1 dense), 16 experts: every required layout fits, with an uneven layer list.
TINY = {"num_hidden_layers": 5, "n_routed_experts": 16}
LAYOUTS = {
    "tp1-pp1-ep1": {"tp": 1, "pp": 1, "ep": 1},
    "tp2-pp2-ep2": {"tp": 2, "pp": 2, "ep": 2, "layer_list": [2, 3]},
    "tp4-pp2-ep4-extend": {"tp": 4, "pp": 2, "ep": 4, "layer_list": [3, 2], "tp_extend_ep": True},
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
    legacy.hf_to_legacy(hf, clean, LAYOUTS["tp2-pp2-ep2"], workers=1, **quiet)
    real_save, calls = torch.save, []

    def dying_save(obj, path, *args, **kw):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real_save(obj, path, *args, **kw)

    monkeypatch.setattr(legacy.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        legacy.hf_to_legacy(hf, resumed, LAYOUTS["tp2-pp2-ep2"], workers=1, **quiet)
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
    ({"tp": 1, "pp": 2, "ep": 1, "layer_list": [2, 2]}, "summing to num_hidden_layers 5"),
    ({"tp": 1, "pp": 2, "ep": 1, "layer_list": [5]}, "--pp 2 positive entries"),
    ({"tp": 1, "pp": 2, "ep": 1}, "not divisible by --pp 2"),
    ({"tp": 3, "pp": 1, "ep": 1}, "num_attention_heads 4 is not divisible by --tp = 3"),
    ({"tp": 2, "pp": 1, "ep": 16, "tp_extend_ep": True}, "n_routed_experts 16 is not divisible by --ep * --tp"),
    ({"tp": 1, "pp": 1, "ep": 3}, "n_routed_experts 16 is not divisible by --ep = 3"),
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
    with pytest.raises(CheckpointError, match="--max-memory 0.0001 GB is below the largest rank file"):
        legacy.hf_to_legacy(hf, tmp_path, LAYOUTS["tp1-pp1-ep1"], max_memory_gb=0.0001, **quiet)


def test_cli_end_to_end(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "tools.weights", *args], cwd=ROOT, capture_output=True,
                              text=True)

    assert cli("make-tiny", "--dst", str(tmp_path / "hf"), "--set", "num_hidden_layers=5",
               "--set", "n_routed_experts=16").returncode == 0
    dry = cli("hf-to-mcore", "--src", str(tmp_path / "hf"), "--dst", str(tmp_path / "mc"), "--tp", "2", "--pp", "2",
              "--ep", "2", "--num-layer-list", "2,3", "--dry-run")
    assert dry.returncode == 0 and dry.stdout.count("model_optim_rng.pt") == 8
    assert not (tmp_path / "mc").exists()
    run = cli("hf-to-mcore", "--src", str(tmp_path / "hf"), "--dst", str(tmp_path / "mc"), "--tp", "2",
              "--pp", "2", "--ep", "2", "--num-layer-list", "2,3")
    assert run.returncode == 0, run.stderr
    assert cli("verify", "--src", str(tmp_path / "hf"), "--converted", str(tmp_path / "mc")).returncode == 0
    bad = cli("hf-to-mcore", "--src", str(tmp_path / "hf"), "--dst", str(tmp_path / "mc2"), "--tp", "3")
    assert bad.returncode == 2 and "num_attention_heads 4 is not divisible by --tp = 3" in bad.stderr
    for command in ("hf-to-mcore", "mcore-to-hf", "verify", "make-tiny"):
        assert cli(command, "--help").returncode == 0
