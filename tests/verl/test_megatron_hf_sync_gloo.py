"""rollout.name=hf on the Megatron worker (verl series, sharding_manager/megatron_hf.py): on gloo with Megatron's
parallel state (TP2 x PP2, 4 processes) and a fake Megatron DeepSeek-V3 model sharded from a make_tiny
checkpoint, verl's real McoreToHFWeightConverterDpskv3 and the directed or gather generator fill every weight
of each rank's HFRolloutEngine with the checkpoint's values, and the checksum verification against the
actor's gather-path export finds nothing. A sync broken on purpose (one expert left stale, one TP shard
swapped, the router bias not sent) is reported by name."""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.gloo import run_processes
from tests.verl.conftest import owner_of, require

megatron_hf = require("verl.workers.sharding_manager.megatron_hf")
hf_engine = require("verl.workers.rollout.hf_engine")
mpu = require("megatron.core.parallel_state")
weight_converter = require("verl.models.mcore.weight_converter")

LAYER_NAME_MAPPING = {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1.weight"}
ATTN = {
    "linear_q_down_proj.weight": ("q_a_proj.weight", None),
    "linear_q_up_proj.layer_norm_weight": ("q_a_layernorm.weight", None),
    "linear_q_up_proj.weight": ("q_b_proj.weight", 0),
    "linear_kv_down_proj.weight": ("kv_a_proj_with_mqa.weight", None),
    "linear_kv_up_proj.layer_norm_weight": ("kv_a_layernorm.weight", None),
    "linear_kv_up_proj.weight": ("kv_b_proj.weight", 0),
    "linear_proj.weight": ("o_proj.weight", 1),
}
STALE = "model.layers.2.mlp.experts.5.down_proj.weight"
SWAPPED = "model.layers.1.self_attn.o_proj.weight"
BIAS = "model.layers.3.mlp.gate.e_score_correction_bias"


def _gate_up(gate, up, tp, r):
    return torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]])  # Megatron's fused fc1 shard


def megatron_shards(hf: dict, stage: int, per_stage: int, dense: int, tp: int, r: int):
    """(local Megatron name, tensor, TP partition dim or None, is a buffer) of one train rank, from HF tensors."""

    def split(t, dim):
        return t if dim is None else t.chunk(tp, dim)[r].contiguous()

    out = []
    if stage == 0:
        out.append(("embedding.word_embeddings.weight", split(hf["model.embed_tokens.weight"], 0), 0, False))
    for local in range(per_stage):
        g, pre, h = stage * per_stage + local, f"decoder.layers.{local}", f"model.layers.{stage * per_stage + local}"
        out.append((f"{pre}.input_layernorm.weight", hf[f"{h}.input_layernorm.weight"], None, False))
        for mc, (name, dim) in ATTN.items():
            out.append((f"{pre}.self_attention.{mc}", split(hf[f"{h}.self_attn.{name}"], dim), dim, False))
        if g < dense:
            out += [
                (f"{pre}.mlp.linear_fc1.layer_norm_weight", hf[f"{h}.post_attention_layernorm.weight"], None, False),
                (
                    f"{pre}.mlp.linear_fc1.weight",
                    _gate_up(hf[f"{h}.mlp.gate_proj.weight"], hf[f"{h}.mlp.up_proj.weight"], tp, r),
                    0,
                    False,
                ),
                (f"{pre}.mlp.linear_fc2.weight", split(hf[f"{h}.mlp.down_proj.weight"], 1), 1, False),
            ]
            continue
        out += [
            (f"{pre}.pre_mlp_layernorm.weight", hf[f"{h}.post_attention_layernorm.weight"], None, False),
            (f"{pre}.mlp.router.weight", hf[f"{h}.mlp.gate.weight"], None, False),
        ]
        e = 0
        while f"{h}.mlp.experts.{e}.gate_proj.weight" in hf:
            x = f"{h}.mlp.experts.{e}"
            out += [
                (
                    f"{pre}.mlp.experts.linear_fc1.weight{e}",
                    _gate_up(hf[f"{x}.gate_proj.weight"], hf[f"{x}.up_proj.weight"], tp, r),
                    0,
                    False,
                ),
                (f"{pre}.mlp.experts.linear_fc2.weight{e}", split(hf[f"{x}.down_proj.weight"], 1), 1, False),
            ]
            e += 1
        s = f"{h}.mlp.shared_experts"
        out += [
            (
                f"{pre}.mlp.shared_experts.linear_fc1.weight",
                _gate_up(hf[f"{s}.gate_proj.weight"], hf[f"{s}.up_proj.weight"], tp, r),
                0,
                False,
            ),
            (f"{pre}.mlp.shared_experts.linear_fc2.weight", split(hf[f"{s}.down_proj.weight"], 1), 1, False),
            (f"{pre}.mlp.router.expert_bias", hf[f"{h}.mlp.gate.e_score_correction_bias"], None, True),
        ]  # state_dict only, as in mcore
    if stage == 1:
        out += [
            ("decoder.final_layernorm.weight", hf["model.norm.weight"], None, False),
            ("output_layer.weight", split(hf["lm_head.weight"], 0), 0, False),
        ]
    return out


def fake_model(shards) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, tensor, dim, buffer in shards:
        mod, leaf = owner_of(root, name)
        if buffer:
            mod.register_buffer(leaf, tensor.clone())
            continue
        param = torch.nn.Parameter(tensor.clone(), requires_grad=False)
        if dim is not None:
            param.tensor_model_parallel, param.partition_dim = True, dim
        mod.register_parameter(leaf, param)
    return root


def _sync(manager):
    with manager:
        pass  # __enter__ syncs (and verifies), __exit__ offloads the engine
    return list(manager.last_mismatches)


def _worker(rank, port, path, tp_pp, results):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.current_device = lambda: "cpu"  # verl allocates broadcast buffers there
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        hf = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                hf.update(load_file(os.path.join(path, f)))
        config = AutoConfig.from_pretrained(path)
        stage, tp_rank = mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()
        model = fake_model(megatron_shards(hf, stage, 2, config.first_k_dense_replace, 2, tp_rank))
        tf_config = SimpleNamespace(
            pipeline_model_parallel_size=2,
            num_layers=4,
            num_layers_in_first_pipeline_stage=2,
            num_layers_in_last_pipeline_stage=2,
            num_moe_experts=config.n_routed_experts,
        )
        converter = weight_converter.McoreToHFWeightConverterDpskv3(
            config, SimpleNamespace(num_moe_experts=config.n_routed_experts)
        )
        engine = hf_engine.HFRolloutEngine(config, dtype=torch.bfloat16)
        manager = megatron_hf.MegatronHFShardingManager(
            [model], engine, config, tf_config, LAYER_NAME_MAPPING, converter, reshard={"tp_pp": tp_pp}, verify=True
        )
        out = {"parked_empty": all(engine.tensor(n).numel() == 0 for n in engine.weight_names())}

        # a sound sync: every engine weight written with the checkpoint's value, nothing reported
        manager.lifecycle.enter_rollout(manager.weights)
        out["good"] = list(manager.last_mismatches)
        out["differ"] = [
            n for n in engine.weight_names() if not torch.equal(engine.tensor(n), hf[n].to(engine.tensor(n).dtype))
        ]
        out["bytes"] = manager.engine.last_sync_bytes
        out["want_bytes"] = sum(t.numel() * t.element_size() for t in hf.values())
        out["metrics"] = dict(manager.metrics)  # __enter__ sets the byte metrics; checked below through a with block
        stale = engine.tensor(STALE).clone()
        manager.lifecycle.exit_rollout()
        out["offloaded"] = all(engine.tensor(n).numel() == 0 for n in engine.weight_names())
        _sync(manager)
        out["with_metrics"] = dict(manager.metrics)

        # the actor trains on: every parameter moves, so a tensor not re-sent is stale
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.25)
        good = manager.weight_generator

        def broken(fix):
            manager.weight_generator = lambda *args: (fix(n, t) for n, t in good(*args) if fix(n, t) is not None)

        broken(lambda n, t: (n, stale) if n == STALE else (n, t))
        out["stale"] = _sync(manager)
        broken(lambda n, t: (n, torch.cat(t.chunk(2, 1)[::-1], 1)) if n == SWAPPED else (n, t))
        out["swapped"] = _sync(manager)
        broken(lambda n, t: None if n == BIAS else (n, t))
        try:
            _sync(manager)
        except hf_engine.WeightSyncError as exc:
            out["strict"] = str(exc)
            manager.lifecycle.state = "parked"
        engine.load_weights = functools.partial(type(engine).load_weights, engine, strict=False)  # let the check see it
        out["unsent"] = _sync(manager)
        results[rank] = out
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tools.weights.tiny import make_tiny

    path = tmp_path_factory.mktemp("tiny")
    make_tiny(path, tokenizer=False)
    return str(path)


@pytest.mark.parametrize("tp_pp", ["directed", "gather"])
def test_megatron_to_hf_sync_fills_every_weight_and_catches_a_broken_one(tiny, tp_pp):
    # spawn, not fork: Megatron's parallel state in a child forked from a process that already ran a
    # process group (tests/megatron does, in this pytest process) can hang in initialize_model_parallel
    results = run_processes(_worker, 4, tiny, tp_pp)
    for rank, r in sorted(results.items()):
        assert r["parked_empty"] and r["offloaded"], rank
        assert r["good"] == [] and r["differ"] == [], (rank, r["good"][:5], r["differ"][:5])
        assert r["bytes"] == r["want_bytes"], rank
        assert r["with_metrics"]["rollout/weight_sync_bytes"] == r["want_bytes"]
        assert r["with_metrics"]["rollout/weight_sync_mismatches"] == 0
        assert r["with_metrics"]["rollout/weight_sync_checked"] == r["with_metrics"]["rollout/weight_sync_tensors"]
        assert r["stale"] == [STALE], rank
        assert r["swapped"] == [SWAPPED], rank
        assert BIAS in r["strict"] and "unwritten" in r["strict"], rank
        assert r["unsent"] == [BIAS], rank


def test_rollout_data_parallel_is_refused():
    with pytest.raises(ValueError, match=r"rollout.data_parallel_size=2 with rollout.name=hf"):
        megatron_hf.MegatronHFShardingManager([], None, None, None, LAYER_NAME_MAPPING, None, rollout_dp=2)


def test_checksum_sees_moved_blocks():
    t = torch.randn(4, 6)
    assert megatron_hf.tensor_checksum(t) == megatron_hf.tensor_checksum(t.clone())
    assert megatron_hf.tensor_checksum(t) != megatron_hf.tensor_checksum(torch.cat(t.chunk(2, 1)[::-1], 1))
    assert megatron_hf.tensor_checksum(t) != megatron_hf.tensor_checksum(t.to(torch.bfloat16))


def test_the_worker_hook_builds_a_parked_hf_rollout(tiny):
    from omegaconf import OmegaConf
    from transformers import AutoConfig
    from verl.workers.rollout.hf_rollout import HFRollout

    from tests.gloo import single_rank_model_parallel

    config = OmegaConf.load(
        os.path.join(os.path.dirname(megatron_hf.__file__), "../../trainer/config/ppo_megatron_trainer.yaml")
    )
    config.actor_rollout_ref.rollout.name = "hf"
    hf_config = AutoConfig.from_pretrained(tiny)
    tf_config = SimpleNamespace(pipeline_model_parallel_size=1, num_layers=4, num_moe_experts=8)
    with single_rank_model_parallel():
        rollout, manager = megatron_hf.build_hf_rollout(
            config.actor_rollout_ref.rollout,
            hf_config,
            tf_config,
            [torch.nn.Module()],
            LAYER_NAME_MAPPING,
            None,
            offload_params=False,
        )
    assert isinstance(rollout, HFRollout) and rollout.module is manager.engine.model
    assert manager.lifecycle.state == "parked" and not manager.verify
    assert (
        manager.engine.tensor("lm_head.weight").numel() == 0
        and manager.engine.tensor("lm_head.weight").dtype == torch.bfloat16
    )
