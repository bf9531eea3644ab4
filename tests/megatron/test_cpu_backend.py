"""Megatron-core 0.12.3 (our fork) on CPU over gloo, with Transformer Engine's names: the whole model.

verl 0.4.0 builds DeepSeek-V3 from `get_gpt_decoder_block_spec(config, use_transformer_engine=True)`;
our fork's `get_gpt_decoder_block_spec_torch_native(config)` builds the same module tree from
torch-native modules. These integration tests build verl's model from it: TE's parameter names
(through verl's weight converter) and sharded keys (those tools/weights/dist.py writes), a strict
bit-exact load of the torch_dist checkpoint, and TP2 + sequence parallel + EP2 against TP1. The
unit tests of the fork's CPU changes and torch-native modules live in the fork's own
tests/unit_tests (run by `python -m tools.forks test megatron`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from tests import stack

stack.require("megatron.core")

from tests.gloo import run_processes  # noqa: E402


def _init_gloo(rank: int, port: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


# --- the whole model: verl's DeepSeek-V3 -----------------------------------------------------------


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    from tools.weights.tiny import make_tiny

    src = tmp_path_factory.mktemp("hf")
    make_tiny(src)  # recipes/deepseek_r1/model/tiny.yaml: 4 layers (1 dense), 8 experts, top-2
    return src


@pytest.fixture(scope="module")
def converted(hf, tmp_path_factory) -> Path:
    from tools.weights import dist

    dst = tmp_path_factory.mktemp("out") / "torch_dist"
    dist.hf_to_torch_dist(hf, dst, say=lambda *a: None)
    return dst


def build_model(hf_dir: Path, dtype: torch.dtype):
    """verl's DeepSeek-V3 GPTModel (verl's config converter) from the torch-native spec, with the
    config fields CPU needs (see the report)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.torch_native_layer_specs import get_gpt_decoder_block_spec_torch_native
    from transformers import AutoConfig
    from verl.models.mcore.config_converter import hf_to_mcore_config_dpskv3

    hf_config = AutoConfig.from_pretrained(hf_dir)
    config = hf_to_mcore_config_dpskv3(
        hf_config,
        dtype,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        moe_router_load_balancing_type="none",
    )  # what verl's freeze_moe_router default sets
    spec = get_gpt_decoder_block_spec_torch_native(config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )
    return model, hf_config


COLUMN = (
    "linear_q_down_proj.weight",
    "linear_q_up_proj.weight",
    "linear_kv_down_proj.weight",
    "linear_kv_up_proj.weight",
    "output_layer.weight",
    "word_embeddings.weight",
)
ROW = ("linear_proj.weight", "mlp.linear_fc2.weight", "shared_experts.linear_fc2.weight")
GATED = ("mlp.linear_fc1.weight", "shared_experts.linear_fc1.weight")


def global_name(name: str, ep_rank: int, per_rank: int) -> str:
    """Local expert weight{i} -> weight{global id} (as verl's per_tensor_generator renames them)."""
    if ".mlp.experts.linear_fc" in name:
        stem, local = name.rsplit("weight", 1)
        return f"{stem}weight{ep_rank * per_rank + int(local)}"
    return name


def local_shard(name: str, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """This rank's part of a whole tensor named as in the TE model (expert weights whole: ETP 1)."""
    if ".mlp.experts." in name:
        return full
    if name.endswith(GATED):  # gate and up halves are split separately
        return torch.cat([half.chunk(tp)[tp_rank] for half in full.chunk(2)])
    if name.endswith(COLUMN):
        return full.chunk(tp)[tp_rank]
    if name.endswith(ROW):
        return full.chunk(tp, dim=1)[tp_rank]
    return full


def _sharded_keys(sharded_sd) -> set[str]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {v.unique_key if isinstance(v, ShardedObject) else v.key for v in sharded_sd.values()}


def _model_worker(rank, port, world, tp, ep, hf_dir, ckpt, ref_file, results):
    _init_gloo(rank, port, world)
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_layernorm_grads
    from verl.models.mcore.registry import get_mcore_forward_fn
    from verl.models.mcore.weight_converter import McoreToHFWeightConverterDpskv3

    from tools.weights.io import ShardedReader

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1
    )
    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    out = {}
    hf = ShardedReader(Path(hf_dir))
    for dtype in (torch.bfloat16, torch.float32):
        model, hf_config = build_model(Path(hf_dir), dtype)
        config = model.config
        assert config.sequence_parallel == (tp > 1)  # verl's converter turns it on with TP
        per_rank = config.num_moe_experts // ep
        sharded = model.sharded_state_dict()
        state, missing, unexpected = dist_checkpointing.load(sharded, ckpt, strict=StrictHandling.RETURN_ALL)
        model.load_state_dict(state, strict=True)
        named = dict(model.named_parameters())
        named.update({n: b for n, b in model.named_buffers() if n.endswith("expert_bias")})
        converter = McoreToHFWeightConverterDpskv3(hf_config, config)
        if dtype is torch.bfloat16:
            out["names"] = list(named)
            out["keys"] = sorted(_sharded_keys(sharded))
            out["unexpected"], out["missing"] = sorted(unexpected), sorted(missing)
            bad, converted_names = [], []
            for name, tensor in named.items():
                gname = global_name(name, ep_rank, per_rank)
                halves = list(tensor.chunk(2)) if gname.endswith(GATED) or ".experts.linear_fc1." in gname else [tensor]
                hf_names, _ = converter.convert_param(gname, halves)
                converted_names += hf_names
                full = torch.cat([hf.get(n) for n in hf_names])
                want = local_shard(gname, full, tp, tp_rank)
                if want.shape != tensor.shape or not torch.equal(want, tensor.detach()):
                    bad.append(name)
            out["bad"], out["hf_names"] = bad, converted_names
            continue

        # fp32: the same weights (the checkpoint is bf16); loss and gradients on packed sequences.
        # sequence parallelism forks Megatron's model-parallel RNG around the embedding's dropout: host states on CPU
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        g = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, hf_config.vocab_size, (3, 10), generator=g)
        attention_mask = torch.zeros(3, 10, dtype=torch.bool)
        for b, n in enumerate((10, 7, 4)):
            attention_mask[b, :n] = True
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        labels = torch.roll(input_ids, -1, dims=1)
        # the Megatron actor's packed forward (v0.6.1 picks it per architecture and pads for sequence parallelism
        # from Megatron's TP size itself; gptmodel_forward(sequence_parallel=...) before)
        forward = get_mcore_forward_fn(hf_config)
        logits = forward(model, input_ids, attention_mask, position_ids, multi_modal_inputs={})
        token_loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float().contiguous(), labels)
        loss = (token_loss * attention_mask).sum() / attention_mask.sum()
        loss.backward()
        model.ddp_config = DistributedDataParallelConfig()
        _allreduce_layernorm_grads([model], config)
        grads = {global_name(n, ep_rank, per_rank): p.grad for n, p in model.named_parameters() if p.grad is not None}
        out["loss"] = loss.item()
        out["no_grad"] = sorted(n for n, p in model.named_parameters() if p.requires_grad and p.grad is None)
        if world == 1:
            torch.save({k: v.clone() for k, v in grads.items()}, ref_file)
        else:
            ref = torch.load(ref_file)
            out["grad_err"] = {}
            for name, grad in grads.items():
                want = local_shard(name, ref[name], tp, tp_rank)
                scale = want.abs().max().item() or 1.0
                out["grad_err"][name] = (grad - want).abs().max().item() / scale
            out["grad_names"] = sorted(grads)
    results[rank] = out
    torch.distributed.destroy_process_group()


def _te_keys(hf_dir: Path) -> set[str]:
    """The sharded keys of verl's TE model, as tools/weights/dist.py writes them."""
    from tools.weights import dist

    dims = dist.dims_from_config(dist.load_config(hf_dir), "config.json")
    return {t.key for t in dist.plan(dims, dist.hf_shapes(dims))} | set(dist.extra_state_keys(dims))


@pytest.fixture(scope="module")
def runs(hf, converted, tmp_path_factory):
    stack.require("verl.models.mcore.config_converter")
    ref = tmp_path_factory.mktemp("ref") / "tp1-grads.pt"
    # spawn: forking after DCP's writer threads ran in this process can hang
    tp1 = run_processes(_model_worker, 1, 1, 1, 1, str(hf), str(converted), str(ref))
    tp2 = run_processes(_model_worker, 2, 2, 2, 2, str(hf), str(converted), str(ref))
    return tp1, tp2


def test_parameter_names_and_sharded_keys_are_te_s(hf, runs):
    tp1, tp2 = runs
    names = tp1[0]["names"]
    # TE's names, as verl's converter and the checkpoint writer know them
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight" in names
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight7" in names
    assert "decoder.layers.1.mlp.router.expert_bias" in names
    assert not [n for n in names if "layernorm." in n and ("q_layernorm" in n or "kv_layernorm" in n)]
    hf_names = set(tp1[0]["hf_names"])
    from tools.weights.io import ShardedReader

    assert hf_names == set(ShardedReader(hf).weight_map)  # every HF tensor, each exactly once
    assert len(tp1[0]["hf_names"]) == len(hf_names)
    te = _te_keys(hf)
    assert set(tp1[0]["keys"]) == te
    assert set(tp2[0]["keys"]) | set(tp2[1]["keys"]) == te  # experts split over EP ranks
    assert tp2[0]["names"] == tp2[1]["names"]
    assert len([n for n in tp2[0]["names"] if ".experts.linear_fc1.weight" in n]) == 3 * 4


def test_torch_dist_checkpoint_loads_strictly_and_bit_exact(runs):
    for results in runs:
        for rank, r in results.items():
            assert r["unexpected"] == [], f"rank {rank}: the model asks for keys the checkpoint lacks"
            assert r["missing"] == [], f"rank {rank}: checkpoint keys the model does not ask for"
            assert r["bad"] == [], (rank, r["bad"])


def test_tp2_sequence_parallel_ep2_matches_tp1(runs):
    tp1, tp2 = runs
    assert tp1[0]["no_grad"] == [] and all(r["no_grad"] == [] for r in tp2.values())
    for rank, r in tp2.items():
        assert math.isclose(r["loss"], tp1[0]["loss"], rel_tol=1e-5), (r["loss"], tp1[0]["loss"])
        worst = sorted(r["grad_err"].items(), key=lambda kv: -kv[1])[:5]
        assert worst[0][1] < 1e-4, (rank, worst)
        # the norms' gradients are checked too (sequence-parallel all-reduce)
        assert any("layer_norm_weight" in n for n in r["grad_names"])
        assert any("input_layernorm" in n for n in r["grad_names"])
