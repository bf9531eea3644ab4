"""tools/model/dims.py: DeepSeek-V3's dims from a real config.json (make-tiny's) and from the recipe's model file."""

from __future__ import annotations

import json
import math
from dataclasses import fields

import pytest

from tests.launch.conftest import CONFIGS
from tools.launch import cli, config
from tools.model.dims import Dims, dims_from_config
from tools.model.errors import ConfigError
from tools.weights.hf import hf_tensors, load_config
from tools.weights.tiny import TINY_CONFIG, make_tiny

REQUIRED = [f.metadata["key"] for f in fields(Dims) if "minimum" in f.metadata]


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("tiny")
    make_tiny(directory, tokenizer=False)
    return load_config(directory)


def v3() -> Dims:
    raw, _ = config.model_dims(config.load(CONFIGS / "a3-128-true-weight.yaml"))
    return dims_from_config(raw, "deepseek-v3.yaml")


def test_a_make_tiny_config_json_gives_its_sizes(tiny_config):
    dims = dims_from_config(tiny_config)
    assert (dims.layers, dims.dense_layers, dims.moe_layers) == (4, 1, 3)
    assert (dims.experts, dims.shared_experts, dims.experts_per_token) == (8, 1, 4)
    assert (dims.hidden, dims.intermediate, dims.moe_intermediate, dims.vocab) == (200, 328, 72, 320)
    assert (dims.heads, dims.q_lora_rank, dims.kv_lora_rank, dims.qk_head, dims.v_head) == (4, 96, 64, 32, 24)
    assert dims.max_positions == 163840 and not dims.tie_embeddings
    assert [dims.is_moe(layer) for layer in range(4)] == [False, True, True, True]


def test_the_recipes_tiny_model_file_is_make_tinys_model():
    raw, _ = config.model_dims(config.load(CONFIGS / "cpu-tiny.yaml"))
    assert dims_from_config(raw) == dims_from_config(TINY_CONFIG)


def test_deepseek_v3_from_the_recipes_model_file():
    dims = v3()
    assert (dims.layers, dims.dense_layers, dims.experts, dims.experts_per_token) == (61, 3, 256, 8)
    assert dims.total_params() / 1e9 == pytest.approx(671.0, abs=0.1)  # DeepSeek-V3 without MTP


@pytest.mark.parametrize("name, overrides", [("tiny", {}), ("tiny tied", {"tie_word_embeddings": True}),
                                             ("v3", None)])
def test_parameter_counts_agree_with_the_checkpoints_tensor_list(name, overrides):
    """The memory estimate's per-part counts and the converters' tensor list describe the same model."""
    dims = v3() if overrides is None else dims_from_config({**TINY_CONFIG, **overrides})
    assert dims.total_params() == sum(math.prod(shape) for shape, _ in hf_tensors(dims).values())


@pytest.mark.parametrize("key", REQUIRED)
def test_a_missing_key_is_named(key):
    config_json = {k: v for k, v in TINY_CONFIG.items() if k != key}
    with pytest.raises(ConfigError, match=rf"^somewhere/config.json: `{key}` is missing"):
        dims_from_config(config_json, "somewhere/config.json")


@pytest.mark.parametrize("key, value", [("n_routed_experts", 0), ("num_hidden_layers", True),
                                        ("hidden_size", "200"), ("first_k_dense_replace", -1)])
def test_a_bad_value_is_named(key, value):
    with pytest.raises(ConfigError, match=rf"`{key}` is {value!r}; .* integer >= "):
        dims_from_config({**TINY_CONFIG, key: value})


def test_other_models_and_inconsistent_configs_are_refused():
    with pytest.raises(ConfigError, match="model_type is 'llama', expected 'deepseek_v3'"):
        dims_from_config({**TINY_CONFIG, "model_type": "llama"})
    with pytest.raises(ConfigError, match="first_k_dense_replace 5 > num_hidden_layers 4"):
        dims_from_config({**TINY_CONFIG, "first_k_dense_replace": 5})
    assert dims_from_config({k: v for k, v in TINY_CONFIG.items() if k != "tie_word_embeddings"}).tie_embeddings \
        is False


def test_the_dry_run_names_a_key_missing_from_the_model_file(tmp_path, capsys):
    """The launcher reads dims through the same parser: a model file without a key stops it (exit 2), naming it."""
    dims_file = tmp_path / "dims.json"
    dims_file.write_text(json.dumps({k: v for k, v in TINY_CONFIG.items() if k != "kv_lora_rank"}))
    code = cli.main([str(CONFIGS / "cpu-tiny.yaml"), "--dry-run", f"recipe.model_dims={dims_file}",
                     "--logs", str(tmp_path / "logs")])
    assert code == 2
    assert f"error: {dims_file}: `kv_lora_rank` is missing" in capsys.readouterr().err
