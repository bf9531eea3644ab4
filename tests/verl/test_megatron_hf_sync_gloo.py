"""rollout.name=hf on the Megatron worker (verl series: rollout/hf_engine_rollout.py, fed by the worker's weight
generator, reshard/weight_sync.py, and checked by rollout/sync_report.py): on gloo with Megatron's parallel state
(TP2 x PP2, 4 processes) and a fake Megatron DeepSeek-V3 model sharded from a make_tiny checkpoint, the real
ActorRolloutRefWorker builds its HFEngineRollout through verl's registry, and its rollout_mode, with verl's real
McoreToHFWeightConverterDpskv3 and the directed or gather generator, fills every weight of each rank's
HFRolloutEngine with the checkpoint's values; verify_weight_sync's check against the actor's gather-path export
finds nothing. A sync broken on purpose (one expert left stale, one TP shard swapped, the router bias not sent)
is reported by name.

Left to the fork's tests: the refusal of rollout.data_parallel_size>1 with rollout.name=hf
(tests/workers/rollout/test_hf_engine_rollout.py::test_layouts_the_hf_rollout_cannot_serve_are_refused_naming_the_key),
and the worker's build of a parked HF rollout on one rank
(tests/workers/test_megatron_hf_rollout.py::test_the_worker_builds_the_hf_rollout_and_feeds_it_every_step); the
build here checks the trainer's defaults on top (bf16 weights, verify_weight_sync off)."""

from __future__ import annotations

import asyncio
import functools
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.gloo import run_processes
from tests.verl.conftest import owner_of, require

megatron_workers = require("verl.workers.megatron_workers")
hf_engine = require("verl.workers.rollout.hf_engine")
require("verl.workers.rollout.hf_engine_rollout")  # what rollout.name=hf builds (registered as ("hf", "sync"))
sync_report = require("verl.workers.rollout.sync_report")
weight_sync = require("verl.utils.reshard.weight_sync")
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


def hf_worker(path: str, model, hf_config, tf_config, converter, tp_pp: str):
    """The real ActorRolloutRefWorker without its Megatron build (the fake model stands in for the actor's): the
    HF rollout from its own _build_rollout, then what init_model sets for the sync, with verify_weight_sync on."""
    from omegaconf import OmegaConf

    verl_dir = Path(megatron_workers.__file__).parents[1]
    config = OmegaConf.load(verl_dir / "trainer/config/_generated_ppo_megatron_trainer.yaml").actor_rollout_ref
    config.rollout.update(name="hf", tensor_model_parallel_size=1)
    config.model.update(path=path, load_tokenizer=False)
    worker = megatron_workers.ActorRolloutRefWorker.__new__(megatron_workers.ActorRolloutRefWorker)
    worker._Worker__dispatch_dp_rank, worker._Worker__collect_dp_rank = {}, {}
    worker._world_size, worker._rank = dist.get_world_size(), dist.get_rank()
    worker._is_actor, worker._is_rollout, worker._is_offload_param = True, True, False
    worker.config, worker.bridge, worker.actor = config, None, SimpleNamespace(actor_module=[model])
    worker.actor_model_config, worker.weight_converter, worker.tf_config = hf_config, converter, tf_config
    worker.layer_name_mapping = LAYER_NAME_MAPPING
    worker._build_rollout()  # ends in trainer_mode: the engine's weights are released until the first rollout
    worker.weight_generator = weight_sync.weight_generator_for({"tp_pp": tp_pp}, [model], transformer_config=tf_config)
    reshard = weight_sync.reshard_of(worker.weight_generator)
    worker.sync_report = sync_report.SyncReport(worker.rollout, reshard, export=worker._gather_export, verify=True)
    return worker


def train(model) -> None:
    """The actor's step: every parameter moves, and so does the router's expert bias (Megatron updates it each
    step), so a tensor not re-sent is stale, also where the onload's fresh buffer may get the last sync's memory."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.add_(0.25)


def _sync(worker) -> list[str]:
    """One rollout_mode / trainer_mode pair, as verl's sync rollout makes them; what the check named."""
    asyncio.run(worker.rollout_mode())
    asyncio.run(worker.trainer_mode())
    return list(worker.sync_report.last_mismatches)


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
            virtual_pipeline_model_parallel_size=None,
            num_layers=4,
            num_layers_in_first_pipeline_stage=2,
            num_layers_in_last_pipeline_stage=2,
            num_moe_experts=config.n_routed_experts,
        )
        converter = weight_converter.McoreToHFWeightConverterDpskv3(
            config, SimpleNamespace(num_moe_experts=config.n_routed_experts)
        )
        worker = hf_worker(path, model, config, tf_config, converter, tp_pp)
        rollout, report = worker.rollout, worker.sync_report
        engine = rollout.engine
        out = {
            "built": type(rollout).__name__,
            "defaults": (worker.config.rollout.verify_weight_sync, engine.tensor("lm_head.weight").dtype),
            "parked_empty": all(engine.tensor(n).numel() == 0 for n in engine.weight_names()),
        }

        # a sound sync: every engine weight written with the checkpoint's value, nothing reported
        asyncio.run(worker.rollout_mode())
        out["good"] = list(report.last_mismatches)
        out["differ"] = [
            n for n in engine.weight_names() if not torch.equal(engine.tensor(n), hf[n].to(engine.tensor(n).dtype))
        ]
        out["bytes"] = engine.last_sync_bytes
        out["want_bytes"] = sum(t.numel() * t.element_size() for t in hf.values())
        out["metrics"] = report.step_metrics()  # what update_actor reports with the step
        stale = engine.tensor(STALE).clone()
        asyncio.run(worker.trainer_mode())
        out["offloaded"] = all(engine.tensor(n).numel() == 0 for n in engine.weight_names())

        good = worker.weight_generator

        def broken(fix):
            train(model)
            worker.weight_generator = lambda *args: (fix(n, t) for n, t in good(*args) if fix(n, t) is not None)

        broken(lambda n, t: (n, stale) if n == STALE else (n, t))
        out["stale"] = _sync(worker)
        broken(lambda n, t: (n, torch.cat(t.chunk(2, 1)[::-1], 1)) if n == SWAPPED else (n, t))
        out["swapped"] = _sync(worker)

        def no_bias(n, t):
            return None if n == BIAS else (n, t)

        broken(no_bias)
        try:
            _sync(worker)
        except hf_engine.WeightSyncError as exc:
            out["strict"] = str(exc)
            rollout.lifecycle.state = "parked"  # the refused load stopped rollout_mode before the KV cache step
        engine.load_weights = functools.partial(type(engine).load_weights, engine, strict=False)  # let the check see it
        broken(no_bias)  # the next step's sync, the bias left out again
        out["unsent"] = _sync(worker)
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


@pytest.fixture(scope="module", params=["directed", "gather"])
def synced(request, tiny):
    # spawn, not fork: Megatron's parallel state in a child forked from a process that already ran a
    # process group (tests/megatron does, in this pytest process) can hang in initialize_model_parallel
    return request.param, run_processes(_worker, 4, tiny, request.param)


def test_megatron_to_hf_sync_fills_every_weight_and_catches_a_broken_one(synced):
    tp_pp, results = synced
    for rank, r in sorted(results.items()):
        assert r["built"] == "HFEngineRollout" and r["defaults"] == (False, torch.bfloat16), (rank, r["defaults"])
        assert r["parked_empty"] and r["offloaded"], rank
        assert r["good"] == [] and r["differ"] == [], (rank, r["good"][:5], r["differ"][:5])
        assert r["bytes"] == r["want_bytes"], rank
        assert r["metrics"]["rollout/weight_sync_bytes"] == r["want_bytes"]
        assert r["metrics"]["rollout/weight_sync_mismatches"] == 0
        assert r["metrics"]["rollout/weight_sync_checked"] == r["metrics"]["rollout/weight_sync_tensors"]
        assert r["metrics"]["rollout/weight_sync_directed_tp_pp"] == float(tp_pp == "directed")
        assert r["stale"] == [STALE], rank
        assert r["swapped"] == [SWAPPED], rank
        assert BIAS in r["strict"] and "unwritten" in r["strict"], rank


def test_the_check_names_the_router_bias_a_lenient_sync_left_out(synced):
    _, results = synced
    for rank, r in sorted(results.items()):
        assert r["unsent"] == [BIAS], rank


def test_checksum_sees_a_dtype_change():
    # equal copies and moved blocks: the fork's tests/workers/rollout/test_sync_report.py
    # ::test_checksum_is_of_the_raw_bytes_and_sees_a_swapped_block
    t = torch.randn(4, 6)
    assert sync_report.tensor_checksum(t) != sync_report.tensor_checksum(t.to(torch.bfloat16))
