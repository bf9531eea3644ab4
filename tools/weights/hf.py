"""What a HF DeepSeek-V3 checkpoint holds, from its dims (tools/model/dims.py; never hard-coded sizes).

`hf_tensors` lists every tensor of a checkpoint of that config, with its shape and whether DeepSeek's
FP8 release quantises it (block-wise, with a `<name>_scale_inv` companion).
"""

from __future__ import annotations

from pathlib import Path

from tools.model.dims import Dims
from tools.model.errors import ConfigError
from tools.weights.files import read_json

FP8_BLOCK = 128


def load_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.exists():
        raise ConfigError(f"{path} not found: point --src at a HF checkpoint directory")
    return read_json(path, "HF config")


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}"


def hf_tensors(dims: Dims) -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (shape, quantised in DeepSeek's FP8 release), in checkpoint order."""
    out: dict[str, tuple[tuple[int, ...], bool]] = {"model.embed_tokens.weight": ((dims.vocab, dims.hidden), False)}
    for layer in range(dims.layers):
        p = layer_prefix(layer)
        out[f"{p}.input_layernorm.weight"] = ((dims.hidden,), False)
        out[f"{p}.self_attn.q_a_proj.weight"] = ((dims.q_lora_rank, dims.hidden), True)
        out[f"{p}.self_attn.q_a_layernorm.weight"] = ((dims.q_lora_rank,), False)
        out[f"{p}.self_attn.q_b_proj.weight"] = ((dims.heads * dims.qk_head, dims.q_lora_rank), True)
        out[f"{p}.self_attn.kv_a_proj_with_mqa.weight"] = ((dims.kv_lora_rank + dims.qk_rope, dims.hidden), True)
        out[f"{p}.self_attn.kv_a_layernorm.weight"] = ((dims.kv_lora_rank,), False)
        out[f"{p}.self_attn.kv_b_proj.weight"] = ((dims.heads * (dims.qk_nope + dims.v_head), dims.kv_lora_rank), True)
        out[f"{p}.self_attn.o_proj.weight"] = ((dims.hidden, dims.heads * dims.v_head), True)
        out[f"{p}.post_attention_layernorm.weight"] = ((dims.hidden,), False)
        if not dims.is_moe(layer):
            out.update(_mlp(f"{p}.mlp", dims.intermediate, dims.hidden))
            continue
        out[f"{p}.mlp.gate.weight"] = ((dims.experts, dims.hidden), False)
        out[f"{p}.mlp.gate.e_score_correction_bias"] = ((dims.experts,), False)
        for e in range(dims.experts):
            out.update(_mlp(f"{p}.mlp.experts.{e}", dims.moe_intermediate, dims.hidden))
        if dims.shared_experts:
            out.update(_mlp(f"{p}.mlp.shared_experts", dims.moe_intermediate * dims.shared_experts, dims.hidden))
    out["model.norm.weight"] = ((dims.hidden,), False)
    if not dims.tie_embeddings:
        out["lm_head.weight"] = ((dims.vocab, dims.hidden), False)
    return out


def hf_shapes(dims: Dims) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor of the HF checkpoint."""
    return {name: shape for name, (shape, _) in hf_tensors(dims).items()}


def _mlp(prefix: str, inner: int, hidden: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    return {
        f"{prefix}.gate_proj.weight": ((inner, hidden), True),
        f"{prefix}.up_proj.weight": ((inner, hidden), True),
        f"{prefix}.down_proj.weight": ((hidden, inner), True),
    }


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Shape of `<name>_scale_inv` for a block-quantised [m, n] weight: one scale per 128x128 block."""
    m, n = shape
    return (-(-m // FP8_BLOCK), -(-n // FP8_BLOCK))
