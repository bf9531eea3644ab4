"""Train -> rollout sync of the TP-split (non-expert) parameters: bytes each rank receives, collectives
it issues and the transient memory of the directed path (TP gather, then one all_to_all over PP per layer
slot) vs verl's gather path (per parameter: broadcast the shard over PP, all-gather it in TP).

1. Measured: 8 gloo processes (TP2 PP4, layer list 1,2,2,3, two dense first layers), both paths run on
   the same fake model; bytes counted on the collectives (tests/traffic.py).
2. Computed by the planner of our verl series for the A3 layout: TP4 PP8, 61 layers as 7,7,8,8,8,8,8,7,
   the first 3 dense, DeepSeek-V3 sizes (Megatron MLA parameter names and shapes, bf16, fp32 expert bias).

  python benchmarks/reshard_tp_pp.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl.utils.reshard.tp_pp import ParamSpec, plan_tp_pp, tp_pp_traffic  # noqa: E402

DSV3 = dict(hidden=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, intermediate=18432, moe_intermediate=2048, shared_experts=1, routed_experts=256,
            vocab=129280, first_k_dense=3)
TP, LAYER_LIST = 4, [7, 7, 8, 8, 8, 8, 8, 7]
GIB, MIB = 2**30, 2**20


def _p(name, shape, split=None, itemsize=2):
    shape = tuple(d // TP if i == split else d for i, d in enumerate(shape))
    return ParamSpec(name, shape, "torch.float32" if itemsize == 4 else "torch.bfloat16", itemsize,
                     split is not None, split or 0)


def dsv3_layer(local: int, dense: bool, c=DSV3) -> list[ParamSpec]:
    h, n = c["hidden"], c["heads"]
    pre = f"decoder.layers.{local}."
    params = [
        _p(pre + "input_layernorm.weight", (h,)),
        _p(pre + "self_attention.linear_q_down_proj.weight", (c["q_lora_rank"], h)),
        _p(pre + "self_attention.linear_q_up_proj.layer_norm_weight", (c["q_lora_rank"],)),
        _p(pre + "self_attention.linear_q_up_proj.weight",
           (n * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]), c["q_lora_rank"]), 0),
        _p(pre + "self_attention.linear_kv_down_proj.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], h)),
        _p(pre + "self_attention.linear_kv_up_proj.layer_norm_weight", (c["kv_lora_rank"],)),
        _p(pre + "self_attention.linear_kv_up_proj.weight",
           (n * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]), 0),
        _p(pre + "self_attention.linear_proj.weight", (h, n * c["v_head_dim"]), 1),
        _p(pre + "pre_mlp_layernorm.weight", (h,)),
    ]
    if dense:
        return params + [_p(pre + "mlp.linear_fc1.weight", (2 * c["intermediate"], h), 0),
                         _p(pre + "mlp.linear_fc2.weight", (h, c["intermediate"]), 1)]
    shared = c["shared_experts"] * c["moe_intermediate"]
    return params + [_p(pre + "mlp.router.weight", (c["routed_experts"], h)),
                     _p(pre + "mlp.router.expert_bias", (c["routed_experts"],), itemsize=4),
                     _p(pre + "mlp.shared_experts.linear_fc1.weight", (2 * shared, h), 0),
                     _p(pre + "mlp.shared_experts.linear_fc2.weight", (h, shared), 1)]
    # routed experts: benchmarks/reshard_experts.py


def dsv3_stages(c=DSV3) -> list[list[ParamSpec]]:
    stages, offset = [], 0
    for s, count in enumerate(LAYER_LIST):
        params = [_p("embedding.word_embeddings.weight", (c["vocab"], c["hidden"]), 0)] if s == 0 else []
        for local in range(count):
            params += dsv3_layer(local, offset + local < c["first_k_dense"])
        if s == len(LAYER_LIST) - 1:
            params += [_p("decoder.final_layernorm.weight", (c["hidden"],)),
                       _p("output_layer.weight", (c["vocab"], c["hidden"]), 0)]
        stages.append(params)
        offset += count
    return stages


def measured() -> None:
    from benchmarks.tp_pp_gloo import _worker
    from tests.verl.conftest import run_forked

    print("measured on gloo: TP2 PP4 (8 ranks), layer list 1,2,2,3, 2 dense first layers, all parameters")
    print(f"{'rank':>4} {'stage':>5} {'gather B':>9} {'directed B':>10} {'eligible: gather B':>18}"
          f" {'directed B':>10} {'calls gather':>12} {'directed':>8}")
    results = run_forked(_worker, 8, 8, 2, 4, [1, 2, 2, 3], 2)
    for rank, r in sorted(results.items()):
        rest = r["gather_bytes"] - r["eligible_gather_bytes"]
        print(f"{rank:4} {r['stage']:5} {r['gather_bytes']:9} {r['directed_bytes']:10} {r['eligible_gather_bytes']:18}"
              f" {r['directed_bytes'] - rest:10} {r['gather_calls']:12} {r['directed_calls']:8}"
              f"  {'bit-exact' if not r['mismatches'] else 'MISMATCH'}")


def computed() -> tuple[float, float]:
    stages = dsv3_stages()
    plan = plan_tp_pp(stages, TP)
    print(f"\ncomputed for the A3 layout: TP{TP} PP{len(LAYER_LIST)}, layers {','.join(map(str, LAYER_LIST))},"
          f" DeepSeek-V3 non-expert parameters; {len(plan.eligible)} eligible patterns, {len(plan.slots)} slots")
    print(f"{'stage':>5} {'recv gather GiB':>15} {'recv directed GiB':>17} {'minimum GiB':>11} {'sent gather GiB':>15}"
          f" {'sent directed GiB':>17} {'calls gather':>12} {'directed':>8}")
    for s in range(plan.pp):
        t = tp_pp_traffic(plan, s)
        print(f"{s:5} {t.gather_recv / GIB:15.3f} {t.directed_recv / GIB:17.3f} {t.minimum / GIB:11.3f}"
              f" {t.gather_sent / GIB:15.3f} {t.directed_sent / GIB:17.3f} {t.gather_calls:12} {t.directed_calls:8}")
    peak = max((plan.pp - 1) * plan.slot_bytes(j, s) + sum(plan.slot_bytes(j, p) for p in range(plan.pp))
               for j in range(len(plan.slots)) for s in range(plan.pp))
    rest = sum(p.full_bytes(TP) for s, i in plan.rest for p in [stages[s][i]])
    print(f"not eligible (gather path): {len(plan.rest)} parameters, {rest / GIB:.2f} GiB in full"
          f" (embedding, output layer, dense MLPs)")
    print(f"directed transient per slot (send copies + received slot of every stage): {peak / MIB:.0f} MiB")
    t0 = tp_pp_traffic(plan, 0)
    return t0.directed_recv / t0.gather_recv, t0.gather_calls / t0.directed_calls


def main() -> None:
    measured()
    recv_ratio, calls_ratio = computed()
    print(f"headline (A3, stage 0): received bytes directed/gather = {recv_ratio:.2f},"
          f" collectives gather/directed = {calls_ratio:.1f}x")


if __name__ == "__main__":
    main()
