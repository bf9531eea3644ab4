"""MindSpeed / MindSpeed-LLM backend (verl series): the argument set built from verl's config and config.json.

The activation itself needs Ascend NPUs (torch_npu, MindSpeed's kernels): here it is compiled and its refusal off
NPU is checked; the argument names are checked against the parsers of the pinned Megatron, MindSpeed and
MindSpeed-LLM sources, read as text (skipped when a source is absent).
"""

from __future__ import annotations

import py_compile
from pathlib import Path

import pytest
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


def test_the_a3_argument_set():
    cfg = _config()
    args = ms_args.build(cfg, cfg.actor.megatron, DSV3)
    # the run
    assert args["bf16"] and args["variable_seq_lengths"]
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"],
            args["expert_model_parallel_size"]) == (4, 8, 8)
    assert args["num_layer_list"] == "7,7,8,8,8,8,8,7"  # MindSpeed-LLM's option is a string
    assert args["seq_length"] == 4096 and args["global_batch_size"] == 512 * 16
    assert args["moe_tp_extend_ep"] and args["swap_optimizer"]
    assert (args["recompute_granularity"], args["recompute_method"], args["recompute_num_layers"]) == ("full",
                                                                                                      "block", 8)
    # the model
    assert args["multi_head_latent_attention"] and args["kv_lora_rank"] == 512 and args["q_lora_rank"] == 1536
    assert (args["num_experts"], args["moe_router_topk"], args["moe_router_num_groups"],
            args["moe_router_group_topk"]) == (256, 8, 8, 4)
    assert args["moe_router_score_function"] == "sigmoid" and args["moe_router_enable_expert_bias"]
    assert args["moe_router_bias_update_rate"] == 1e-3 and args["moe_router_topk_scaling_factor"] == 2.5
    assert args["moe_router_load_balancing_type"] == "seq_aux_loss" and args["moe_aux_loss_coeff"] == 0.001
    assert args["rope_scaling_type"] == "yarn" and args["rope_scaling_factor"] == 40
    # the kernels
    assert args["use_flash_attn"] and args["use_fused_rmsnorm"] and args["use_fused_swiglu"]
    assert args["moe_token_dispatcher_type"] == "alltoall" and args["moe_grouped_gemm"]
    assert args["moe_alltoall_overlap_comm"]


def test_argv_form():
    argv = ms_args.to_argv({"bf16": True, "sequence_parallel": False, "num_layer_list": "7,8", "seed": None,
                            "moe_router_topk": 8, "some_list": [1, 2]})
    assert argv == ["--bf16", "--num-layer-list=7,8", "--moe-router-topk=8", "--some-list", "1", "2"]


def test_user_args_override_and_unknown_names_are_refused():
    cfg = _config(mindspeed={"args": {"recompute_num_layers": 4, "use_fused_swiglu": False}})
    args = ms_args.build(cfg, cfg.actor.megatron, DSV3, known={"recompute_num_layers", "use_fused_swiglu"})
    assert args["recompute_num_layers"] == 4 and args["use_fused_swiglu"] is False
    bad = _config(mindspeed={"args": {"recompute_num_layer": 4}})
    with pytest.raises(ValueError, match="megatron.mindspeed.args: recompute_num_layer is not an argument"):
        ms_args.build(bad, bad.actor.megatron, DSV3, known={"recompute_num_layers"})


def test_swap_optimizer_and_optimizer_offload_exclude_each_other():
    cfg = _config(optimizer_offload=True)
    with pytest.raises(ValueError, match="set optimizer_offload=false with swap_optimizer=true"):
        ms_args.build(cfg, cfg.actor.megatron, DSV3)


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


def test_activation_is_npu_only_and_compiles(monkeypatch):
    activate = require("verl.workers.mindspeed.activate")
    py_compile.compile(activate.__file__, doraise=True)
    monkeypatch.setattr(activate, "is_npu_available", False)
    with pytest.raises(RuntimeError, match="mindspeed.enable=true needs Ascend NPUs"):
        activate.activate_mindspeed(_config(), _config().actor.megatron)
