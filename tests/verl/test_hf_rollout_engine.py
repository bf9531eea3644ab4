"""The HF rollout engine of the Megatron worker (verl series, workers/rollout/hf_engine.py): a DeepSeek-V3
model built from the config alone reproduces from_pretrained bit-exact once a full set of checkpoint
pairs is loaded; unknown, mis-shaped and missing pairs are refused by name; offload frees the storage and
onload + load restore it."""

from __future__ import annotations

import pytest
import torch

from tests.verl.conftest import require

hf_engine = require("verl.workers.rollout.hf_engine")
transformers = require("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from safetensors.torch import load_file

    from tools.weights.tiny import make_tiny

    path = tmp_path_factory.mktemp("tiny")
    make_tiny(path, tokenizer=False)
    pairs = {}
    for f in sorted(path.glob("*.safetensors")):
        pairs.update(load_file(f))
    config = transformers.AutoConfig.from_pretrained(path)
    return path, config, pairs


def _reference(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.bfloat16, attn_implementation="sdpa"
    ).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_full_sync_reproduces_from_pretrained_bit_exact(tiny):
    path, config, pairs = tiny
    engine = hf_engine.HFRolloutEngine(config, dtype=torch.bfloat16)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in engine.weight_names()  # a buffer, still a weight
    written = engine.load_weights(pairs.items())
    assert written == set(engine.weight_names()) == set(pairs)
    assert engine.last_sync_bytes == sum(t.numel() * t.element_size() for t in pairs.values())
    ref = _reference(path)
    ref_state = ref.state_dict()
    for name in engine.weight_names():
        assert torch.equal(engine.tensor(name), ref_state[name]), name
    ids = torch.randint(2, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(engine.model, ids), _logits(ref, ids))


def test_unknown_misshaped_and_missing_pairs_are_refused_by_name(tiny):
    _, config, pairs = tiny
    engine = hf_engine.HFRolloutEngine(config)
    with pytest.raises(hf_engine.WeightSyncError, match=r"'model.layers.9.mlp.gate.weight'.*does not have"):
        engine.load_weights([*pairs.items(), ("model.layers.9.mlp.gate.weight", torch.zeros(8, 200))])
    bad = dict(pairs)
    bad["model.layers.2.mlp.experts.3.up_proj.weight"] = bad["model.layers.2.mlp.experts.3.up_proj.weight"][:-1]
    with pytest.raises(
        hf_engine.WeightSyncError,
        match=r"'model.layers.2.mlp.experts.3.up_proj.weight' with shape \(71, 200\); .* \(72, 200\)",
    ):
        engine.load_weights(bad.items())
    missing = {k: v for k, v in pairs.items() if k != "model.layers.3.mlp.gate.e_score_correction_bias"}
    with pytest.raises(
        hf_engine.WeightSyncError,
        match=r"1 rollout weight\(s\) unwritten: model.layers.3.mlp.gate.e_score_correction_bias",
    ):
        engine.load_weights(missing.items())
    assert engine.unwritten(engine.load_weights(missing.items(), strict=False)) == [
        "model.layers.3.mlp.gate.e_score_correction_bias"
    ]


def test_offload_frees_storage_and_onload_load_restores(tiny):
    _, config, pairs = tiny
    engine = hf_engine.HFRolloutEngine(config)
    engine.load_weights(pairs.items())
    ids = torch.randint(2, config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    before = _logits(engine.model, ids)
    params = dict(engine.model.named_parameters())  # the Parameter objects survive offload (optimisers, ties)
    engine.offload_weights()
    for name in engine.weight_names():
        t = engine.tensor(name)
        assert t.numel() == 0 and t.untyped_storage().nbytes() == 0, name
    assert all(p is params[n] for n, p in engine.model.named_parameters())
    with pytest.raises(hf_engine.WeightSyncError, match=r"onload_weights not called"):
        engine.load_weights(pairs.items())
    engine.onload_weights()
    engine.load_weights(pairs.items())
    assert torch.equal(_logits(engine.model, ids), before)
    engine.free_kv_cache()
    engine.init_kv_cache()  # no-ops for HF
