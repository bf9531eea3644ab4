"""Megatron-core 0.12.1 (our fork) on CPU over gloo, with Transformer Engine's names.

verl 0.4.0 builds DeepSeek-V3 from `get_gpt_decoder_block_spec(config, use_transformer_engine=True)`;
our fork's `get_gpt_decoder_block_spec_torch_native(config)` builds the same module tree from
torch-native modules. These tests check the guarded CPU changes one by one, the torch-native
modules against plain reference computations, and the whole model: TE's parameter names (through
verl's weight converter) and sharded keys (those tools/weights/dist.py writes), a strict bit-exact
load of the torch_dist checkpoint, and TP2 + sequence parallel + EP2 against TP1.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests import stack

stack.require("megatron.core")

from tests.gloo import run_processes, single_rank_model_parallel  # noqa: E402


def _init_gloo(rank: int, port: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


def _tiny_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=4,
        use_cpu_initialization=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        params_dtype=torch.float32,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


# --- guarded CPU changes ---------------------------------------------------------------------------


def test_rotary_embeddings_and_router_stay_on_the_host_without_cuda():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from megatron.core.transformer.moe.router import TopKRouter

    assert not torch.cuda.is_available()
    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)  # use_cpu_initialization=False
    emb = rope(12)
    assert emb.device.type == "cpu" and emb.shape == (12, 1, 1, 8)
    freqs = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    torch.testing.assert_close(emb[:, 0, 0, :4], torch.outer(torch.arange(12.0), freqs))
    yarn = YarnRotaryEmbedding(
        kv_channels=8, rotary_percent=1.0, scaling_factor=40.0, original_max_position_embeddings=64
    )
    y_emb, _ = yarn(12)
    assert y_emb.device.type == "cpu" and y_emb.shape == (12, 1, 1, 8)
    with single_rank_model_parallel():
        config = _tiny_config(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8)
        router = TopKRouter(config=config)
        x = torch.randn(5, 16)
        torch.testing.assert_close(router.gating(x), x @ router.weight.T)
        assert router.weight.device.type == "cpu"


def _moe_layer(overlap: bool):
    from megatron.core.models.gpt.torch_native_layer_specs import get_torch_native_mlp_module_spec
    from megatron.core.transformer.spec_utils import build_module

    config = _tiny_config(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
        moe_shared_expert_intermediate_size=8,
        moe_grouped_gemm=True,
        moe_token_dispatcher_type="alltoall",
        moe_shared_expert_overlap=overlap,
        moe_router_load_balancing_type="none",
    )
    return build_module(get_torch_native_mlp_module_spec(4, moe_grouped_gemm=True), config=config, layer_number=1)


def test_alltoall_dispatcher_and_shared_expert_overlap_run_without_cuda_streams():
    from megatron.core.transformer.moe.host_stream import HostStream

    with single_rank_model_parallel():
        torch.manual_seed(0)
        overlapped = _moe_layer(overlap=True)
        plain = _moe_layer(overlap=False)
        plain.load_state_dict(overlapped.state_dict())
        assert isinstance(overlapped.token_dispatcher.cuda_dtoh_stream, HostStream)
        assert isinstance(overlapped.shared_experts.stream, HostStream)
        x = torch.randn(6, 2, 16)
        outs = []
        for layer in (overlapped, plain):
            inp = x.clone().requires_grad_()
            out, _ = layer(inp)
            out.square().sum().backward()
            outs.append((out, inp.grad, {n: p.grad for n, p in layer.named_parameters()}))
        torch.testing.assert_close(outs[0][0], outs[1][0])
        torch.testing.assert_close(outs[0][1], outs[1][1])
        for name, grad in outs[0][2].items():
            torch.testing.assert_close(grad, outs[1][2][name], msg=name)


def _norm_sp_worker(rank, port, world, results):
    _init_gloo(rank, port, world)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_layernorm_grads
    from megatron.core.extensions.torch_norm_linear import TorchLayerNormColumnParallelLinear, TorchNorm
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    ps.initialize_model_parallel(tensor_model_parallel_size=world)
    config = _tiny_config(tensor_model_parallel_size=world, sequence_parallel=True)
    init = torch.nn.init.zeros_
    chunk = torch.nn.Module()
    chunk.norm = TorchNorm(config, 16, eps=1e-6)
    chunk.fc1 = TorchLayerNormColumnParallelLinear(
        16, 32, config=config, init_method=init, gather_output=False, bias=False, skip_bias_add=False, is_expert=False
    )
    chunk.fc2 = RowParallelLinear(
        32, 16, config=config, init_method=init, bias=False, input_is_parallel=True, skip_bias_add=False
    )
    chunk.ddp_config = DistributedDataParallelConfig()
    g = torch.Generator().manual_seed(0)
    full = {
        "norm": torch.rand(16, generator=g) + 0.5,
        "ln": torch.rand(16, generator=g) + 0.5,
        "fc1": torch.randn(32, 16, generator=g) / 4,
        "fc2": torch.randn(16, 32, generator=g) / 4,
    }
    x = torch.randn(8, 2, 16, generator=g)
    with torch.no_grad():
        chunk.norm.weight.copy_(full["norm"])
        chunk.fc1.layer_norm_weight.copy_(full["ln"])
        chunk.fc1.weight.copy_(full["fc1"].chunk(world)[rank])
        chunk.fc2.weight.copy_(full["fc2"].chunk(world, dim=1)[rank])
    y, _ = chunk.fc2(F.silu(chunk.fc1(chunk.norm(x.chunk(world)[rank]))[0]))
    y.square().sum().backward()  # the losses of all ranks add up to the full loss
    before = {"norm": chunk.norm.weight.grad.clone(), "ln": chunk.fc1.layer_norm_weight.grad.clone()}
    _allreduce_layernorm_grads([chunk], config)

    ref = {k: v.clone().requires_grad_() for k, v in full.items()}  # plain torch, whole sequence

    def rms(t, w):
        return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + 1e-6) * w

    h = F.silu(rms(rms(x, ref["norm"]), ref["ln"]) @ ref["fc1"].T)
    (h @ ref["fc2"].T).square().sum().backward()

    def err(got, want):  # relative to the largest reference entry
        return ((got - want).abs().max() / want.abs().max()).item()

    y_ref = (h @ ref["fc2"].T).chunk(world)[rank]
    results[rank] = {
        "marked": [getattr(p, "sequence_parallel", False) for p in (chunk.norm.weight, chunk.fc1.layer_norm_weight)],
        "y": err(y, y_ref),
        "before": max(err(before[k], ref[k].grad) for k in before),
        "norm": err(chunk.norm.weight.grad, ref["norm"].grad),
        "ln": err(chunk.fc1.layer_norm_weight.grad, ref["ln"].grad),
        "fc1": err(chunk.fc1.weight.grad, ref["fc1"].grad.chunk(world)[rank]),
        "fc2": err(chunk.fc2.weight.grad, ref["fc2"].grad.chunk(world, dim=1)[rank]),
    }
    torch.distributed.destroy_process_group()


def test_norms_with_sequence_parallel_are_marked_and_their_grads_all_reduced():
    # spawn: workers forked from a process that imported megatron.core hang in gloo's rendezvous
    results = run_processes(_norm_sp_worker, 2, 2, start_method="spawn")
    for rank, r in results.items():
        assert r["marked"] == [True, True], rank
        assert r["y"] < 1e-4, r
        # each rank only saw its half of the sequence: the local norm grads are partial ...
        assert r["before"] > 0.1, r
        # ... and Megatron's sequence-parallel all-reduce (finalize_model_grads) completes them
        assert max(r["norm"], r["ln"], r["fc1"], r["fc2"]) < 1e-4, r  # fp32 rounding


# --- torch-native modules against plain computations ---------------------------------------------


def _reference_attention(q, k, v, scale, causal=True):
    """q: [s, n, d], k: [s, n, d], v: [s, n, dv] -> [s, n * dv], written out by hand."""
    scores = torch.einsum("snd,tnd->nst", q, k) * scale
    if causal:
        s, t = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(s, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("nst,tnd->snd", scores.softmax(-1), v)
    return out.reshape(out.shape[0], -1)


def test_sdpa_attention_takes_mla_channels_and_packed_sequences():
    from megatron.core.extensions.torch_attention import TorchDotProductAttention
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    with single_rank_model_parallel():
        config = _tiny_config(hidden_size=32, num_attention_heads=4)
        scale = 0.3
        attn = TorchDotProductAttention(
            config, 1, AttnMaskType.causal, "self", softmax_scale=scale, k_channels=12, v_channels=8
        )  # MLA: value head != key head
        g = torch.Generator().manual_seed(0)
        # sbhd, batch 2: against the hand-written computation
        q, k = torch.randn(2, 7, 2, 4, 12, generator=g)
        v = torch.randn(7, 2, 4, 8, generator=g)
        out = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal)
        assert out.shape == (7, 2, 32)
        for b in range(2):
            torch.testing.assert_close(out[:, b], _reference_attention(q[:, b], k[:, b], v[:, b], scale))

        # thd: three sequences (lengths 5, 3, 4, padded to 6, 4, 4) packed as verl packs them
        lens, padded = [5, 3, 4], [6, 4, 4]
        t = sum(padded)
        q = torch.randn(t, 4, 12, generator=g, requires_grad=True)
        k = torch.randn(t, 4, 12, generator=g, requires_grad=True)
        v = torch.randn(t, 4, 8, generator=g, requires_grad=True)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        cu_pad = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_pad,
            cu_seqlens_kv_padded=cu_pad,
            max_seqlen_q=6,
            max_seqlen_kv=6,
        )
        packed = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
        assert packed.shape == (t, 32)
        four_d = attn(
            q.unsqueeze(1),
            k.unsqueeze(1),
            v.unsqueeze(1),
            None,
            attn_mask_type=AttnMaskType.causal,
            packed_seq_params=params,
        )
        torch.testing.assert_close(four_d, packed)
        alone = []
        for start, n, p in zip(cu_pad[:-1].tolist(), lens, padded, strict=True):
            s = slice(start, start + n)
            one = attn(
                q[s].unsqueeze(1), k[s].unsqueeze(1), v[s].unsqueeze(1), None, attn_mask_type=AttnMaskType.causal
            )[:, 0]
            torch.testing.assert_close(packed[s], one)  # same as the sequence run alone
            torch.testing.assert_close(one, _reference_attention(q[s], k[s], v[s], scale))
            assert torch.all(packed[start + n : start + p] == 0)  # padding attends to nothing
            alone.append(one)
        # gradients too: nothing leaks between sequences
        packed.square().sum().backward()
        grads = [x.grad.clone() for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        sum(o.square().sum() for o in alone).backward()
        for got, want in zip(grads, (q.grad, k.grad, v.grad), strict=True):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_grouped_linear_equals_a_per_expert_loop(kind):
    from megatron.core.extensions.torch_grouped_linear import (
        TorchColumnParallelGroupedLinear,
        TorchRowParallelGroupedLinear,
    )

    cls = TorchColumnParallelGroupedLinear if kind == "column" else TorchRowParallelGroupedLinear
    with single_rank_model_parallel():
        torch.manual_seed(0)
        config = _tiny_config()
        layer = cls(
            4, 6, 10, config=config, init_method=torch.nn.init.normal_, bias=False, skip_bias_add=True, is_expert=True
        )
        assert [n for n, _ in layer.named_parameters()] == [f"weight{i}" for i in range(4)]
        splits = [3, 0, 5, 2]  # an expert without tokens too
        x = torch.randn(sum(splits), 6, requires_grad=True)
        out, bias = layer(x, splits)
        assert bias is None and out.shape == (10, 10)
        weights = [getattr(layer, f"weight{i}").detach().clone().requires_grad_() for i in range(4)]
        xr = x.detach().clone().requires_grad_()
        rows, ref = 0, []
        for w, m in zip(weights, splits, strict=True):
            ref.append(xr[rows : rows + m] @ w.T)
            rows += m
        ref = torch.cat(ref)
        torch.testing.assert_close(out, ref)
        upstream = torch.randn_like(out)
        out.backward(upstream)
        ref.backward(upstream)
        torch.testing.assert_close(x.grad, xr.grad)
        for i, w in enumerate(weights):
            torch.testing.assert_close(getattr(layer, f"weight{i}").grad, w.grad)


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
    from verl.models.mcore.model_forward import gptmodel_forward
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
        logits = gptmodel_forward(
            model, input_ids, attention_mask, position_ids, sequence_parallel=config.sequence_parallel
        )
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
    tp1 = run_processes(_model_worker, 1, 1, 1, 1, str(hf), str(converted), str(ref), start_method="spawn")
    tp2 = run_processes(_model_worker, 2, 2, 2, 2, str(hf), str(converted), str(ref), start_method="spawn")
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
