"""The directed weight sync into vLLM's own DeepSeek model (verl series: the worker's generator from
reshard/weight_sync.py's weight_generator_for, the manual lifecycle's RolloutLifecycle over VLLMManualEngine in
rollout/rollout_lifecycle.py; vllm series: the CPU engine). Four gloo processes hold a fake Megatron DeepSeek-V3 at
TP2 x PP2 sharded from a make_tiny checkpoint, and each builds vLLM 0.11's V1 CPU engine as verl's SPMD rollout
does (external launcher): two instances of DP2 x TP1 with expert parallel, so each rank serves 4 of the 8 routed
experts. The directed TP/PP and expert generators feed `DeepseekV2ForCausalLM.load_weights` on every rank in the
calls the worker's rollout_mode / trainer_mode make (resume weights, update_weights, resume kv_cache, release),
the fresh buffers of the resume filled with NaN first.

Checked against the checkpoint itself, by an independent name mapping: every vLLM parameter is written and equals
its HF tensor (fused gate/up, w13/w2 expert stacks, the router bias included), and each local expert slot holds the
global expert that vLLM's expert_map puts there. The same run then breaks the plan's ownership assumption on
purpose (sender and receiver agree, vLLM's expert_map does not) and the check must see the unwritten slots."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.gloo import free_ports, run_processes
from tests.verl.conftest import require
from tests.verl.test_megatron_hf_sync_gloo import LAYER_NAME_MAPPING, fake_model, megatron_shards
from tests.vllm_cpu import vllm_cpu_env

require("vllm.v1.worker.cpu_worker")
mpu = require("megatron.core.parallel_state")
weight_converter = require("verl.models.mcore.weight_converter")
weight_sync = require("verl.utils.reshard.weight_sync")
rollout_lifecycle = require("verl.workers.rollout.rollout_lifecycle")
plan = require("verl.utils.reshard.plan")
experts = require("verl.utils.reshard.experts")
dp_groups = require("verl.workers.rollout.vllm_rollout.dp_groups")

HF_ATTN = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


def expected(name: str, hf: dict, expert_maps: dict) -> torch.Tensor:
    """The checkpoint's value for one vLLM parameter; KeyError for a name this mapping does not know."""
    if name in hf:  # embeddings, norms, attention (MHA on CPU: the HF names), router weight and bias
        return hf[name]
    layer, _, leaf = name.rpartition(".mlp.")
    if leaf in ("gate_up_proj.weight", "shared_experts.gate_up_proj.weight"):
        base = f"{layer}.mlp.{leaf.replace('gate_up_proj.weight', '')}"
        return torch.cat([hf[f"{base}gate_proj.weight"], hf[f"{base}up_proj.weight"]])
    if leaf == "shared_experts.down_proj.weight":
        return hf[f"{layer}.mlp.shared_experts.down_proj.weight"]
    if leaf in ("experts.w13_weight", "experts.w2_weight"):
        expert_map = expert_maps[layer]
        slots = []
        for local in range(int((expert_map >= 0).sum())):
            e = f"{layer}.mlp.experts.{int((expert_map == local).nonzero())}"
            slots.append(torch.cat([hf[f"{e}.gate_proj.weight"], hf[f"{e}.up_proj.weight"]])
                         if leaf == "experts.w13_weight" else hf[f"{e}.down_proj.weight"])
        return torch.stack(slots)
    raise KeyError(name)


def train_shards(hf: dict, stage: int, dense: int, tp_rank: int) -> list:
    """One rank of TP2 x PP2 with the experts over TP (moe_tp_extend_ep: EP2, expert TP1): the shards of the HF
    sync test, but each rank's routed experts whole, experts 4r..4r+3 as local 0..3 (Megatron's EP placement)."""
    out = [s for s in megatron_shards(hf, stage, 2, dense, 2, tp_rank) if ".mlp.experts.linear_fc" not in s[0]]
    for local_layer in range(2):
        layer = stage * 2 + local_layer
        if layer < dense:
            continue
        for local in range(4):
            e = f"model.layers.{layer}.mlp.experts.{4 * tp_rank + local}"
            pre = f"decoder.layers.{local_layer}.mlp.experts"
            fc1 = torch.cat([hf[f"{e}.gate_proj.weight"], hf[f"{e}.up_proj.weight"]])
            out += [(f"{pre}.linear_fc1.weight{local}", fc1, None, False),
                    (f"{pre}.linear_fc2.weight{local}", hf[f"{e}.down_proj.weight"], None, False)]
    return out


def check_model(model, hf: dict) -> dict:
    expert_maps = {name.rpartition(".mlp.")[0]: m.expert_map for name, m in model.named_modules()
                   if name.endswith("mlp.experts")}
    unknown, unwritten, differ = [], [], []
    for name, param in model.named_parameters():
        try:
            want = expected(name, hf, expert_maps).to(param.dtype)
        except KeyError:
            unknown.append(name)
            continue
        if torch.isnan(param.float()).any():
            unwritten.append(name)
        elif param.shape != want.shape or not torch.equal(param.data, want):
            differ.append(name)
    owned = {layer: sorted((m >= 0).nonzero().flatten().tolist()) for layer, m in expert_maps.items()}
    return {"unknown": unknown, "unwritten": unwritten, "differ": differ, "owned": owned,
            "params": sum(1 for _ in model.parameters())}


def _load(lifecycle, generator, args, hf) -> dict:
    """One sync in the calls of the worker's rollout_mode, checked before trainer_mode's release."""
    lifecycle.resume(["weights"])
    with torch.no_grad():
        for p in lifecycle.engine.model.parameters():
            p.fill_(float("nan"))  # what a missed parameter keeps
    lifecycle.update_weights(generator(*args))
    out = check_model(lifecycle.engine.model, hf)
    lifecycle.resume(["kv_cache"])
    lifecycle.release()
    return out


def _reversed_ownership(monkeypatch_targets):
    """Rollout EP rank r takes the experts vLLM gives rank ep-1-r: the sender's and receiver's plan agree."""

    def owners(rollout, expert, num_experts):
        per_rank = num_experts // rollout.ep
        return [i * rollout.ep + rollout.ep - 1 - expert // per_rank for i in range(rollout.instances)]

    def owned(rollout, rank, num_experts):
        per_rank = num_experts // rollout.ep
        local = rollout.ep - 1 - rank % rollout.ep
        return list(range(local * per_rank, (local + 1) * per_rank))

    plan_module, experts_module = monkeypatch_targets
    plan_module.rollout_owners = owners
    experts_module.rollout_experts = owned


def _worker(rank, port, path, dp_port, results):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="4", **vllm_cpu_env(4))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                      expert_model_parallel_size=2, expert_tensor_parallel_size=1)
        hf = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                hf.update(load_file(os.path.join(path, f)))
        config = AutoConfig.from_pretrained(path)
        stage, tp_rank = mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()
        model = fake_model(train_shards(hf, stage, config.first_k_dense_replace, tp_rank))
        tf_config = SimpleNamespace(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=None,
                                    num_layers=4, num_layers_in_first_pipeline_stage=2,
                                    num_layers_in_last_pipeline_stage=2, num_moe_experts=config.n_routed_experts)
        converter = weight_converter.McoreToHFWeightConverterDpskv3(
            config, SimpleNamespace(num_moe_experts=config.n_routed_experts))
        # what the worker's init_model picks for these settings (rollout instances of DP2 x TP1)
        generator = weight_sync.weight_generator_for({"tp_pp": "directed", "experts": "directed"}, [model],
                                                     transformer_config=tf_config, rollout_dp=2, rollout_tp=1)
        args = ([model], config, converter, tf_config, LAYER_NAME_MAPPING)

        from verl.workers.rollout.vllm_rollout.dp_groups import dp_env
        from vllm import LLM

        os.environ.update(dp_env(rank, ["127.0.0.1"] * 4, tp=1, dp=2, base_port=dp_port))
        llm = LLM(model=path, load_format="dummy", dtype="bfloat16", distributed_executor_backend="external_launcher",
                  tensor_parallel_size=1, enable_expert_parallel=True, enforce_eager=True, max_model_len=64,
                  max_num_seqs=4, max_num_batched_tokens=64, seed=0, enable_prefix_caching=False)
        lifecycle = rollout_lifecycle.manual_lifecycle(llm, "manual")  # vLLMRollout.__init__'s hook
        lifecycle.release()  # the worker's trainer_mode right after the build
        engine = lifecycle.engine
        out = {"paths": weight_sync.reshard_of(generator), "good": _load(lifecycle, generator, args, hf),
               "sent": engine.last_sync_tensors, "hf_tensors": len(hf)}
        _reversed_ownership((plan, experts))
        out["wrong_owner"] = _load(lifecycle, generator, args, hf)
        results[rank] = out
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tools.weights.tiny import make_tiny

    path = tmp_path_factory.mktemp("tiny")
    make_tiny(path)
    return str(path)


@pytest.mark.slow
def test_directed_sync_writes_every_vllm_parameter_with_the_checkpoint_and_experts_where_vllm_maps_them(tiny):
    dp_port = free_ports(2 * dp_groups.PORT_STRIDE)  # two DP groups (one per rollout instance)
    results = run_processes(_worker, 4, tiny, dp_port)
    for rank, r in sorted(results.items()):
        assert r["paths"] == weight_sync.ReshardConfig(tp_pp="directed", experts="directed"), rank  # no fallback
        good = r["good"]
        assert good["params"] > 30 and good["unknown"] == [], (rank, good["unknown"])
        assert good["unwritten"] == [] and good["differ"] == [], (rank, good["unwritten"], good["differ"])
        # vLLM's contiguous placement: DP rank 0 of each instance serves experts 0-3, DP rank 1 experts 4-7
        want = list(range(4)) if rank % 2 == 0 else list(range(4, 8))
        assert good["owned"] and all(o == want for o in good["owned"].values()), (rank, good["owned"])
        # only this rank's 4 experts were sent to it: 3 MoE layers x 4 experts x 3 tensors fewer than the checkpoint
        assert r["sent"] == r["hf_tensors"] - 3 * 4 * 3, rank
        broken = r["wrong_owner"]
        expert_params = {f"model.layers.{i}.mlp.experts.{w}" for i in (1, 2, 3) for w in ("w13_weight", "w2_weight")}
        assert set(broken["unwritten"]) == expert_params, (rank, broken["unwritten"])
        assert broken["differ"] == [], rank
