"""DeepSeek-V3 architecture facts, all read from a HF `config.json` (never hard-coded sizes).

`Dims` carries the sizes the converters need, and `hf_tensors` lists every tensor a HF checkpoint of
that config holds, with its shape and whether DeepSeek's FP8 release quantises it (block-wise, with a
`<name>_scale_inv` companion).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FP8_BLOCK = 128


class ConfigError(ValueError):
    """config.json lacks a field or holds an inconsistent value; the message names it."""


@dataclass(frozen=True)
class Dims:
    vocab: int
    hidden: int
    layers: int
    dense_layers: int  # first_k_dense_replace
    intermediate: int  # dense MLP
    moe_intermediate: int  # per routed expert
    experts: int
    shared_experts: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    tie_embeddings: bool

    @property
    def qk_head(self) -> int:
        return self.qk_nope + self.qk_rope

    def is_moe(self, layer: int) -> bool:
        return layer >= self.dense_layers


FIELDS = {
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "layers": "num_hidden_layers",
    "dense_layers": "first_k_dense_replace",
    "intermediate": "intermediate_size",
    "moe_intermediate": "moe_intermediate_size",
    "experts": "n_routed_experts",
    "shared_experts": "n_shared_experts",
    "heads": "num_attention_heads",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope": "qk_nope_head_dim",
    "qk_rope": "qk_rope_head_dim",
    "v_head": "v_head_dim",
}


def dims_from_config(config: dict, where: str = "config.json") -> Dims:
    values = {}
    for attr, key in FIELDS.items():
        value = config.get(key)
        if not isinstance(value, int) or value < 0 or (value == 0 and attr not in ("dense_layers", "shared_experts")):
            raise ConfigError(f"{where}: `{key}` is {value!r}; a DeepSeek-V3 config needs a positive integer there")
        values[attr] = value
    if config.get("model_type") not in (None, "deepseek_v3"):
        raise ConfigError(f"{where}: model_type is {config.get('model_type')!r}, expected 'deepseek_v3'")
    dims = Dims(**values, tie_embeddings=bool(config.get("tie_word_embeddings", False)))
    if dims.dense_layers > dims.layers:
        raise ConfigError(f"{where}: first_k_dense_replace {dims.dense_layers} > num_hidden_layers {dims.layers}")
    return dims


def load_config(directory: Path) -> dict:
    path = directory / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} not found: point --src at a HF checkpoint directory") from None


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
