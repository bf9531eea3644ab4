"""The measuring harness of benchmarks/reshard_tp_pp.py: the directed TP-split weight path (verl series,
reshard/tp_pp.py + tp_pp_exchange.py) against verl's broadcast + all-gather path, on gloo. Its correctness
tests live in the verl fork (tests/utils/reshard/test_tp_pp.py).

A fake Megatron-like model with the DeepSeek-V3 shape of things (dense first layers, MoE layers with
router, shared and routed experts, embedding on the first stage, final norm and output layer on the
last, fp32 norms next to bf16 weights), laid out TP x PP in Megatron's rank order with an uneven layer
list. Every rank must end with exactly the full tensors of the broadcast-over-PP + all-gather-in-TP
path, bit-exact; the bytes each rank receives are measured for both paths on the collectives.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from verl.utils.reshard import tp_pp
from verl.utils.reshard import tp_pp_exchange as exchange

from tests import traffic

HIDDEN, FFN, VOCAB, EXPERTS = 8, 12, 16, 4


def layer_params(local: int, dense: bool, tp: int) -> list[tuple[str, tuple, torch.dtype, int | None]]:
    """(local name, full shape, dtype, TP partition dim or None) of one decoder layer."""
    p = f"decoder.layers.{local}."
    params = [(p + "input_layernorm.weight", (HIDDEN,), torch.float32, None),
              (p + "self_attention.linear_qkv.weight", (3 * HIDDEN, HIDDEN), torch.bfloat16, 0),
              (p + "self_attention.linear_proj.weight", (HIDDEN, HIDDEN), torch.bfloat16, 1),
              (p + "pre_mlp_layernorm.weight", (HIDDEN,), torch.float32, None)]
    if dense:
        params += [(p + "mlp.linear_fc1.weight", (2 * FFN, HIDDEN), torch.bfloat16, 0),
                   (p + "mlp.linear_fc2.weight", (HIDDEN, FFN), torch.bfloat16, 1)]
    else:
        params += [(p + "mlp.router.weight", (EXPERTS, HIDDEN), torch.float32, None),
                   (p + "mlp.shared_experts.linear_fc1.weight", (2 * FFN, HIDDEN), torch.bfloat16, 0),
                   (p + "mlp.shared_experts.linear_fc2.weight", (HIDDEN, FFN), torch.bfloat16, 1),
                   (p + "mlp.experts.linear_fc1.weight0", (2 * FFN, HIDDEN), torch.bfloat16, None)]
    return params


def stage_params(stage: int, layers: list[int], dense: int, tp: int):
    """Parameters of one stage in named_parameters() order, with their global layer offset."""
    offset = sum(layers[:stage])
    params = [("embedding.word_embeddings.weight", (VOCAB, HIDDEN), torch.bfloat16, 0)] if stage == 0 else []
    for local in range(layers[stage]):
        params += layer_params(local, offset + local < dense, tp)
    if stage == len(layers) - 1:
        params += [("decoder.final_layernorm.weight", (HIDDEN,), torch.float32, None),
                   ("output_layer.weight", (VOCAB, HIDDEN), torch.bfloat16, 0)]
    return params, offset


def global_name(name: str, offset: int) -> str:
    layer, pattern = tp_pp.layer_of(name)
    return name if layer is None else pattern.replace("*", str(layer + offset), 1)


def full_tensor(gname: str, shape, dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, gname)) * 7919 + len(gname))
    return torch.randn(shape, generator=gen).to(dtype)


def shard(full: torch.Tensor, dim: int | None, tp: int, tp_rank: int) -> torch.Tensor:
    return full if dim is None else full.chunk(tp, dim=dim)[tp_rank].contiguous()


def specs(layers, dense, tp) -> list[list]:
    out = []
    for s in range(len(layers)):
        params, _ = stage_params(s, layers, dense, tp)
        out.append([tp_pp.ParamSpec(name, tuple(shape[d] // tp if d == i else shape[d] for d in range(len(shape)))
                                    if (i := dim) is not None else tuple(shape), str(dtype),
                                    torch.empty(0, dtype=dtype).element_size(), dim is not None, dim or 0)
                    for name, shape, dtype, dim in params])
    return out


def groups(tp: int, pp: int, dp: int, rank: int):
    """Megatron's TP and PP groups of `rank` (rank order tp-dp-pp); every rank creates all of them."""
    mine = {}
    for p in range(pp):
        for d in range(dp):
            ranks = [t + tp * (d + dp * p) for t in range(tp)]
            g = dist.new_group(ranks)
            if rank in ranks:
                mine["tp"] = g
    for t in range(tp):
        for d in range(dp):
            ranks = [t + tp * (d + dp * p) for p in range(pp)]
            g = dist.new_group(ranks)
            if rank in ranks:
                mine["pp"], mine["pp_ranks"] = g, ranks
    return mine["tp"], mine["pp"], mine["pp_ranks"]


def gather_path(layers, dense, tp, tp_rank, stage, tp_group, pp_group, pp_ranks, which=None):
    """verl's path: per parameter, the owner stage broadcasts its shard over PP, every PP rank all-gathers
    it inside TP. `which`: (stage, index) to do, in order (default: all)."""
    out = {}
    all_specs = specs(layers, dense, tp)
    todo = which if which is not None else [(s, i) for s in range(len(layers)) for i in range(len(all_specs[s]))]
    for s, i in todo:
        params, offset = stage_params(s, layers, dense, tp)
        name, shape, dtype, dim = params[i]
        gname = global_name(name, offset)
        spec = all_specs[s][i]
        buf = (shard(full_tensor(gname, shape, dtype), dim, tp, tp_rank) if s == stage
               else torch.empty(spec.shape, dtype=dtype))
        dist.broadcast(buf, src=pp_ranks[s], group=pp_group)
        if dim is not None and tp > 1:
            parts = [torch.empty_like(buf) for _ in range(tp)]
            dist.all_gather(parts, buf, group=tp_group)
            buf = torch.cat(parts, dim=dim)
        out[gname] = buf
    return out


def directed_path(plan, layers, dense, tp, tp_rank, stage, tp_group, pp_group, pp_ranks):
    """Eligible parameters slot by slot (TP gather + one PP all_to_all each); the rest as verl does."""
    out = {}
    mine, offset = stage_params(stage, layers, dense, tp)
    for slot in range(len(plan.slots)):
        local = []
        for i in plan.slots[slot][stage]:
            name, shape, dtype, dim = mine[i]
            local.append(shard(full_tensor(global_name(name, offset), shape, dtype), dim, tp, tp_rank))
        got = exchange.exchange_slot(plan, slot, stage, local, tp_group, pp_group)
        for (s, i), tensors in got.items():
            spec = plan.stages[s][i]
            gname = global_name(spec.name, sum(layers[:s]))
            out[gname] = torch.cat(tensors, dim=spec.partition_dim) if spec.tp_split else tensors[0]
    out.update(gather_path(layers, dense, tp, tp_rank, stage, tp_group, pp_group, pp_ranks, which=plan.rest))
    return out


def _worker(rank, port, world, tp, pp, layers, dense, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dp = world // (tp * pp)
        tp_rank, stage = rank % tp, rank // (tp * dp)
        tp_group, pp_group, pp_ranks = groups(tp, pp, dp, rank)
        plan = tp_pp.plan_tp_pp(specs(layers, dense, tp), tp)
        with traffic.count_received() as gathered_stats:
            want = gather_path(layers, dense, tp, tp_rank, stage, tp_group, pp_group, pp_ranks)
        with traffic.count_received() as directed_stats:
            got = directed_path(plan, layers, dense, tp, tp_rank, stage, tp_group, pp_group, pp_ranks)
        with traffic.count_received() as eligible_gather:
            gather_path(layers, dense, tp, tp_rank, stage, tp_group, pp_group, pp_ranks,
                        which=[(s, i) for s in range(pp) for i in range(len(plan.stages[s])) if plan.is_directed(s, i)])
        mismatches = sorted(set(want) ^ set(got)) + [n for n in want if n in got and not (
            want[n].dtype == got[n].dtype and torch.equal(want[n].view(torch.uint8), got[n].view(torch.uint8)))]
        results[rank] = dict(stage=stage, names=len(got), mismatches=mismatches,
                             gather_bytes=gathered_stats.bytes, directed_bytes=directed_stats.bytes,
                             gather_calls=gathered_stats.total_calls, directed_calls=directed_stats.total_calls,
                             eligible_gather_bytes=eligible_gather.bytes)
    finally:
        dist.destroy_process_group()

