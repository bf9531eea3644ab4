"""tools/model/parallel.py: one parallel layout for the launcher's config blocks and the converters' flags."""

from __future__ import annotations

import pytest

from tests.launch.conftest import CONFIGS, LEGACY_LAYOUT
from tools.launch import config, inputs
from tools.model.dims import dims_from_config
from tools.model.errors import ConfigError
from tools.model.parallel import ParallelLayout, checked
from tools.weights.tiny import TINY_CONFIG

A3 = ParallelLayout(tp=4, pp=8, ep=8, extend_ep=True, layer_list=(7, 7, 8, 8, 8, 8, 8, 7))


def a3_run():
    recipe = config.load(CONFIGS / "a3-128-true-weight.yaml")
    return recipe.layout, dims_from_config(config.model_dims(recipe)[0])


def test_the_launcher_reads_one_layout_per_megatron_block():
    lay, _ = a3_run()
    assert lay.train == A3 and lay.ref == A3
    assert lay.dp == 256 // (4 * 8)


def test_stages_follow_the_layer_list_or_split_evenly():
    assert A3.stages(61)[1] == range(7, 14) and A3.stages(61)[-1] == range(54, 61)
    assert ParallelLayout(pp=4).stage_sizes(8) == (2, 2, 2, 2)
    assert ParallelLayout(pp=4).stage_sizes(10) == (3, 3, 2, 2)  # what the memory estimate assumes; checked refuses


def test_expert_facts_with_and_without_extend_ep():
    _, v3 = a3_run()
    assert (A3.expert_group, A3.expert_tp, A3.experts_per_rank(v3)) == (32, 1, 8)
    plain = ParallelLayout(tp=4, pp=8, ep=8)
    assert (plain.expert_group, plain.expert_tp, plain.experts_per_rank(v3)) == (8, 4, 32)
    assert ParallelLayout(tp=4, ep=8, etp=2).expert_tp == 2


def test_the_recipes_layout_is_one_hf_to_mcore_can_write_and_the_launcher_checks():
    """checked (hf-to-mcore's validation) takes the A3 layout; its manifest record is what the launcher compares."""
    lay, v3 = a3_run()
    legacy_layout = checked(v3, lay.train)
    assert legacy_layout == A3
    assert legacy_layout.to_manifest() == LEGACY_LAYOUT
    assert ParallelLayout.from_manifest(LEGACY_LAYOUT) == A3
    manifest = {"header": {"format": "legacy", "layout": legacy_layout.to_manifest()},
                "files": {inputs.LATEST: "0" * 64}}
    assert inputs.checkpoint_problems(manifest, lay) == []
    without_extend = checked(v3, ParallelLayout(tp=4, pp=8, ep=8, layer_list=A3.layer_list))
    other = {**manifest, "header": {"format": "legacy", "layout": without_extend.to_manifest()}}
    assert inputs.checkpoint_problems(other, lay) == ["tp_extend_ep is False, the config needs True"]


def test_checked_fills_in_an_even_layer_list():
    tiny = dims_from_config(TINY_CONFIG)
    assert checked(tiny, ParallelLayout(pp=2)).layer_list == (2, 2)


@pytest.mark.parametrize("bad, message", [
    (ParallelLayout(tp=0), "--tp is 0; it must be at least 1"),
    (ParallelLayout(pp=3), "num_hidden_layers 4 is not divisible by --pp 3; pass --num-layer-list"),
    (ParallelLayout(pp=2, layer_list=(1, 2)), "--num-layer-list 1,2 must have --pp 2 positive entries"),
    (ParallelLayout(tp=8), "num_attention_heads 4 is not divisible by --tp = 8"),
    (ParallelLayout(tp=2, ep=8, extend_ep=True), r"n_routed_experts 8 is not divisible by --ep \* --tp"),
    (ParallelLayout(tp=2, etp=1), "expert_tensor_parallel_size is 1"),
])
def test_checked_names_the_setting(bad, message):
    with pytest.raises(ConfigError, match=message):
        checked(dims_from_config(TINY_CONFIG), bad)
