"""Uneven pipeline stages from a per-stage layer list, carried in our Megatron fork.

`TransformerConfig.num_layer_list` (validated in `__post_init__`, with the derived prefix sums
`layer_offset`) is read by `get_num_layers_to_build` and `get_transformer_layer_offset`. The
pure tests set the pipeline rank directly; the gloo test builds a tiny GPTModel on each of four
pipeline stages and checks which global layers each stage holds and names.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from tests import stack

torch = stack.require("torch")
try:
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.pipeline_layer_list import parse_num_layer_list
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
except ImportError as exc:  # megatron-core absent, or our fork patch not applied
    stack.missing(f"megatron.core with num_layer_list is not importable ({exc})", stack.series("megatron"))

from tests.gloo import run_processes  # noqa: E402

DSV3_LIST = [7, 7, 8, 8, 8, 8, 8, 7]  # the reference's 61 layers on 8 stages
FIRST_LAST_LIST = [6, 8, 8, 8, 8, 8, 8, 7]  # also expressible with first/last stage counts


def config(num_layers, pp, **kwargs):
    return TransformerConfig(num_layers=num_layers, hidden_size=16, num_attention_heads=2,
                             pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, **kwargs)


def per_stage(cfg, monkeypatch):
    """(layers to build, layer offset) on every pipeline stage of cfg."""
    monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", cfg.pipeline_model_parallel_size)
    out = []
    for stage in range(cfg.pipeline_model_parallel_size):
        monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_RANK", stage)
        out.append((get_num_layers_to_build(cfg), get_transformer_layer_offset(cfg)))
    return out


def prefix_sums(layers):
    return [sum(layers[:i]) for i in range(len(layers) + 1)]


@pytest.mark.parametrize("layers", [DSV3_LIST, FIRST_LAST_LIST, [1, 3, 2, 2], [5]])
def test_counts_and_offsets_follow_the_list(layers, monkeypatch):
    cfg = config(sum(layers), len(layers), num_layer_list=list(layers))
    assert cfg.layer_offset == prefix_sums(layers)
    assert per_stage(cfg, monkeypatch) == [(n, prefix_sums(layers)[p]) for p, n in enumerate(layers)]


def test_list_agrees_with_megatrons_first_last_split(monkeypatch):
    """Where first/last counts can express the split, both paths give every stage the same layers."""
    by_list = per_stage(config(61, 8, num_layer_list=FIRST_LAST_LIST), monkeypatch)
    by_ends = per_stage(config(61, 8, num_layers_in_first_pipeline_stage=6,
                               num_layers_in_last_pipeline_stage=7), monkeypatch)
    assert by_list == by_ends


def test_reference_split_needs_the_list():
    """7,7,8,8,8,8,8,7 leaves 47 middle layers for 6 stages: first/last counts cannot express it."""
    with pytest.raises(ValueError, match="middle"):
        config(61, 8, num_layers_in_first_pipeline_stage=7, num_layers_in_last_pipeline_stage=7)
    assert config(61, 8, num_layer_list=DSV3_LIST).num_layer_list == DSV3_LIST


def test_string_form_is_parsed():
    """MindSpeed-LLM keeps --num-layer-list as a string; Megatron's args -> config copy passes it on."""
    cfg = config(61, 8, num_layer_list=" 7,7,8,8, 8,8,8,7")
    assert cfg.num_layer_list == DSV3_LIST and cfg.layer_offset == prefix_sums(DSV3_LIST)
    assert parse_num_layer_list(None) is None and parse_num_layer_list("") is None and parse_num_layer_list([]) is None


def test_unset_list_keeps_megatrons_even_split(monkeypatch):
    cfg = config(8, 4)
    assert cfg.num_layer_list is None and cfg.layer_offset is None
    assert per_stage(cfg, monkeypatch) == [(2, 0), (2, 2), (2, 4), (2, 6)]


def test_layer_offset_is_always_derived():
    """Copies of a config (dataclasses.replace, or fields -> kwargs as Megatron's heterogeneous config
    does) carry layer_offset in; it is recomputed from num_layer_list, never trusted."""
    cfg = config(8, 4, num_layer_list=[1, 3, 2, 2])
    moved = dataclasses.replace(cfg, num_layer_list=[2, 2, 2, 2])
    assert moved.layer_offset == [0, 2, 4, 6, 8]
    copied = TransformerConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    assert copied.num_layer_list == [1, 3, 2, 2] and copied.layer_offset == [0, 1, 4, 6, 8]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_layer_list=[4, 4]), "has 2 entries but pipeline_model_parallel_size is 4"),
        (dict(num_layer_list=[2, 2, 2, 3]), "sums to 9 but num_layers is 8"),
        (dict(num_layer_list=[0, 4, 2, 2]), "at least one layer"),
        (dict(num_layer_list="2,2,x,2"), "integers separated by commas"),
        (dict(num_layer_list=[2, 2, 2.0, 2]), "entries must be ints"),
        (dict(num_layer_list=[True, 3, 2, 2]), "entries must be ints"),
        (dict(num_layer_list=[1, 3, 2, 2], num_layers_in_first_pipeline_stage=1), "num_layers_in_first_pipeline_stage"),
        (dict(num_layer_list=[1, 3, 2, 2], num_layers_in_last_pipeline_stage=2), "num_layers_in_last_pipeline_stage"),
        (dict(num_layer_list=[1, 3, 2, 2], account_for_loss_in_pipeline_split=True),
         "account_for_loss_in_pipeline_split"),
        (dict(num_layer_list=[2, 2, 2, 2], virtual_pipeline_model_parallel_size=2),
         "virtual_pipeline_model_parallel_size"),
    ],
)
def test_bad_lists_are_refused_with_the_field_named(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        config(8, 4, **kwargs)
    assert "num_layer_list" in str(err.value)


def test_dense_and_moe_layers_land_on_their_stages(monkeypatch):
    """DeepSeek-style moe_layer_freq lists are sliced per stage by the same counts and offsets
    (get_gpt_decoder_block_spec, what verl's DeepSeek-V3 initializer builds from)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    layers, moe = [1, 4, 1], [0, 0, 0, 1, 1, 1]  # an even split's offsets (0, 2, 4) would shift stage 1
    cfg = config(6, 3, num_layer_list=layers, num_moe_experts=4, moe_layer_freq=moe, moe_ffn_hidden_size=8,
                 add_bias_linear=False)
    monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE", 3)
    kinds = []
    for stage in range(3):
        monkeypatch.setattr(parallel_state, "_MPU_PIPELINE_MODEL_PARALLEL_RANK", stage)
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
        kinds.append([layer.submodules.mlp.module.__name__ for layer in spec.layer_specs])
    assert kinds == [["MLP"], ["MLP", "MLP", "MoELayer", "MoELayer"], ["MoELayer"]]


def _stage_worker(rank, port, layers, results):
    """One pipeline stage: build a tiny GPTModel and report its layers' global numbers and names."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=len(layers))
    try:
        parallel_state.initialize_model_parallel(1, len(layers))
        cfg = config(sum(layers), len(layers), num_layer_list=",".join(map(str, layers)),
                     use_cpu_initialization=True)
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32,
                         max_sequence_length=8, pre_process=parallel_state.is_pipeline_first_stage(),
                         post_process=parallel_state.is_pipeline_last_stage())
        # A dist checkpoint stacks each layer tensor over all layers: axis 0 has num_layers entries
        # and this stage's tensors sit at their global layer index on it.
        layer_tensors = [t for t in model.sharded_state_dict().values()
                         if getattr(t, "key", "").startswith("decoder.layers.")]
        global_idx = sorted({t.global_offset[0] for t in layer_tensors})
        stacked = {t.global_shape[0] for t in layer_tensors}
        results[rank] = dict(stage=parallel_state.get_pipeline_model_parallel_rank(),
                             layer_numbers=[layer.layer_number for layer in model.decoder.layers],
                             ckpt_layers=global_idx, stacked=stacked, embedding=model.pre_process,
                             head=model.post_process)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def test_each_pipeline_stage_builds_its_layers():
    layers = [1, 3, 2, 2]  # middle stages differ: not expressible with first/last counts
    results = run_processes(_stage_worker, len(layers), layers, start_method="spawn")
    first = prefix_sums(layers)
    for rank, got in results.items():
        stage = got["stage"]
        expected = list(range(first[stage], first[stage + 1]))
        assert got["layer_numbers"] == [i + 1 for i in expected], (rank, got)  # 1-based in Megatron
        assert got["ckpt_layers"] == expected and got["stacked"] == {sum(layers)}, (rank, got)
        assert (got["embedding"], got["head"]) == (stage == 0, stage == len(layers) - 1)
    assert sorted(r["stage"] for r in results.values()) == list(range(len(layers)))
