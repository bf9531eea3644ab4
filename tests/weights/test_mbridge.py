"""mbridge (verl's `use_mbridge=True`) against hf-to-mcore: the same weights in the same model, bit for bit.

verl 0.6.1 with actor_rollout_ref.actor.megatron.use_mbridge=True builds the actor from mbridge's
DeepSeek-V3 bridge and reads the HF safetensors straight into it (megatron_workers.py:
`AutoBridge.from_config`, `set_extra_args`, `make_megatron_module(bridge=...)`, `bridge.load_weights`);
with use_dist_checkpointing=True it reads our converter's torch_dist output instead
(`load_mcore_dist_weights`). Both are run here, as verl runs them, into two copies of the model mbridge
builds, at TP2 x PP2 x EP2 on 4 gloo ranks, and every parameter and the routers' expert_bias buffers
are compared.

mbridge 0.15.1 is written for CUDA with Transformer Engine; on CPU three things stand in, none of them
in the weight mapping (mbridge's names, TP/EP splits and gate/up merge run as shipped):
- TE itself: `import mbridge` imports its Gemma3 and InternVL3 bridges, which import
  megatron.core.extensions.transformer_engine (and so transformer_engine) at module level, and every
  bridge builds `get_gpt_decoder_block_spec(config, use_transformer_engine=True)`. Our Megatron fork's
  torch-native modules, made to keep TE's parameter names and sharded keys (the table in
  megatron/core/models/gpt/torch_native_layer_specs.py), stand in under TE's names, as MindSpeed's own
  (features_manager/megatron_basic/transformer_engine_basic.py) do on Ascend.
- mbridge's get_model moves the model with `.cuda(torch.cuda.current_device())`: a no-op here.
- mbridge's DeepSeek-V3 reader opens the safetensors with device="cuda": opened on the CPU here.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

import pytest
import torch

from tests import stack
from tests.gloo import drop_leftover_groups, run_processes
from tests.weights.test_dist import TINY, quiet
from tools.weights import dist
from tools.weights.tiny import make_tiny

# 4 layers (1 dense, then 3 MoE) so that 2 pipeline stages get 2 layers each; 4 experts, 2 per EP rank.
LAYERS = {**TINY, "num_hidden_layers": 4}
TE = "megatron.core.extensions.transformer_engine"


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("hf")
    make_tiny(src, overrides=LAYERS, shards=3)
    return src


@pytest.fixture(scope="module")
def converted(hf, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("out") / "torch_dist"
    dist.hf_to_torch_dist(hf, dst, **quiet)
    return dst


def install_cpu_stand_ins() -> None:
    """The stand-ins of the module docstring, in this (spawned) process, before Megatron's specs import."""
    if "megatron.core.models.gpt.gpt_layer_specs" in sys.modules:
        raise RuntimeError("Megatron's layer specs were imported before the TE stand-in: they saw no TE")
    import types

    from megatron.core.extensions.torch_attention import TorchDotProductAttention
    from megatron.core.extensions.torch_grouped_linear import (
        TorchColumnParallelGroupedLinear,
        TorchRowParallelGroupedLinear,
    )
    from megatron.core.extensions.torch_norm_linear import TorchLayerNormColumnParallelLinear, TorchNorm
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    te = types.ModuleType(TE, "torch-native stand-ins under Transformer Engine's names (tests/weights/test_mbridge.py)")
    te.__dict__.update(
        TENorm=TorchNorm, TELayerNormColumnParallelLinear=TorchLayerNormColumnParallelLinear,
        TEColumnParallelLinear=ColumnParallelLinear, TERowParallelLinear=RowParallelLinear,
        TEDotProductAttention=TorchDotProductAttention,
        TEColumnParallelGroupedLinear=TorchColumnParallelGroupedLinear,
        TERowParallelGroupedLinear=TorchRowParallelGroupedLinear)
    sys.modules[TE] = te
    torch.cuda.current_device = lambda: "cpu"  # mbridge's get_model; Megatron's rotary embedding
    torch.nn.Module.cuda = lambda self, device=None: self  # mbridge's get_model: model.cuda(current_device)

    import mbridge.models.ext.deepseek_v3.dequant_fp8_safetensor_io as reader
    from safetensors import safe_open

    reader.safe_open = lambda path, framework, device: safe_open(path, framework=framework, device="cpu")


def build(bridge, hf_config):
    """The actor's model as verl builds it with a bridge (megatron_workers.py, the reference's wrap_config)."""
    from verl.utils.megatron_utils import McoreModuleWrapperConfig, make_megatron_module

    wrap = McoreModuleWrapperConfig(is_value_model=False, share_embeddings_and_output_weights=False,
                                    wrap_with_ddp=False, use_distributed_optimizer=True)
    models = make_megatron_module(wrap_config=wrap, tf_config=bridge.config, hf_config=hf_config, bridge=bridge)
    for tensor in tensors(models).values():  # whatever no loader writes stays NaN and shows up below
        tensor.fill_(float("nan"))
    return models


def tensors(models) -> dict[str, torch.Tensor]:
    """Parameters and buffers by name (state_dict: expert_bias is a buffer), no TE _extra_state objects."""
    from verl.utils.megatron_utils import unwrap_model

    out = {}
    for chunk in models:
        for name, value in unwrap_model(chunk).state_dict(keep_vars=True).items():
            if "_extra_state" not in name:
                out[name] = value.data
    return out


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    differ = [n for n in a.keys() & b.keys()
              if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape or not torch.equal(a[n], b[n])]
    return {"only_bridge": sorted(a.keys() - b.keys()), "only_ckpt": sorted(b.keys() - a.keys()),
            "differ": sorted(differ),
            "unloaded_bridge": sorted(n for n, t in a.items() if t.is_floating_point() and t.isnan().any()),
            "unloaded_ckpt": sorted(n for n, t in b.items() if t.is_floating_point() and t.isnan().any())}


def _worker(rank, port, world, tp, pp, ep, hf_dir, ckpt, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    install_cpu_stand_ins()
    from megatron.core import parallel_state as ps
    from transformers import AutoConfig
    from verl.models.mcore.config_converter import mapping_string_to_attn_backend
    from verl.models.mcore.cpu import CPU_TRANSFORMER_CONFIG
    from verl.models.mcore.mbridge import AutoBridge
    from verl.utils.megatron_utils import unwrap_model
    from verl.utils.model import load_mcore_dist_weights

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    # megatron_workers._init_hf_config_and_tf_config with use_mbridge=True; the CPU switches come in as the
    # recipe's override_transformer_config would bring them
    hf_config = AutoConfig.from_pretrained(hf_dir)
    bridge = AutoBridge.from_config(hf_config, dtype=torch.bfloat16)
    bridge.set_extra_args(**mapping_string_to_attn_backend(dict(CPU_TRANSFORMER_CONFIG)))

    via_bridge = build(bridge, hf_config)
    bridge.load_weights(via_bridge, hf_dir)  # use_mbridge=True, use_dist_checkpointing=False
    via_ckpt = build(bridge, hf_config)
    load_mcore_dist_weights(via_ckpt, ckpt, is_value_model=False)  # use_dist_checkpointing=True

    a, b = tensors(via_bridge), tensors(via_ckpt)
    out = compare(a, b)
    out["params"] = sorted(n for chunk in via_bridge for n, _ in unwrap_model(chunk).named_parameters())
    out["names"] = sorted(a)
    # The negative control: one expert's gate and up halves swapped in the checkpoint's copy, a layout slip
    # a converter could make; the comparison must name it and nothing else.
    broken = "decoder.layers.1.mlp.experts.linear_fc1.weight0"
    gate, up = b[broken].clone().chunk(2)
    b[broken].copy_(torch.cat([up, gate]))
    out["broken"] = compare(a, b)["differ"]
    out["stage"] = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                    ps.get_expert_model_parallel_rank())
    results[rank] = out
    ps.destroy_model_parallel()
    drop_leftover_groups(ps)
    torch.distributed.destroy_process_group()


def test_mbridge_loads_the_weights_our_converter_writes_tp2_pp2_ep2(hf, converted):
    try:  # not an import: without the stand-ins `import mbridge` needs Transformer Engine (module docstring)
        importlib.metadata.version("mbridge")
    except importlib.metadata.PackageNotFoundError:
        stack.missing("mbridge is not installed")
    stack.require("verl.models.mcore.cpu")  # our verl series: the CPU TransformerConfig switches
    stack.require("megatron.core.models.gpt.torch_native_layer_specs")  # our Megatron series: the stand-ins
    # spawn: forking after DCP's writer threads ran in this process can hang
    results = run_processes(_worker, 4, 4, 2, 2, 2, str(hf), str(converted))
    # (pp, tp, ep) of the 4 ranks: with DP 1, a stage's 2 TP ranks are also its 2 EP ranks
    assert sorted(r["stage"] for r in results.values()) == [(pp, tp, tp) for pp in (0, 1) for tp in (0, 1)]
    for rank, r in sorted(results.items()):
        assert r["only_bridge"] == [] and r["only_ckpt"] == [], (rank, r["only_bridge"], r["only_ckpt"])
        assert r["unloaded_bridge"] == [], (rank, "mbridge left these unwritten", r["unloaded_bridge"])
        assert r["unloaded_ckpt"] == [], (rank, "the torch_dist load left these unwritten", r["unloaded_ckpt"])
        assert r["differ"] == [], (rank, "mbridge and hf-to-mcore disagree", r["differ"])
        assert r["broken"] == ["decoder.layers.1.mlp.experts.linear_fc1.weight0"], (rank, r["broken"])
        assert set(r["params"]) <= set(r["names"])
        buffers = set(r["names"]) - set(r["params"])
        assert buffers == {n for n in r["names"] if n.endswith("mlp.router.expert_bias")} and buffers, buffers
        print(f"rank {rank} (pp, tp, ep) {r['stage']}: {len(r['names'])} tensors equal"
              f" ({len(r['params'])} parameters, {len(buffers)} expert_bias buffers)")
    # docs/weights-and-data.md quotes these counts
    assert sum(len(r["names"]) for r in results.values()) == 130
    assert sum(len(r["params"]) for r in results.values()) == 124
    first, last = results[0]["names"], [r for r in results.values() if r["stage"][0] == 1][0]["names"]
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" in last
    # every stage holds 2 layers; the first stage's second and the last stage's both are MoE layers
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in first  # the dense layer, TE's fused norm
    assert "decoder.layers.1.mlp.experts.linear_fc2.weight1" in first  # 2 of the 4 experts per EP rank
    assert "decoder.layers.1.mlp.experts.linear_fc2.weight2" not in first
