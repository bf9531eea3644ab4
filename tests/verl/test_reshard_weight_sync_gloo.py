"""rollout.reshard.tp_pp in verl's weight sync (verl series, reshard/weight_sync.py + the hook in
per_tensor_generator), on gloo with Megatron's parallel state and a fake tiny model: the directed
generator yields the same (name, tensor) pairs as verl's per_tensor_generator, bit-exact, each once;
the settings are checked and a layout without a directed plan is refused or falls back."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests import traffic
from tests.gloo import run_processes
from tests.verl.conftest import owner_of, require
from tests.verl.test_reshard_tp_pp_gloo import full_tensor, global_name, shard, stage_params

weight_sync = require("verl.utils.reshard.weight_sync")
mpu = require("megatron.core.parallel_state")
megatron_utils = require("verl.utils.megatron_utils")

LAYER_NAME_MAPPING = {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1.weight"}


class Converter:
    """Stands in for verl's McoreToHF converters: one HF name per tensor of the group."""

    def convert_param(self, name, params):
        return [f"hf.{name}.{k}" for k in range(len(params))], list(params)


def fake_model(stage: int, layers, dense: int, tp: int, tp_rank: int) -> torch.nn.Module:
    """A module whose named_parameters() are the stage's Megatron names, TP-sharded, with the
    attributes Megatron sets on TP-split parameters."""
    root = torch.nn.Module()
    params, offset = stage_params(stage, layers, dense, tp)
    for name, shape, dtype, dim in params:
        mod, leaf = owner_of(root, name)
        param = torch.nn.Parameter(shard(full_tensor(global_name(name, offset), shape, dtype), dim, tp, tp_rank),
                                   requires_grad=False)
        if dim is not None:
            param.tensor_model_parallel, param.partition_dim = True, dim
        mod.register_parameter(leaf, param)
    return root


def _worker(rank, port, world, tp, pp, layers, dense, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.current_device = lambda: "cpu"  # verl allocates broadcast buffers there
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        stage, tp_rank = mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()
        model = fake_model(stage, layers, dense, tp, tp_rank)
        tf_config = SimpleNamespace(pipeline_model_parallel_size=pp, num_layers=sum(layers),
                                    num_layers_in_first_pipeline_stage=layers[0],
                                    num_layers_in_last_pipeline_stage=layers[-1])
        hf_config = SimpleNamespace(num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
        args = ([model], hf_config, Converter(), tf_config, LAYER_NAME_MAPPING)
        runs = {}
        for mode in ("gather", "directed"):
            cfg = weight_sync.ReshardConfig.from_config({"tp_pp": mode}).resolve(tp, pp, 1)
            with traffic.count_received() as stats:
                pairs = [(n, t.clone()) for n, t in weight_sync.weight_generator(cfg)(*args)]
            runs[mode] = (pairs, stats)
        (want, want_stats), (got, got_stats) = runs["gather"], runs["directed"]
        wanted = dict(want)
        bad = [n for n, t in got if n not in wanted or wanted[n].dtype != t.dtype or wanted[n].shape != t.shape
               or not torch.equal(wanted[n].view(torch.uint8), t.view(torch.uint8))]
        results[rank] = dict(want_names=[n for n, _ in want], got_names=[n for n, _ in got], bad=bad,
                             gather_bytes=want_stats.bytes, directed_bytes=got_stats.bytes,
                             gather_calls=want_stats.total_calls, directed_calls=got_stats.total_calls)
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize("world, tp, pp, layers, dense", [
    (4, 2, 2, [2, 3], 1),
    (8, 2, 4, [1, 2, 2, 3], 2),
])
def test_directed_generator_yields_what_per_tensor_generator_yields(world, tp, pp, layers, dense):
    # spawn, not fork: Megatron's parallel state in a child forked from a process that already ran a
    # process group (tests/megatron does, in this pytest process) can hang in initialize_model_parallel
    results = run_processes(_worker, world, world, tp, pp, layers, dense, start_method="spawn")
    for rank, r in sorted(results.items()):
        assert r["bad"] == [], f"rank {rank}: {r['bad'][:5]} differ from per_tensor_generator"
        assert len(r["got_names"]) == len(set(r["got_names"])), f"rank {rank}: a name is yielded twice"
        assert sorted(r["got_names"]) == sorted(r["want_names"])
        assert r["directed_calls"] < r["gather_calls"]
        assert r["directed_bytes"] <= r["gather_bytes"]


def test_settings_are_checked_naming_the_key():
    assert weight_sync.ReshardConfig.from_config(None) == weight_sync.ReshardConfig("gather", "gather", False)
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.reshard.tp_pp must be one of directed, gather"):
        weight_sync.ReshardConfig.from_config({"tp_pp": "alltoall"})
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.reshard.expert is not a reshard setting"):
        weight_sync.ReshardConfig.from_config({"expert": "directed"})
    with pytest.raises(ValueError, match=r"reshard.fallback must be true or false"):
        weight_sync.ReshardConfig.from_config({"tp_pp": "directed", "fallback": "yes"})


def test_a_layout_without_a_directed_plan_is_refused_or_falls_back():
    directed = weight_sync.ReshardConfig.from_config({"tp_pp": "directed"})
    with pytest.raises(weight_sync.ReshardLayoutError, match=r"train TP4 PP8 VPP2: .*reshard.tp_pp=gather"):
        directed.resolve(4, 8, 2)
    assert directed.resolve(4, 8, 1) is directed
    fallback = weight_sync.ReshardConfig.from_config({"tp_pp": "directed", "fallback": True})
    assert fallback.resolve(4, 8, 2).tp_pp == "gather"
    assert weight_sync.weight_generator(fallback.resolve(4, 8, 2)) is megatron_utils.per_tensor_generator


def test_verl_config_defaults_to_the_gather_path():
    from pathlib import Path

    from omegaconf import OmegaConf

    path = Path(megatron_utils.__file__).parent.parent / "trainer/config/ppo_megatron_trainer.yaml"
    block = OmegaConf.load(path).actor_rollout_ref.rollout.reshard
    assert weight_sync.ReshardConfig.from_config(block) == weight_sync.ReshardConfig()
