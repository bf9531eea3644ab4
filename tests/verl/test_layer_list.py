"""verl's side of uneven pipeline stages (`*.megatron.num_layer_list`) and its DeepSeek-V3 config.

- the list reaches the TransformerConfig verl builds, and verl's any-stage layer offsets and global
  layer names (the weight sync to the rollout) agree with Megatron's for uneven lists;
- hf_to_mcore_config_dpskv3 against the real DeepSeek-V3 config.json values, with routing and
  YaRN compared against transformers' own DeepSeek-V3 implementation;
- HF -> mcore names -> HF on a tiny DeepSeek-V3 through verl's two weight converters and an
  uneven pipeline split: every key, shape and value comes back;
- MindSpeed-LLM's layer-list wrappers give the same per-stage counts and offsets on that config.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests import stack
from tests.gloo import single_rank_model_parallel


def require(module: str):
    """Import a module of our forks (skips saying why, or fails under the switch: tests/stack.py)."""
    return stack.require(module, "sync and apply the verl and megatron forks, then install them (nox -s tests"
                                 " does both)")

layer_list = require("verl.utils.megatron.layer_list")
megatron_utils = require("verl.utils.megatron_utils")
verl_model = require("verl.utils.model")
config_converter = require("verl.models.mcore.config_converter")
weight_converter = require("verl.models.mcore.weight_converter")
parallel_state = require("megatron.core.parallel_state")
transformer_layer = require("megatron.core.transformer.transformer_layer")
transformer_block = require("megatron.core.transformer.transformer_block")
moe_utils = require("megatron.core.transformer.moe.moe_utils")
yarn = require("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")
hf_dsv3 = require("transformers.models.deepseek_v3.modeling_deepseek_v3")
from megatron.core.transformer import TransformerConfig  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from transformers import DeepseekV3Config  # noqa: E402

if "num_layer_list" not in TransformerConfig.__dataclass_fields__:
    stack.missing("megatron-core lacks our num_layer_list patch", stack.series("megatron"))

ROOT = Path(__file__).resolve().parents[2]
DSV3_LIST = [7, 7, 8, 8, 8, 8, 8, 7]  # the reference's split of 61 layers on 8 stages
FIRST_LAST_LIST = [6, 8, 8, 8, 8, 8, 8, 7]
# verl's megatron_workers passes this to the weight sync (per_tensor_generator)
LAYER_NAME_MAPPING = {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1.weight"}

# deepseek-ai/DeepSeek-V3 config.json, written out; quantization_config (block FP8) left out as
# `tools.weights fp8-to-bf16` writes it: verl trains bf16 weights.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

# Same architecture, tiny: 5 layers (2 dense), 8 experts in 4 groups, MTP layer declared.
TINY = {**DEEPSEEK_V3, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 5,
        "first_k_dense_replace": 2, "n_routed_experts": 8, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 8,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "vocab_size": 64,
        "max_position_embeddings": 4096 * 40}
TINY_LIST = [1, 3, 1]


@pytest.fixture(scope="module")
def mp1():
    """One-rank gloo and Megatron model parallel (1, 1): verl's config converter reads its sizes."""
    with single_rank_model_parallel():
        yield


def prefix_sums(layers):
    return [sum(layers[:i]) for i in range(len(layers) + 1)]


def tf_config(num_layers, pp, **kwargs):
    return TransformerConfig(num_layers=num_layers, hidden_size=16, num_attention_heads=2,
                             pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, **kwargs)


def at_stage(monkeypatch, pp, stage):
    monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", pp)
    monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_RANK", stage)


def dsv3_config(values, **overrides):
    return config_converter.hf_to_mcore_config_dpskv3(DeepseekV3Config(**values), torch.bfloat16, **overrides)


def recipe_overrides(layers, **extra):
    """What megatron_workers passes to hf_to_mcore_config for the actor of a recipe config."""
    block = OmegaConf.create({"num_layer_list": layers,
                              "override_transformer_config": {"recompute_granularity": "selective", **extra}})
    return layer_list.transformer_config_overrides(block, "actor_rollout_ref.actor.megatron")




# -- verl's layer offsets and global layer names ----------------------------------------------


@pytest.mark.parametrize("layers", [DSV3_LIST, FIRST_LAST_LIST, [1, 3, 2, 2]])
def test_verl_offsets_agree_with_megatron(layers, monkeypatch):
    cfg = tf_config(sum(layers), len(layers), num_layer_list=layers)
    for stage in range(len(layers)):
        at_stage(monkeypatch, len(layers), stage)
        megatron = transformer_layer.get_transformer_layer_offset(cfg)
        assert megatron_utils.get_transformer_layer_offset(stage, 0, cfg) == megatron == prefix_sums(layers)[stage]
        assert transformer_block.get_num_layers_to_build(cfg) == layers[stage]


def test_list_and_first_last_counts_name_layers_alike():
    """verl's existing first/last path and the list give the same offsets where both can express the split."""
    by_list = tf_config(61, 8, num_layer_list=FIRST_LAST_LIST)
    by_ends = tf_config(61, 8, num_layers_in_first_pipeline_stage=6, num_layers_in_last_pipeline_stage=7)
    offsets = [[megatron_utils.get_transformer_layer_offset(p, 0, c) for p in range(8)] for c in (by_list, by_ends)]
    assert offsets[0] == offsets[1] == prefix_sums(FIRST_LAST_LIST)[:-1]


def test_global_layer_names_cover_every_layer_once():
    cfg = tf_config(61, 8, num_layer_list=DSV3_LIST)
    leaf = "self_attention.linear_proj.weight"
    stages = [[{f"decoder.layers.{i}.{leaf}": (p, i) for i in range(n)} | {"embedding.word_embeddings.weight": (p, -1)}]
              for p, n in enumerate(DSV3_LIST)]
    named = list(verl_model.normalize_pp_vpp_params(stages, cfg))
    layer_names = [name for name, _ in named if ".layers." in name]
    assert layer_names == [f"decoder.layers.{g}.{leaf}" for g in range(61)]
    for name, (stage, local) in named:
        if local >= 0:  # the name verl's weight sync uses for (stage, local layer)
            assert verl_model.normalize_model_name(f"decoder.layers.{local}.{leaf}", stage, 0, cfg) == name
    assert [name for name, _ in named if ".layers." not in name] == ["embedding.word_embeddings.weight"] * 8


# -- hf_to_mcore_config_dpskv3 against the real DeepSeek-V3 config ----------------------------


def test_dsv3_config_matches_the_real_model(mp1):
    c = dsv3_config(DEEPSEEK_V3, pipeline_model_parallel_size=8, **recipe_overrides(DSV3_LIST))
    assert (c.num_layers, c.hidden_size, c.ffn_hidden_size, c.num_attention_heads) == (61, 7168, 18432, 128)
    assert c.moe_layer_freq == [0] * 3 + [1] * 58  # first_k_dense_replace = 3
    assert (c.num_moe_experts, c.moe_router_topk) == (256, 8)
    assert (c.moe_ffn_hidden_size, c.moe_shared_expert_intermediate_size) == (2048, 2048)
    assert (c.moe_router_num_groups, c.moe_router_group_topk) == (8, 4)
    assert (c.moe_router_score_function, c.moe_router_topk_scaling_factor) == ("sigmoid", 2.5)
    assert c.moe_router_enable_expert_bias and c.moe_router_bias_update_rate == 1e-3
    assert (c.q_lora_rank, c.kv_lora_rank, c.v_head_dim) == (1536, 512, 128)
    assert (c.qk_head_dim, c.qk_pos_emb_head_dim) == (128, 64)
    assert (c.rope_type, c.rotary_base, c.rotary_scaling_factor, c.max_position_embeddings) == ("yarn", 10000, 40, 4096)
    assert (c.beta_fast, c.beta_slow, c.mscale, c.mscale_all_dim) == (32, 1, 1.0, 1.0)
    assert c.layernorm_epsilon == 1e-6 and c.qk_layernorm and c.normalization == "RMSNorm"
    assert c.mtp_num_layers is None  # MTP off for RL, although the checkpoint declares one MTP layer
    assert c.num_layer_list == DSV3_LIST and c.layer_offset == prefix_sums(DSV3_LIST)


def test_rope_type_key_alone_selects_yarn(mp1):
    """Configs that spell the scaling kind only as `rope_type` still get YaRN, not plain RoPE."""
    scaling = {k: v for k, v in DEEPSEEK_V3["rope_scaling"].items() if k != "type"} | {"rope_type": "yarn"}
    assert dsv3_config(DEEPSEEK_V3 | {"rope_scaling": scaling}).rope_type == "yarn"


def test_fp8_checkpoint_config_is_refused(mp1):
    fp8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(AssertionError, match="quantization_config"):
        dsv3_config(DEEPSEEK_V3 | {"quantization_config": fp8})


def test_dsv3_routing_equals_transformers(mp1):
    """Megatron's router with the converted settings picks the experts, and weighs them, as DeepSeek-V3."""
    c = dsv3_config(DEEPSEEK_V3)
    gen = torch.Generator().manual_seed(0)
    router = hf_dsv3.DeepseekV3TopkRouter(DeepseekV3Config(**DEEPSEEK_V3))
    router.weight.data = torch.randn(256, 7168, generator=gen) / 7168**0.5
    router.e_score_correction_bias.data = torch.rand(256, generator=gen) * 0.05
    hidden = torch.randn(64, 7168, generator=gen)
    want_idx, want_w = router(hidden)
    logits = torch.nn.functional.linear(hidden, router.weight)
    probs, routing_map, _ = moe_utils.topk_softmax_with_capacity(
        logits, c.moe_router_topk, use_pre_softmax=c.moe_router_pre_softmax, num_groups=c.moe_router_num_groups,
        group_topk=c.moe_router_group_topk, scaling_factor=c.moe_router_topk_scaling_factor,
        score_function=c.moe_router_score_function, expert_bias=router.e_score_correction_bias)
    for t in range(64):
        chosen = routing_map[t].nonzero().flatten()
        assert sorted(chosen.tolist()) == sorted(want_idx[t].tolist()), t
        order = want_idx[t].argsort()
        torch.testing.assert_close(probs[t, chosen], want_w[t][order], rtol=1e-5, atol=1e-6)


def test_dsv3_yarn_equals_transformers(mp1, monkeypatch):
    """YaRN frequencies, their mscale and the attention softmax scale from the converted config."""
    c = dsv3_config(DEEPSEEK_V3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # YaRN moves its buffers there
    # the arguments MLASelfAttention passes for rope_type "yarn" (megatron/core/transformer/multi_latent_attention.py)
    rope = yarn.YarnRotaryEmbedding(
        c.qk_pos_emb_head_dim, rotary_base=c.rotary_base, scaling_factor=c.rotary_scaling_factor,
        original_max_position_embeddings=c.max_position_embeddings, beta_fast=c.beta_fast, beta_slow=c.beta_slow,
        mscale=c.mscale, mscale_all_dim=c.mscale_all_dim, use_cpu_initialization=True)
    emb, mscale = rope(8192)
    hf_config = DeepseekV3Config(**DEEPSEEK_V3)
    hf_rope = hf_dsv3.DeepseekV3RotaryEmbedding(hf_config)
    hf_freqs = torch.outer(torch.arange(8192, dtype=torch.float32), hf_rope.inv_freq)
    torch.testing.assert_close(emb[:, 0, 0, :], torch.cat((hf_freqs, hf_freqs), dim=-1), rtol=1e-6, atol=1e-4)
    assert mscale == pytest.approx(hf_rope.attention_scaling)
    q_head_dim = c.qk_head_dim + c.qk_pos_emb_head_dim
    megatron_scale = yarn._yarn_get_mscale(c.rotary_scaling_factor, c.mscale) ** 2 / math.sqrt(q_head_dim)
    hf_scale = q_head_dim**-0.5 * hf_dsv3.yarn_get_mscale(40, DEEPSEEK_V3["rope_scaling"]["mscale_all_dim"]) ** 2
    assert megatron_scale == pytest.approx(hf_scale)


# -- HF -> mcore names -> HF on a tiny DeepSeek-V3 ------------------------------------------


class Matches:
    """A Slot's dtype and shape where `shapes` names none: equal to the source's. v0.6.1's converter checks both
    before each copy (safe_copy); a recorder has neither of its own, and the names are what this test checks."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False


class Slot:
    """Stands in for an mcore module or parameter: records what verl's HF -> mcore converter copies in,
    under the dotted attribute path (= the mcore parameter name). `absent` names raise AttributeError
    (dense layers have no router), `shapes` answers the converter's shape checks by leaf name."""

    def __init__(self, path, store, shapes, absent=()):
        self._path, self._store, self._shapes, self._absent = path, store, shapes, set(absent)

    def __getattr__(self, name):
        if name.startswith("_") or name in self._absent:
            raise AttributeError(name)
        if name in ("data",):
            return self
        if name == "shape":
            return self._shapes.get(self._path.rsplit(".", 1)[-1], Matches())
        if name == "dtype":
            return Matches()
        child = Slot(f"{self._path}.{name}".lstrip("."), self._store, self._shapes)
        object.__setattr__(self, name, child)
        return child

    def copy_(self, src):
        assert self._path not in self._store or torch.equal(self._store[self._path], src), self._path
        self._store[self._path] = src.detach().clone()


def mcore_model_from_hf(hf_model, tfconfig):
    """Run verl's HF -> mcore converter (scripts/converter_hf_to_mcore.py) into Slots: mcore name -> tensor."""
    script = Path(layer_list.__file__).resolve().parents[3] / "scripts" / "converter_hf_to_mcore.py"
    if not script.is_file():
        stack.unavailable(stack.GIT, f"verl's HF -> mcore converter {script} (scripts/ is not in verl's sdist)")
    spec = importlib.util.spec_from_file_location("verl_converter_hf_to_mcore", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    store, shapes = {}, {"expert_bias": torch.Size([tfconfig.num_moe_experts])}
    model = Slot("", store, shapes)
    moe = tfconfig.moe_layer_freq
    model.decoder.layers = [Slot(f"decoder.layers.{i}", store, shapes) for i in range(tfconfig.num_layers)]
    for i, layer in enumerate(model.decoder.layers):
        layer.mlp = Slot(f"decoder.layers.{i}.mlp", store, shapes, absent=() if moe[i] else ("router",))
    with torch.no_grad():
        module.convert_checkpoint_from_transformers_to_megatron_dpskv3(hf_model, model, hf_model.config, tfconfig)
    return store


def split_by_stage(store, layers):
    """The global mcore state as each pipeline stage holds it: local layer indices, ends on end stages."""
    first = prefix_sums(layers)
    stages = [{} for _ in layers]
    for name, tensor in store.items():
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
        if m:
            g = int(m.group(1))
            p = max(s for s in range(len(layers)) if first[s] <= g)
            stages[p][f"decoder.layers.{g - first[p]}.{m.group(2)}"] = tensor
        else:
            stages[0 if name.startswith("embedding.") else -1][name] = tensor
    return stages


def test_tiny_dsv3_weight_names_round_trip(mp1, capsys):
    hf_config = DeepseekV3Config(**TINY)
    torch.manual_seed(0)
    hf_model = hf_dsv3.DeepseekV3ForCausalLM(hf_config).float()
    for layer in hf_model.model.layers[TINY["first_k_dense_replace"]:]:
        layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)  # zeros at init: make it count
    hf_state = hf_model.state_dict()
    tfconfig = config_converter.hf_to_mcore_config_dpskv3(
        hf_config, torch.float32, pipeline_model_parallel_size=len(TINY_LIST), **recipe_overrides(TINY_LIST))
    assert tfconfig.moe_layer_freq == [0, 0, 1, 1, 1] and tfconfig.mtp_num_layers is None
    mcore = mcore_model_from_hf(hf_model, tfconfig)
    capsys.readouterr()  # the converter prints layer indices
    assert sum(n.startswith("decoder.layers.2.mlp.experts.linear_fc1.weight") for n in mcore) == 8  # grouped GEMM names

    converter = weight_converter.McoreToHFWeightConverterDpskv3(hf_config, tfconfig)
    back = {}
    for stage, params in enumerate(split_by_stage(mcore, TINY_LIST)):
        for local, tensor in params.items():
            name = verl_model.normalize_model_name(local, stage, 0, tfconfig)
            group = [tensor]
            # fused gate|up: split as the weight sync does (TP 1); v0.6.1 takes hf_config before the flag
            if LAYER_NAME_MAPPING["gate_proj_layer_name"] in name:
                group = megatron_utils.default_tp_concat_fn(
                    LAYER_NAME_MAPPING, name, tensor, [tensor], hf_config, hf_config=hf_config,
                    convert_qkv_gate_up_by_simple_split=True)
            for hf_name, hf_tensor in zip(*converter.convert_param(name, group), strict=True):
                assert hf_name not in back, hf_name
                back[hf_name] = hf_tensor
    assert sorted(back) == sorted(hf_state)
    for name, tensor in hf_state.items():
        assert back[name].shape == tensor.shape and torch.equal(back[name], tensor), name


# -- MindSpeed-LLM's wrappers on the config verl builds ---------------------------------------

MINDSPEED_LLM = ROOT / "third_party" / "MindSpeed-LLM"


def mindspeed_llm_functions(path: Path, names: list[str], namespace: dict) -> dict:
    """Compile the named top-level functions out of a MindSpeed-LLM source file. Their modules import
    torch_npu, TransformerEngine and MindSpeed at the top, which a CPU machine lacks; the function bodies
    themselves need only `namespace`."""
    tree = ast.parse(path.read_text())
    funcs = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert sorted(f.name for f in funcs) == sorted(names), f"{path} no longer defines {names}"
    exec(compile(ast.Module(body=funcs, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return {name: namespace[name] for name in names}


@pytest.mark.skipif(not (MINDSPEED_LLM / "mindspeed_llm").is_dir(),
                    reason=stack.unavailable_reason("mindspeed-llm", "third_party/MindSpeed-LLM is not checked out"))
def test_mindspeed_llm_wrappers_see_the_same_stages(mp1, monkeypatch):
    ns = {"wraps": functools.wraps, "parallel_state": parallel_state}
    block = mindspeed_llm_functions(MINDSPEED_LLM / "mindspeed_llm/core/transformer/transformer_block.py",
                                    ["get_num_layers_to_build_wrapper", "get_layer_offset_wrapper"], ns)
    args = mindspeed_llm_functions(MINDSPEED_LLM / "mindspeed_llm/training/arguments.py", ["get_layer_offset"], {})
    cfg = dsv3_config(DEEPSEEK_V3, pipeline_model_parallel_size=8, **recipe_overrides("7,7,8,8,8,8,8,7"))
    # MindSpeed-LLM registers these over Megatron's functions (tasks/megatron_adaptor.py)
    num_layers_to_build = block["get_num_layers_to_build_wrapper"](transformer_block.get_num_layers_to_build)
    layer_offset = block["get_layer_offset_wrapper"](lambda self: pytest.fail("list ignored"))
    assert args["get_layer_offset"](8, cfg.num_layer_list) == cfg.layer_offset
    for stage in range(8):
        at_stage(monkeypatch, 8, stage)
        assert num_layers_to_build(cfg) == DSV3_LIST[stage] == transformer_block.get_num_layers_to_build(cfg)
        assert layer_offset(SimpleNamespace(config=cfg)) == transformer_layer.get_transformer_layer_offset(cfg) \
            == megatron_utils.get_transformer_layer_offset(stage, 0, cfg)
