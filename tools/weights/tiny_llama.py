"""A tiny dense Llama with random weights, for tests and benchmarks that need a real vLLM engine on CPU.

Two layers and hidden 64 by default, vocab 128, bf16, weights drawn at a scale (0.3) large enough that greedy
decoding has clear winners (vLLM's dummy load format draws tiny weights, whose near-ties flip with batch-dependent
rounding), written as an HF checkpoint with the local character tokenizer (vLLM's LLMEngine loads one even when
unused).

  python -c "from tools.weights.tiny_llama import make_tiny_llama; make_tiny_llama('/tmp/tiny_llama')"
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from tools.weights.tokenizer import write_tokenizer


def make_tiny_llama(path: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> None:
    """Write config.json, model.safetensors and the tokenizer into `path` (a larger `hidden`, a multiple of 32,
    or more `layers` give a slower decode step, e.g. for benchmarks)."""
    head, vocab = 32, 128  # head size 32: vLLM CPU's smallest
    if hidden < head or hidden % head:
        raise ValueError(f"hidden must be a positive multiple of the head size {head}, got {hidden}")
    inter, heads, kv_heads = 2 * hidden, hidden // head, max(1, hidden // head // 2)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden).bfloat16(),
               "lm_head.weight": rand(vocab, hidden)}
    for i in range(layers):
        pre = f"model.layers.{i}"
        weights.update({f"{pre}.input_layernorm.weight": torch.ones(hidden).bfloat16(),
                        f"{pre}.post_attention_layernorm.weight": torch.ones(hidden).bfloat16(),
                        f"{pre}.self_attn.q_proj.weight": rand(heads * head, hidden),
                        f"{pre}.self_attn.k_proj.weight": rand(kv_heads * head, hidden),
                        f"{pre}.self_attn.v_proj.weight": rand(kv_heads * head, hidden),
                        f"{pre}.self_attn.o_proj.weight": rand(hidden, heads * head),
                        f"{pre}.mlp.gate_proj.weight": rand(inter, hidden),
                        f"{pre}.mlp.up_proj.weight": rand(inter, hidden),
                        f"{pre}.mlp.down_proj.weight": rand(hidden, inter)})
    os.makedirs(path, exist_ok=True)
    write_tokenizer(Path(path), vocab)  # vLLM's LLMEngine loads one even when it is not used
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
