"""hf-to-mcore --format torch_dist: loaded by Megatron-core's own DeepSeek-V3 GPT model on CPU.

The model is built the way verl 0.4.0 builds it (`hf_to_mcore_config_dpskv3`, GPTModel, the decoder
block spec), with what a CPU needs: Megatron's local layer spec instead of Transformer Engine's, and
the local norms mapped to the names TE fuses them under (Megatron's own `sharded_state_dict_keys_map`
mechanism), so the keys it asks for are those of verl's TE model. Attention kernels and the token
dispatcher hold no weights and are swapped for CPU-capable ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests import stack
from tests.gloo import run_processes
from tools.weights import dist
from tools.weights.io import CheckpointError, ShardedReader
from tools.weights.tiny import make_tiny

# 3 layers (1 dense), 4 experts in 2 groups, 1 shared expert; small odd sizes.
TINY = {"num_hidden_layers": 3, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1}
quiet = {"say": lambda *a: None}


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("hf")
    make_tiny(src, overrides=TINY, shards=3)
    return src


@pytest.fixture(scope="module")
def converted(hf, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("out") / "torch_dist"
    dist.hf_to_torch_dist(hf, dst, chunk_bytes=2048, **quiet)  # several row blocks per big tensor
    return dst


def test_same_input_gives_the_same_bytes_and_verify_passes(hf, converted, tmp_path):
    again = tmp_path / "again"
    dist.hf_to_torch_dist(hf, again, chunk_bytes=2048, **quiet)
    files = sorted(p.name for p in converted.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    assert {".metadata", "common.pt", "metadata.json", "manifest.json", "__0_0.distcp"} <= set(files)
    for name in files:
        assert (converted / name).read_bytes() == (again / name).read_bytes(), name
    assert dist.verify_torch_dist(hf, converted, **quiet) == []
    one_writer = tmp_path / "one-writer"
    dist.hf_to_torch_dist(hf, one_writer, jobs=1, **quiet)
    assert [p.name for p in one_writer.glob("*.distcp")] == ["__0_0.distcp"]
    assert dist.verify_torch_dist(hf, one_writer, **quiet) == []
    assert not converted.with_name(converted.name + ".partial").exists()


def test_verify_names_the_tensor_that_differs(hf, converted, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    changed = tmp_path / "changed"
    shutil.copytree(hf, changed)
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    shard = changed / ShardedReader(changed).shard_of(name)
    tensors = load_file(shard)
    tensors[name][3, 5] += 1
    save_file(tensors, shard, metadata={"format": "pt"})
    problems = dist.verify_torch_dist(changed, converted, **quiet)
    assert problems and all(f"differs from {name} rows" in p for p in problems), problems
    assert all(p.startswith("decoder.layers.1.mlp.experts.experts.linear_fc1.weight at [2, ") for p in problems)


def test_refuses_a_non_empty_destination_and_resume_checks_the_manifest(hf, converted, tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(CheckpointError, match="not empty"):
        dist.hf_to_torch_dist(hf, busy, **quiet)
    with pytest.raises(CheckpointError, match="other than a finished conversion"):
        dist.hf_to_torch_dist(hf, busy, resume=True, **quiet)
    said = []
    dist.hf_to_torch_dist(hf, converted, resume=True, chunk_bytes=2048, say=said.append)
    assert "nothing to do" in said[-1]


def test_fp8_source_is_refused_with_the_fix(tmp_path):
    make_tiny(tmp_path / "fp8", fp8=True, overrides=TINY)
    with pytest.raises(CheckpointError, match="fp8-to-bf16"):
        dist.hf_to_torch_dist(tmp_path / "fp8", tmp_path / "out", **quiet)
    assert not (tmp_path / "out").exists()


def test_cli_converts_verifies_and_refuses_layout_flags(hf, tmp_path, capsys):
    from tools.weights.cli import main

    dst = tmp_path / "cli"
    assert main(["hf-to-mcore", "--src", str(hf), "--dst", str(dst), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "decoder.layers.2.mlp.experts.experts.linear_fc1.weight: [4, " in out and not dst.exists()
    assert main(["hf-to-mcore", "--src", str(hf), "--dst", str(dst), "--tp", "2"]) == 2
    assert "--tp applies to --format legacy" in capsys.readouterr().err and not dst.exists()
    assert main(["hf-to-mcore", "--src", str(hf), "--dst", str(dst), "--jobs", "1"]) == 0
    assert main(["verify", "--src", str(hf), "--converted", str(dst), "--sample", "5"]) == 0
    assert "5 tensors checked, 0 mismatches" in capsys.readouterr().out
    assert main(["mcore-to-hf", "--src", str(dst), "--config", str(hf), "--dst", str(tmp_path / "back")]) == 2
    assert "reads --format legacy output" in capsys.readouterr().err


# --- loading into Megatron-core's model -------------------------------------------------------------

def build_model(hf_dir: Path):
    """verl's DeepSeek-V3 GPTModel (config from verl's converter) on CPU; see the module docstring."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from transformers import AutoConfig
    from verl.models.mcore.config_converter import hf_to_mcore_config_dpskv3

    hf_config = AutoConfig.from_pretrained(hf_dir)
    config = hf_to_mcore_config_dpskv3(
        hf_config, torch.bfloat16, persist_layer_norm=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, attention_backend=AttnBackend.local,
        moe_shared_expert_overlap=False, moe_token_dispatcher_type="allgather", variable_seq_lengths=False,
        moe_grouped_gemm=False)
    config.use_cpu_initialization, config.perform_initialization = True, False
    # TP with EP requires sequence parallelism, which torch's norms refuse; it changes no weight.
    config.sequence_parallel = False
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    for layer in spec.layer_specs:
        sub = layer.submodules
        sub.self_attention.submodules.core_attention = IdentityOp  # Megatron's local MLA attention needs TE
        sub.sharded_state_dict_keys_map = {
            "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
            "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
        }
        if sub.mlp.module is MLP:  # dense MLP: TE fuses its norm into linear_fc1
            sub.sharded_state_dict_keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=hf_config.vocab_size,
                    max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def expected_parameters(hf_dir: Path, tp: int, tp_rank: int, ep: int, ep_rank: int, n_layers: int, experts: int):
    """What each local parameter must hold, written from verl's own HF->mcore mapping
    (scripts/converter_hf_to_mcore.py), split the way Megatron's parallel layers split them."""
    hf = ShardedReader(hf_dir)

    def cols(t, parts):  # ColumnParallel: split dim 0 (fc1 splits gate and up separately)
        return t.chunk(parts)[tp_rank]

    def rows(t, parts):  # RowParallel: split dim 1
        return t.chunk(parts, dim=1)[tp_rank]

    def gated(prefix):
        return torch.cat([cols(hf.get(f"{prefix}.gate_proj.weight"), tp), cols(hf.get(f"{prefix}.up_proj.weight"), tp)])

    out = {"embedding.word_embeddings.weight": hf.get("model.embed_tokens.weight").chunk(tp)[tp_rank],
           "decoder.final_layernorm.weight": hf.get("model.norm.weight"),
           "output_layer.weight": cols(hf.get("lm_head.weight"), tp)}
    per_rank = experts // ep
    for i in range(n_layers):
        h, m = f"model.layers.{i}", f"decoder.layers.{i}"
        a = f"{h}.self_attn"
        out.update({
            f"{m}.input_layernorm.weight": hf.get(f"{h}.input_layernorm.weight"),
            # Megatron 0.12.3 builds the MLA down projections as column-parallel too.
            f"{m}.self_attention.linear_q_down_proj.weight": cols(hf.get(f"{a}.q_a_proj.weight"), tp),
            f"{m}.self_attention.linear_q_up_proj.weight": cols(hf.get(f"{a}.q_b_proj.weight"), tp),
            f"{m}.self_attention.q_layernorm.weight": hf.get(f"{a}.q_a_layernorm.weight"),
            f"{m}.self_attention.linear_kv_down_proj.weight": cols(hf.get(f"{a}.kv_a_proj_with_mqa.weight"), tp),
            f"{m}.self_attention.linear_kv_up_proj.weight": cols(hf.get(f"{a}.kv_b_proj.weight"), tp),
            f"{m}.self_attention.kv_layernorm.weight": hf.get(f"{a}.kv_a_layernorm.weight"),
            f"{m}.self_attention.linear_proj.weight": rows(hf.get(f"{a}.o_proj.weight"), tp),
            f"{m}.pre_mlp_layernorm.weight": hf.get(f"{h}.post_attention_layernorm.weight"),
        })
        if f"{h}.mlp.gate.weight" not in hf.weight_map:
            out[f"{m}.mlp.linear_fc1.weight"] = gated(f"{h}.mlp")
            out[f"{m}.mlp.linear_fc2.weight"] = rows(hf.get(f"{h}.mlp.down_proj.weight"), tp)
            continue
        out[f"{m}.mlp.router.weight"] = hf.get(f"{h}.mlp.gate.weight")
        out[f"{m}.mlp.router.expert_bias"] = hf.get(f"{h}.mlp.gate.e_score_correction_bias")
        out[f"{m}.mlp.shared_experts.linear_fc1.weight"] = gated(f"{h}.mlp.shared_experts")
        out[f"{m}.mlp.shared_experts.linear_fc2.weight"] = rows(hf.get(f"{h}.mlp.shared_experts.down_proj.weight"), tp)
        for local in range(per_rank):  # expert tensor parallel size 1: whole experts per EP rank
            e = ep_rank * per_rank + local
            x = f"{m}.mlp.experts.local_experts.{local}"
            out[f"{x}.linear_fc1.weight"] = torch.cat([hf.get(f"{h}.mlp.experts.{e}.gate_proj.weight"),
                                                       hf.get(f"{h}.mlp.experts.{e}.up_proj.weight")])
            out[f"{x}.linear_fc2.weight"] = hf.get(f"{h}.mlp.experts.{e}.down_proj.weight")
    return out


def _load_worker(rank, port, world, tp, ep, hf_dir, ckpt, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    # Megatron's rotary embedding asks torch.cuda for a device even for CPU models (core 0.12.3).
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.validation import StrictHandling

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=1)
    model = build_model(Path(hf_dir))
    # RAISE_UNEXPECTED: every key the model asks for must be in the checkpoint.
    state, missing, unexpected = dist_checkpointing.load(model.sharded_state_dict(), ckpt,
                                                         strict=StrictHandling.RETURN_ALL)
    model.load_state_dict(state, strict=False)
    want = expected_parameters(Path(hf_dir), tp, ps.get_tensor_model_parallel_rank(), ep,
                               ps.get_expert_model_parallel_rank(), model.config.num_layers,
                               model.config.num_moe_experts)
    got = dict(model.named_parameters())
    got.update({n: b for n, b in model.named_buffers() if n.endswith("expert_bias")})
    bad = [n for n, t in want.items() if n not in got or got[n].shape != t.shape
           or not torch.equal(got[n].to(t.dtype), t)]
    untested = sorted(set(dict(model.named_parameters())) - set(want))
    results[rank] = {"unexpected": sorted(unexpected), "missing": sorted(missing), "bad": bad,
                     "untested": untested, "checked": len(want)}
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("tp,ep,world", [(1, 1, 1), (2, 2, 2)], ids=["tp1-ep1", "tp2-ep2"])
def test_megatron_core_model_loads_it_bit_exact(hf, converted, tp, ep, world):
    stack.require("megatron.core")
    stack.require("verl.models.mcore.config_converter")
    # spawn: forking after DCP's writer threads ran in this process can hang
    results = run_processes(_load_worker, world, world, tp, ep, str(hf), str(converted))
    for rank, r in results.items():
        assert r["unexpected"] == [], f"rank {rank}: model asks for keys the checkpoint lacks"
        assert r["bad"] == [] and r["untested"] == [] and r["checked"] > 20, (rank, r)
        # The only extra keys are the `_extra_state` objects of TE's attention, which this model lacks.
        assert all(k.endswith("core_attention._extra_state") or "core_attention._extra_state/" in k
                   for k in r["missing"]), r["missing"]


def test_jobs_change_the_speed_not_the_bytes(hf, tmp_path):
    """Several files (a small file_bytes) so that two writers really share them out."""
    outs = {}
    for jobs in (1, 2):
        outs[jobs] = tmp_path / f"jobs{jobs}"
        dist.hf_to_torch_dist(hf, outs[jobs], jobs=jobs, chunk_bytes=2048, file_bytes=1 << 16, **quiet)
    files = sorted(p.name for p in outs[1].iterdir())
    assert len([n for n in files if n.endswith(".distcp")]) >= 3
    assert files == sorted(p.name for p in outs[2].iterdir())
    for name in files:
        assert (outs[1] / name).read_bytes() == (outs[2] / name).read_bytes(), name
    assert dist.verify_torch_dist(hf, outs[2], **quiet) == []


def test_cli_refuses_a_non_positive_jobs(hf, tmp_path, capsys):
    from tools.weights.cli import main

    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as exit_info:
            main(["hf-to-mcore", "--src", str(hf), "--dst", str(tmp_path / "x"), "--jobs", bad])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"argument --jobs: '{bad}' is not a positive number of writers; give N >= 1" in err, err
    assert not (tmp_path / "x").exists()
