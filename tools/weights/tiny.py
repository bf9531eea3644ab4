"""`make-tiny`: a small random DeepSeek-V3-architecture HF checkpoint (bf16, or FP8 with scales).

Real key names and layouts (MLA attention, dense first layers, routed + shared experts, router
bias), small and deliberately odd sizes (not multiples of 128, so FP8 edge blocks are exercised).
Tests, benchmarks and the CPU smoke profile build their models with it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tools.model.dims import dims_from_config
from tools.weights.hf import FP8_BLOCK, hf_tensors
from tools.weights.io import INDEX, atomic_write
from tools.weights.tokenizer import write_tokenizer

FP8_MAX = 448.0  # largest finite float8_e4m3fn

# DeepSeek-V3's config.json fields with small values; the rest as in the real model.
TINY_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 320,
    "hidden_size": 200,
    "intermediate_size": 328,
    "moe_intermediate_size": 72,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 4,  # = 2 x topk_group, as DeepSeek-V3 (8, 4): see check_group_topk in our verl series
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 96,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 8,
    "v_head_dim": 24,
    "moe_layer_freq": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "seq_aux": True,
    "aux_loss_alpha": 0.001,
    "ep_size": 1,
    "hidden_act": "silu",
    # DeepSeek-V3's YaRN geometry: max_position_embeddings = factor x original_max_position_embeddings, and the
    # floats typed as floats, else transformers >= 4.56 warns that the config is inconsistent on every load
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rms_norm_eps": 1e-06,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    # the tokenizer's <|pad|>: verl 0.4.0's FSDP worker takes the HF rollout's pad id from the generation config
    # (built from config.json), and pads early-stopped generations with it
    "pad_token_id": 2,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}
FP8_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 as DeepSeek ships it: weight ~= fp8 * scale_inv, one scale per 128x128 block."""
    m, n = weight.shape
    bm, bn = -(-m // FP8_BLOCK), -(-n // FP8_BLOCK)
    padded = torch.zeros(bm * FP8_BLOCK, bn * FP8_BLOCK, dtype=torch.float32)
    padded[:m, :n] = weight.float()
    blocks = padded.view(bm, FP8_BLOCK, bn, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(bm * FP8_BLOCK, bn * FP8_BLOCK)
    return q[:m, :n].to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def make_config(overrides: dict | None = None) -> dict:
    config = json.loads(json.dumps(TINY_CONFIG))
    config.update(overrides or {})
    dims_from_config(config, "make-tiny config")  # validate early
    return config


def make_tiny(dst: Path, *, fp8: bool = False, overrides: dict | None = None, seed: int = 0, shards: int = 2,
              split_scales: bool = False, tokenizer: bool = True) -> dict[str, torch.Tensor]:
    """Write the checkpoint (and a local tokenizer); returns the bf16 tensors it holds (for fp8, the
    values before quantisation)."""
    config = make_config(overrides)
    dims = dims_from_config(config)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, (shape, _) in hf_tensors(dims).items():
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("e_score_correction_bias"):
            value = 0.01 * torch.randn(shape, generator=gen)
            tensors[name] = value.float()  # DeepSeek keeps the router bias in fp32
            continue
        else:
            value = 0.02 * torch.randn(shape, generator=gen)
        tensors[name] = value.to(torch.bfloat16)
    stored: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, (_, quantised) in hf_tensors(dims).items():
        if fp8 and quantised:
            stored[name], scales[f"{name}_scale_inv"] = quantize_blocks(tensors[name])
        else:
            stored[name] = tensors[name]
    if fp8:
        config["quantization_config"] = FP8_QUANTIZATION
    write_checkpoint(dst, config, stored, scales, shards, split_scales)
    if tokenizer:
        write_tokenizer(dst, dims.vocab)
    return tensors


def write_checkpoint(dst: Path, config: dict, stored: dict, scales: dict, shards: int, split_scales: bool) -> None:
    """Tensors split over `shards` safetensors files with their index and config.json: an HF checkpoint."""
    dst.mkdir(parents=True, exist_ok=True)
    names = list(stored)
    groups: list[list[str]] = [names[i * len(names) // shards:(i + 1) * len(names) // shards] for i in range(shards)]
    if not split_scales:  # a scale sits beside its weight, as in DeepSeek's own release
        groups = [[x for n in g for x in ([n, f"{n}_scale_inv"] if f"{n}_scale_inv" in scales else [n])]
                  for g in groups]
    else:  # every scale in a shard of its own: the converter must follow the index
        groups.append(list(scales))
    total = len(groups)
    weight_map = {}
    everything = {**stored, **scales}
    for i, group in enumerate(groups, 1):
        shard = f"model-{i:05d}-of-{total:05d}.safetensors"
        with atomic_write(dst / shard) as tmp:
            save_file({n: everything[n] for n in group}, str(tmp), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, shard))
    size = sum(t.numel() * t.element_size() for t in everything.values())
    (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map}, indent=2) + "\n")
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
