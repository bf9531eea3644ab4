"""MindSpeed / MindSpeed-LLM backend (verl series): the argument names built from verl's config and config.json are
checked against the parsers of the pinned Megatron, MindSpeed and MindSpeed-LLM sources, read as text (skipped when a
source is absent: MindSpeed is gitcode only). The unit tests of the argument set and the activation are the fork's
tests/workers/mindspeed/test_args.py.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from tests import stack
from tests.verl.conftest import require

ms_args = require("verl.workers.mindspeed.args")
ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "third_party" / d for d in ("Megatron-LM", "MindSpeed", "MindSpeed-LLM")]

DSV3 = {  # DeepSeek-V3's config.json, the fields the mapping reads
    "num_hidden_layers": 61, "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 128,
    "max_position_embeddings": 163840, "vocab_size": 129280, "tie_word_embeddings": False, "rope_theta": 10000,
    "rms_norm_eps": 1e-6, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
    "n_shared_experts": 1, "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "seq_aux": True, "aux_loss_alpha": 0.001,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
}


def _config(**megatron):
    block = {"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 8, "expert_model_parallel_size": 8,
             "num_layer_list": [7, 7, 8, 8, 8, 8, 8, 7], "moe_tp_extend_ep": True, "swap_optimizer": True,
             "optimizer_offload": False, "seed": 42,
             "override_transformer_config": {"recompute_granularity": "full", "recompute_method": "block",
                                             "recompute_num_layers": 8}, **megatron}
    return OmegaConf.create({
        "model": {"path": "/models/dsv3"},
        "actor": {"ppo_mini_batch_size": 512, "ppo_micro_batch_size_per_gpu": 1, "megatron": block},
        "rollout": {"prompt_length": 1024, "response_length": 3072, "n": 16}})


def test_every_built_argument_exists_in_the_pinned_parsers():
    parsers = [d / rel for d, rel in zip(SOURCES, ms_args.PARSER_SOURCES, strict=True)]
    for source, parser in zip(("git", "mindspeed", "mindspeed-llm"), parsers, strict=True):
        if not parser.is_file():  # an unsynced submodule is an empty folder; megatron/training is git-only
            stack.unavailable(source, f"{parser} (python -m tools.forks sync megatron mindspeed mindspeed-llm)")
    known = ms_args.known_arguments(SOURCES)
    assert {"num_layer_list", "moe_tp_extend_ep", "swap_optimizer", "use_fused_rmsnorm", "bf16"} <= known
    cfg = _config()
    built = ms_args.build(cfg, cfg.actor.megatron, DSV3, known=known)
    missing = sorted(k for k in built if k not in known)
    assert not missing, f"not an argument of any pinned parser: {missing}"
