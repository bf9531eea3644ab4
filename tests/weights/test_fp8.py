"""fp8-to-bf16 on tiny FP8 checkpoints (tools.weights.tiny): exact dequant, whole conversion, resume, errors.

The reference everywhere is written here independently: scales expanded to full size in float64,
multiplied with the fp8 values cast to float64, rounded to bf16. (torch rounds float64 -> bf16
through fp32; that is the single fp32 rounding of the product which DeepSeek's own dequant kernel
does, so equality is the right bar.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tools.model.dims import dims_from_config
from tools.weights import fp8
from tools.weights.cli import main
from tools.weights.hf import FP8_BLOCK, hf_tensors
from tools.weights.io import INDEX, MANIFEST, sha256
from tools.weights.tiny import make_tiny, quantize_blocks

OTHER_FILES = {"tokenizer.json": '{"model": "bpe"}\n', "tokenizer_config.json": '{"bos_token": "<s>"}\n',
               "generation_config.json": '{"temperature": 0.6}\n', "figures/benchmark.txt": "not a weight\n"}


def reference_dequant(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    m, n = weight.shape
    full = scale.double().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:m, :n]
    return (weight.double() * full).to(torch.bfloat16)


def make_fp8(path: Path, **kwargs) -> Path:
    make_tiny(path, fp8=True, **{"shards": 3, **kwargs})
    for rel, text in OTHER_FILES.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    return path


@pytest.fixture
def fp8_checkpoint(tmp_path: Path) -> Path:
    return make_fp8(tmp_path / "fp8")


def load_dir(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def file_bytes(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- dequantisation


@pytest.mark.parametrize("shape", [(300, 257), (128, 128), (256, 384), (1, 5), (129, 1), (200, 328), (72, 200)])
@pytest.mark.parametrize("chunk_elements", [fp8.CHUNK_ELEMENTS, 1])  # 1: one 128-row block per step
def test_dequant_equals_float64_reference_including_edge_blocks(shape, chunk_elements, monkeypatch):
    monkeypatch.setattr(fp8, "CHUNK_ELEMENTS", chunk_elements)
    weight, scale = quantize_blocks(torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    assert scale.shape == (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))

    got = fp8.dequantize(weight, scale)

    assert got.dtype == torch.bfloat16 and got.shape == shape
    assert torch.equal(got, reference_dequant(weight, scale))


def test_dequant_of_a_hand_made_300x257_weight_uses_each_blocks_own_scale():
    # every block its own power-of-two scale, so a block given a neighbour's scale shows at once
    weight = torch.full((300, 257), 1.5).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0 ** (i * 3 + j) for j in range(3)] for i in range(3)])

    got = fp8.dequantize(weight, scale).float()

    for i, rows in enumerate([slice(0, 128), slice(128, 256), slice(256, 300)]):
        for j, cols in enumerate([slice(0, 128), slice(128, 256), slice(256, 257)]):
            assert torch.all(got[rows, cols] == 1.5 * 2.0 ** (i * 3 + j)), (i, j)
    assert torch.equal(got.bfloat16(), reference_dequant(weight, scale))


def test_every_e4m3_byte_dequantises_like_torchs_own_cast():
    """All 256 bit patterns: normals, subnormals, +-0 and the NaN bytes (which take torch's slow cast)."""
    weight = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(2, 128).contiguous()
    scale = torch.tensor([[0.37]])
    expected = reference_dequant(weight, scale)

    got = fp8.dequantize(weight, scale)

    assert torch.equal(got.isnan(), expected.isnan()) and got.isnan().sum() == 2
    assert torch.equal(got[~got.isnan()], expected[~expected.isnan()])
    assert torch.equal(got.view(torch.int16)[0, :2], expected.view(torch.int16)[0, :2])  # +0 stays +0


def test_scales_too_large_to_carry_the_256_take_the_exact_path():
    weight = torch.arange(126, dtype=torch.uint8).view(torch.float8_e4m3fn).view(1, 126).contiguous()
    scale = torch.tensor([[3e37]])
    assert fp8.block_scales(scale, 126)[1] is False
    assert torch.equal(fp8.dequantize(weight, scale), reference_dequant(weight, scale))


# ---------------------------------------------------------------- whole conversion


@pytest.mark.parametrize("split_scales", [False, True])
def test_conversion_writes_every_tensor_index_config_and_files(tmp_path, split_scales):
    src = make_fp8(tmp_path / "fp8", split_scales=split_scales)
    dst = tmp_path / "bf16"
    source = load_dir(src)
    src_index = json.loads((src / INDEX).read_text())["weight_map"]

    fp8.convert(src, dst, workers=2, log=lambda line: None)

    out = load_dir(dst)
    config = json.loads((src / "config.json").read_text())
    expected_names = set(hf_tensors(dims_from_config(config)))
    assert set(out) == expected_names == {n for n in source if not n.endswith("_scale_inv")}
    for name, tensor in out.items():
        if source[name].dtype == torch.float8_e4m3fn:
            assert tensor.dtype == torch.bfloat16, name
            assert torch.equal(tensor, reference_dequant(source[name], source[name + "_scale_inv"])), name
        else:  # copied unchanged, dtype kept (the router bias stays fp32)
            assert tensor.dtype == source[name].dtype and torch.equal(tensor, source[name]), name
    assert {t.dtype for n, t in out.items() if n.endswith("e_score_correction_bias")} == {torch.float32}

    index = json.loads((dst / INDEX).read_text())
    assert index["weight_map"] == {n: s for n, s in src_index.items() if not n.endswith("_scale_inv")}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    assert {p.name for p in dst.glob("*.safetensors")} == set(index["weight_map"].values())
    out_config = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in out_config
    assert out_config == {k: v for k, v in config.items() if k != "quantization_config"}
    for rel, text in OTHER_FILES.items():
        assert (dst / rel).read_text() == text
    manifest = json.loads((dst / MANIFEST).read_text())["files"]
    assert manifest == {rel: sha256(dst / rel) for rel in file_bytes(dst) if rel != MANIFEST}
    assert not list(dst.glob(".*.tmp"))


def test_split_scales_shard_holding_only_scales_has_no_output(tmp_path):
    src = make_fp8(tmp_path / "fp8", split_scales=True)
    scale_shard = json.loads((src / INDEX).read_text())["weight_map"]["model.layers.0.mlp.up_proj.weight_scale_inv"]

    fp8.convert(src, tmp_path / "bf16", log=lambda line: None)

    assert not (tmp_path / "bf16" / scale_shard).exists()


def test_streamed_shards_are_byte_identical_to_save_file(fp8_checkpoint, tmp_path):
    """The hand-written header and layout are safetensors' own: loaders see an ordinary file."""
    dst = tmp_path / "bf16"
    fp8.convert(fp8_checkpoint, dst, log=lambda line: None)

    for shard in sorted(dst.glob("*.safetensors")):
        again = tmp_path / "again.safetensors"
        save_file(load_file(shard), str(again), metadata={"format": "pt"})
        assert shard.read_bytes() == again.read_bytes(), shard.name


def test_cli_dry_run_checks_and_writes_nothing(fp8_checkpoint, tmp_path, capsys):
    dst = tmp_path / "bf16"

    assert main(["fp8-to-bf16", "--src", str(fp8_checkpoint), "--dst", str(dst), "--dry-run"]) == 0

    out = capsys.readouterr().out
    assert "3 shards" in out and "FP8 weights to dequantise" in out and "tokenizer.json" in out
    assert not dst.exists()


def test_cli_converts(fp8_checkpoint, tmp_path, capsys):
    dst = tmp_path / "bf16"
    assert main(["fp8-to-bf16", "--src", str(fp8_checkpoint), "--dst", str(dst), "--workers", "1"]) == 0
    assert "weights dequantised to bf16" in capsys.readouterr().out
    assert (dst / INDEX).is_file()


# ---------------------------------------------------------------- interrupted and resumed


class KillOnShard:
    """Stands in for convert_shard: counts calls; on the chosen one it copies the destination as a
    SIGKILL at that moment would leave it (no cleanup runs), then fails."""

    def __init__(self, fail_on: int | None = None, snapshot: Path | None = None):
        self.calls: list[str] = []
        self.fail_on, self.snapshot = fail_on, snapshot
        self.real = fp8.convert_shard

    def __call__(self, shard, dst, advance, cancel):
        self.calls.append(shard.name)
        if len(self.calls) == self.fail_on:
            shutil.copytree(dst, self.snapshot)
            (self.snapshot / f".{shard.name}.x1y2.tmp").write_bytes(b"half a shard")  # its temp file
            raise RuntimeError("killed")
        return self.real(shard, dst, advance, cancel)


def test_killed_midway_then_resumed_gives_byte_identical_files(fp8_checkpoint, tmp_path, monkeypatch):
    clean, failed, resumed = tmp_path / "clean", tmp_path / "failed", tmp_path / "resumed"
    fp8.convert(fp8_checkpoint, clean, log=lambda line: None)
    killer = KillOnShard(fail_on=2, snapshot=resumed)
    monkeypatch.setattr(fp8, "convert_shard", killer)

    with pytest.raises(RuntimeError, match="killed"):
        fp8.convert(fp8_checkpoint, failed, workers=1, log=lambda line: None)

    first = killer.calls[0]
    assert {p.name for p in failed.iterdir()} == {first, MANIFEST}  # an error cleans up: no temp, no index
    # a kill at the same moment: the first shard is already recorded, so it survives the kill
    assert json.loads((resumed / MANIFEST).read_text())["files"] == {first: sha256(resumed / first)}

    resumer = KillOnShard()
    monkeypatch.setattr(fp8, "convert_shard", resumer)
    fp8.convert(fp8_checkpoint, resumed, resume=True, workers=1, log=lambda line: None)

    assert first not in resumer.calls and len(resumer.calls) == 2
    assert file_bytes(resumed) == file_bytes(clean)


def test_resume_redoes_a_corrupted_finished_shard(fp8_checkpoint, tmp_path, monkeypatch):
    clean, dst = tmp_path / "clean", tmp_path / "bf16"
    fp8.convert(fp8_checkpoint, clean, log=lambda line: None)
    fp8.convert(fp8_checkpoint, dst, log=lambda line: None)
    victim = sorted(dst.glob("*.safetensors"))[1]
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    resumer = KillOnShard()
    monkeypatch.setattr(fp8, "convert_shard", resumer)

    fp8.convert(fp8_checkpoint, dst, resume=True, log=lambda line: None)

    assert resumer.calls == [victim.name]
    assert file_bytes(dst) == file_bytes(clean)


def test_resume_of_a_finished_run_converts_nothing(fp8_checkpoint, tmp_path, monkeypatch):
    dst = tmp_path / "bf16"
    fp8.convert(fp8_checkpoint, dst, log=lambda line: None)
    before = file_bytes(dst)
    resumer = KillOnShard()
    monkeypatch.setattr(fp8, "convert_shard", resumer)

    fp8.convert(fp8_checkpoint, dst, resume=True, log=lambda line: None)

    assert resumer.calls == [] and file_bytes(dst) == before


# ---------------------------------------------------------------- bad input


def rewrite_shard_of(src: Path, name: str, change) -> None:
    shard = json.loads((src / INDEX).read_text())["weight_map"][name]
    tensors = load_file(src / shard)
    change(tensors)
    save_file(tensors, str(src / shard), metadata={"format": "pt"})


def run_cli(src: Path, dst: Path, capsys, *extra: str) -> tuple[int, str]:
    code = main(["fp8-to-bf16", "--src", str(src), "--dst", str(dst), *extra])
    return code, capsys.readouterr().err


def test_missing_scale_is_named_and_nothing_is_written(fp8_checkpoint, tmp_path, capsys):
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    index = json.loads((fp8_checkpoint / INDEX).read_text())
    del index["weight_map"][name + "_scale_inv"]
    (fp8_checkpoint / INDEX).write_text(json.dumps(index))
    rewrite_shard_of(fp8_checkpoint, name, lambda t: t.pop(name + "_scale_inv"))

    code, err = run_cli(fp8_checkpoint, tmp_path / "bf16", capsys)

    assert code == 2
    assert f"FP8 weight '{name}'" in err and f"no '{name}_scale_inv'" in err and "re-download" in err
    assert not (tmp_path / "bf16").exists()


def test_scale_shape_mismatch_is_named_and_nothing_is_written(fp8_checkpoint, tmp_path, capsys):
    name = "model.layers.0.mlp.gate_proj.weight"  # [328, 200]: needs [3, 2]
    rewrite_shard_of(fp8_checkpoint, name, lambda t: t.update({name + "_scale_inv": torch.ones(2, 3)}))

    code, err = run_cli(fp8_checkpoint, tmp_path / "bf16", capsys)

    assert code == 2
    assert f"'{name}_scale_inv'" in err and "has shape [2, 3]" in err and "[328, 200] needs [3, 2]" in err
    assert not (tmp_path / "bf16").exists()


def test_non_empty_destination_needs_resume(fp8_checkpoint, tmp_path, capsys):
    dst = tmp_path / "bf16"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")

    code, err = run_cli(fp8_checkpoint, dst, capsys)

    assert code == 2
    assert f"{dst} is not empty" in err and "--resume" in err
    assert file_bytes(dst) == {"notes.txt": b"mine"}


def test_destination_inside_the_source_is_refused(fp8_checkpoint, capsys):
    code, err = run_cli(fp8_checkpoint, fp8_checkpoint / "bf16", capsys)
    assert code == 2 and "inside --src" in err
    assert not (fp8_checkpoint / "bf16").exists()


def test_a_truncated_shard_is_refused_before_any_work(fp8_checkpoint, tmp_path, capsys):
    shards = sorted(fp8_checkpoint.glob("*.safetensors"))
    data = shards[1].read_bytes()
    shards[1].write_bytes(data[:len(data) // 2])
    dst = tmp_path / "bf16"

    code, err = run_cli(fp8_checkpoint, dst, capsys)

    assert code == 2 and f"{shards[1]}: not a readable safetensors file" in err and "(truncated?)" in err
    assert not dst.exists() or file_bytes(dst) == {}, "the shard headers are checked before anything is written"


@pytest.mark.parametrize("workers", [1, 2])
def test_a_shard_truncated_during_the_run_fails_midway_leaving_only_recorded_shards(fp8_checkpoint, tmp_path, capsys,
                                                                                      monkeypatch, workers):
    shards = sorted(fp8_checkpoint.glob("*.safetensors"))
    data = shards[1].read_bytes()
    planned = fp8.plan

    def plan_then_truncate(src):  # the headers pass the plan's checks, then the file shrinks under the run
        todo = planned(src)
        shards[1].write_bytes(data[:len(data) // 2])
        return todo

    monkeypatch.setattr(fp8, "plan", plan_then_truncate)
    dst = tmp_path / "bf16"

    code, err = run_cli(fp8_checkpoint, dst, capsys, "--workers", str(workers))

    assert code == 2 and f"{shards[1]} is truncated" in err
    manifest = dst / MANIFEST
    recorded = json.loads(manifest.read_text())["files"] if manifest.exists() else {}
    if workers == 1:  # in order: the first finished and is kept, the third never started
        assert set(recorded) == {shards[0].name}
    assert shards[1].name not in recorded and INDEX not in recorded
    assert set(file_bytes(dst)) <= set(recorded) | {MANIFEST}  # no temp file, nothing unrecorded
    assert all(sha256(dst / rel) == digest for rel, digest in recorded.items())
