"""rollout.reshard.experts=directed in verl's weight sync (verl series, reshard/experts.py + weight_sync.py),
on gloo with Megatron's parallel state (expert parallel, expert TP 1) and a fake tiny MoE model with random
weights: every rank yields exactly the routed experts it serves in rollout, under the names and with the
bytes verl's EP all-gather path gives it, plus every non-expert pair of that path; it receives exactly the
planner's bytes in one all_to_all_single per MoE layer slot. Driven through weight_sync.weight_generator,
i.e. verl's real per_tensor_generator (or the directed TP/PP generator) for the non-expert parameters."""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.gloo import run_processes
from tests.verl.conftest import owner_of, require

weight_sync = require("verl.utils.reshard.weight_sync")
experts = require("verl.utils.reshard.experts")
plan = require("verl.utils.reshard.plan")
mpu = require("megatron.core.parallel_state")
megatron_utils = require("verl.utils.megatron_utils")

LAYER_NAME_MAPPING = {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1.weight"}
HIDDEN, FFN = 4, 3
EXPERT_TENSORS = {"linear_fc1.weight": ((2 * FFN, HIDDEN), torch.bfloat16),
                  "linear_fc2.weight": ((HIDDEN, FFN), torch.float32)}
HF_EXPERT = re.compile(r"\.mlp\.experts\.linear_fc[12]\.weight(\d+)\.\d+$")


class Converter:
    """Stands in for verl's McoreToHF converters: one HF name per tensor of the group."""

    def __init__(self, num_experts):
        self.mcore_config = SimpleNamespace(num_moe_experts=num_experts)

    def convert_param(self, name, params):
        return [f"hf.{name}.{k}" for k in range(len(params))], list(params)


def random_tensor(key: str, shape, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(ord(c) * (i + 1) for i, c in enumerate(key)))
    return torch.randn(shape, generator=gen).to(dtype)


def stage_tensors(stage, layers, moe_from, num_experts, ep, ep_rank, tp, tp_rank):
    """(local name, tensor, TP partition dim or None) of one train rank; layer i (global) is MoE from `moe_from`."""
    offset = sum(layers[:stage])
    out = []
    if stage == 0:
        emb = random_tensor("emb", (8, HIDDEN), torch.float32)
        out.append(("embedding.word_embeddings.weight", emb.chunk(tp, 0)[tp_rank], 0))
    per_rank = num_experts // ep
    for local in range(layers[stage]):
        g, pre = offset + local, f"decoder.layers.{local}"
        out.append((f"{pre}.input_layernorm.weight", random_tensor(f"ln{g}", (HIDDEN,), torch.float32), None))
        proj = random_tensor(f"proj{g}", (HIDDEN, 2 * HIDDEN), torch.bfloat16)
        out.append((f"{pre}.self_attention.linear_proj.weight", proj.chunk(tp, 1)[tp_rank].contiguous(), 1))
        if g < moe_from:
            continue
        router = random_tensor(f"router{g}", (num_experts, HIDDEN), torch.float32)
        out.append((f"{pre}.mlp.router.weight", router, None))
        for kind, (shape, dtype) in EXPERT_TENSORS.items():
            for j in range(per_rank):
                tensor = random_tensor(f"{kind}{g}e{ep_rank * per_rank + j}", shape, dtype)
                out.append((f"{pre}.mlp.experts.{kind}{j}", tensor, None))
    return out


def fake_model(tensors) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, tensor, dim in tensors:
        mod, leaf = owner_of(root, name)
        param = torch.nn.Parameter(tensor, requires_grad=False)
        if dim is not None:
            param.tensor_model_parallel, param.partition_dim = True, dim
        mod.register_parameter(leaf, param)
    return root


class CountAllToAll:
    """Bytes this rank receives from other ranks through all_to_all_single over the default group (the expert
    exchange; the directed TP/PP path runs its all_to_all_single over the pipeline group), and the calls."""

    def __init__(self):
        self.bytes, self.calls, self._original = 0, 0, None

    def __enter__(self):
        self._original = dist.all_to_all_single

        def wrapper(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            if group is None:
                self.calls += 1
                me = dist.get_rank()
                self.bytes += (sum(output_split_sizes) - output_split_sizes[me]) * output.element_size()
            return self._original(output, input, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, **kw)

        dist.all_to_all_single = wrapper
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._original


def planned_bytes(layout, layers, moe_from, rank) -> int:
    """Bytes the planner says `rank` receives: its incoming moves from other ranks, all MoE layers."""
    one = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in EXPERT_TENSORS.values())
    total, offset = 0, 0
    for stage, count in enumerate(layers):
        moe_layers = sum(1 for g in range(offset, offset + count) if g >= moe_from)
        offset += count
        moves = plan.expert_moves(layout.train, layout.rollout, stage, layout.num_experts)
        total += moe_layers * one * sum(1 for m in moves if m.dst == rank and m.src != rank)
    return total


def _worker(rank, port, world, tp, pp, ep, layers, moe_from, num_experts, rollout_dp, rollout_tp, tp_pp, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.current_device = lambda: "cpu"  # verl allocates broadcast buffers there
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                      expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
        stage = mpu.get_pipeline_model_parallel_rank()
        model = fake_model(stage_tensors(stage, layers, moe_from, num_experts, ep, mpu.get_expert_model_parallel_rank(),
                                         tp, mpu.get_tensor_model_parallel_rank()))
        tf_config = SimpleNamespace(pipeline_model_parallel_size=pp, num_layers=sum(layers),
                                    num_layers_in_first_pipeline_stage=layers[0] if pp > 1 else None,
                                    num_layers_in_last_pipeline_stage=layers[-1] if pp > 1 else None,
                                    num_moe_experts=num_experts)
        hf_config = SimpleNamespace(num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
        args = ([model], hf_config, Converter(num_experts), tf_config, LAYER_NAME_MAPPING)
        runs = {}
        for mode in ("gather", "directed"):
            cfg = weight_sync.ReshardConfig.from_config({"tp_pp": tp_pp, "experts": mode})
            layout = experts.expert_layout_for(cfg, tf_config, rollout_dp, rollout_tp, 1)
            cfg = cfg.resolve(tp, pp, 1, layout)
            assert cfg.experts == mode
            with CountAllToAll() as counted:
                pairs = [(n, t.clone()) for n, t in weight_sync.weight_generator(cfg, layout)(*args)]
            runs[mode] = (pairs, counted, layout)
        (want, _, _), (got, counted, layout) = runs["gather"], runs["directed"]
        owned = set(plan.rollout_experts(layout.rollout, rank, num_experts))
        wanted = {n: t for n, t in want if not HF_EXPERT.search(n) or int(HF_EXPERT.search(n)[1]) in owned}
        got_map = dict(got)
        bad = [n for n in wanted if n not in got_map or wanted[n].dtype != got_map[n].dtype
               or wanted[n].shape != got_map[n].shape
               or not torch.equal(wanted[n].view(-1).view(torch.uint8), got_map[n].view(-1).view(torch.uint8))]
        results[rank] = dict(
            bad=bad, got_names=[n for n, _ in got], want_names=sorted(wanted), all_gather_names=len(want),
            got_experts=sorted({int(HF_EXPERT.search(n)[1]) for n, _ in got if HF_EXPERT.search(n)}),
            owned=sorted(owned), received=counted.bytes, calls=counted.calls,
            planned=planned_bytes(layout, layers, moe_from, rank),
            slots=max(sum(1 for g in range(sum(layers[:s]), sum(layers[:s + 1])) if g >= moe_from) for s in range(pp)))
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()


LAYOUTS = [
    # train TP2 EP4 (ETP1; the planner's TP2 EP2 with moe_tp_extend_ep) -> rollout DP2 TP2 (EP4): every
    # rank already holds the experts it serves, so nothing travels (the gather path moves 3/4 of them)
    pytest.param(4, 2, 1, 4, [3], 1, 8, 2, 2, "gather", id="tp2-ep4-pp1-to-dp2tp2"),
    # two expert replicas per stage, uneven MoE layers per stage, two rollout instances, directed TP/PP too
    pytest.param(8, 2, 2, 2, [2, 3], 1, 8, 2, 2, "directed", id="tp2-ep2-pp2-edp2-to-2x-dp2tp2"),
    # rollout EP 4 over train EP 2 per stage: each train rank's experts go to two rollout ranks
    pytest.param(4, 1, 2, 2, [2, 2], 0, 16, 1, 4, "gather", id="tp1-ep2-pp2-to-dp1tp4"),
    # the CPU smoke's layout: experts over the 2 ranks of a stage -> 4 engines of one rank each (EP1), every
    # rollout rank serves every expert, half of them from the other stage rank
    pytest.param(4, 2, 2, 2, [1, 3], 1, 8, 1, 1, "directed", id="tp2-ep2-pp2-to-4x-dp1tp1"),
]


@pytest.mark.parametrize("world, tp, pp, ep, layers, moe_from, num_experts, rollout_dp, rollout_tp, tp_pp", LAYOUTS)
def test_each_rank_gets_the_gather_paths_experts_it_serves(world, tp, pp, ep, layers, moe_from, num_experts,
                                                           rollout_dp, rollout_tp, tp_pp):
    # spawn, not fork: Megatron's parallel state in a child forked from a process that already ran a
    # process group (tests/megatron does, in this pytest process) can hang in initialize_model_parallel
    results = run_processes(_worker, world, world, tp, pp, ep, layers, moe_from, num_experts, rollout_dp, rollout_tp,
                            tp_pp, start_method="spawn")
    for rank, r in sorted(results.items()):
        assert r["bad"] == [], f"rank {rank}: {r['bad'][:5]} missing or differ from the gather path"
        assert len(r["got_names"]) == len(set(r["got_names"])), f"rank {rank}: a name is yielded twice"
        assert sorted(r["got_names"]) == r["want_names"], f"rank {rank}: yields other tensors than its share"
        assert r["got_experts"] == r["owned"]
        # a rank of a one-rank engine (rollout EP1) serves every expert
        assert len(r["want_names"]) < r["all_gather_names"] or rollout_dp * rollout_tp == 1
        assert r["received"] == r["planned"], f"rank {rank}: received {r['received']}, planned {r['planned']}"
        assert r["calls"] == r["slots"], f"rank {rank}: one all_to_all_single per MoE layer slot"
    moved = sum(r["planned"] for r in results.values())
    assert (moved > 0) == (pp > 1 or ep != rollout_dp * rollout_tp)  # identity layouts move nothing


def _layout(train_ep=4, pp=1, world=4, dp=2, tp=2, num_experts=8, etp=1, vpp=1):
    train = plan.TrainLayout(tp=1, pp=pp, ep=train_ep, world=world)
    rollout = plan.RolloutLayout(dp=dp, tp=tp, instances=world // (dp * tp))
    return experts.ExpertLayout(train, rollout, num_experts, etp, vpp)


def test_experts_setting_is_checked_naming_the_key():
    assert weight_sync.ReshardConfig.from_config({"experts": "directed"}).experts == "directed"
    assert weight_sync.ReshardConfig.from_config(None).experts == "gather"
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.reshard.experts must be one of directed, gather"):
        weight_sync.ReshardConfig.from_config({"experts": "alltoall"})


def test_a_layout_without_a_directed_expert_plan_is_refused_or_falls_back():
    directed = weight_sync.ReshardConfig.from_config({"experts": "directed"})
    # rollout EP 6 (DP3 TP2, two instances) against the train EP 4: neither divides the other
    small = _layout(world=12, dp=3, tp=2, num_experts=24)
    with pytest.raises(weight_sync.ReshardLayoutError,
                       match=r"rollout EP 6 and the train ETP group 4: neither divides.*reshard.experts=gather"):
        directed.resolve(2, 1, 1, small)
    with pytest.raises(weight_sync.ReshardLayoutError,
                       match=r"train PP1 EP4 ETP2 VPP1 .*expert tensor parallel 1.*reshard.experts=gather"):
        directed.resolve(2, 1, 1, _layout(etp=2))
    assert directed.resolve(2, 1, 1, _layout()) is directed
    fallback = weight_sync.ReshardConfig.from_config({"experts": "directed", "tp_pp": "directed", "fallback": True})
    resolved = fallback.resolve(2, 1, 1, small)
    assert (resolved.experts, resolved.tp_pp) == ("gather", "directed")
    assert weight_sync.weight_generator(resolved, small) is weight_sync.directed_tp_pp_generator
    # a dense model has no experts to move: verl's path
    assert directed.resolve(2, 1, 1, None).experts == "gather"


def test_verl_config_defaults_to_the_gather_path_for_experts():
    from pathlib import Path

    from omegaconf import OmegaConf

    path = Path(megatron_utils.__file__).parent.parent / "trainer/config/ppo_megatron_trainer.yaml"
    block = OmegaConf.load(path).actor_rollout_ref.rollout.reshard
    assert weight_sync.ReshardConfig.from_config(block).experts == "gather"
    generator = weight_sync.weight_generator(weight_sync.ReshardConfig.from_config(block))
    assert generator is megatron_utils.per_tensor_generator
