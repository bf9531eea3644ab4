"""Bytes that pass through verl's single controller per GRPO step: verl's default data flow vs
TensorCache (`actor_rollout_ref.tensor_cache.enable`), for the A3 batch: 512 prompts x 16 samples =
8192 sequences, prompt 1024 + response 3072 tokens, Megatron TP4 PP8 DP8 on 256 workers. TensorCache
is shown twice: with the advantages sent to every TP x PP replica of a DP rank (its dispatch before
replica_broadcast.py), and as DP_COMPUTE_CACHED sends them now: once per DP rank, measured by running
the dispatch on the A3 layout, the other replicas getting them by a broadcast on the devices.

The tensor list is the real one: the fit loop of verl 0.4.0 (verl/trainer/ppo/ray_trainer.py) is
replayed on a 32-row batch of the real widths with verl's own driver functions (compute_response_mask,
compute_advantage), and the batch's keys at each call are what that call dispatches; bytes per row
are scaled to 8192 rows. verl's MEGATRON_COMPUTE_PROTO sends the whole batch, each DP chunk to all
TP x PP = 32 workers of its DP rank (verl 0.6.1's per-mesh dispatch puts each chunk in Ray's object store
once, and each of the 32 fetches it: the same bytes leave the driver's node); DP_COMPUTE_PROTO (the rollout)
sends each worker its own chunk;
meta_info (global_token_num) goes with every chunk. Non-tensor columns (uid, data_source, ...) are
left out: a few bytes per row. The rollout's DP (256 one-per-worker, or 128 TP2 instances x 2) does
not change what crosses the driver; it changes the on-device reshard, printed last.

  python benchmarks/driver_payload.py
"""

from __future__ import annotations

import pickle

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo.ray_trainer import AdvantageEstimator, compute_advantage, compute_response_mask

PROMPTS, N, P, R = 512, 16, 1024, 3072
B, SMALL = PROMPTS * N, 2 * N  # the A3 batch; the replayed batch (two prompts' groups)
TP, PP, DP = 4, 8, 8
WORKERS, REPLICAS = TP * PP * DP, TP * PP
MODEL_INPUTS = ["input_ids", "attention_mask", "position_ids", "responses"]


def row_bytes(data: DataProto, keys) -> int:
    return sum(data.batch[k][0].numel() * data.batch[k].element_size() for k in keys)


def meta_bytes(data: DataProto) -> int:
    """meta_info at full size: global_token_num holds one int per sequence."""
    meta = dict(data.meta_info)
    if "global_token_num" in meta:
        meta["global_token_num"] = [P + R // 2] * B
    return len(pickle.dumps(meta))


def rollout_output(prompts: DataProto) -> DataProto:
    """What verl 0.4.0's vLLM rollout returns (vllm_rollout_spmd.py), with its dtypes."""
    idx = prompts.batch["input_ids"].repeat_interleave(N, 0)
    response_mask = torch.ones(SMALL, R, dtype=torch.long)
    mask = torch.cat([prompts.batch["attention_mask"].repeat_interleave(N, 0), response_mask], 1)
    responses = torch.randint(0, 1000, (SMALL, R))
    return DataProto.from_dict(tensors={
        "prompts": idx, "responses": responses, "input_ids": torch.cat([idx, responses], 1),
        "rollout_log_probs": torch.zeros(SMALL, R), "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1})


def log_probs(*names: str) -> DataProto:
    return DataProto.from_dict(tensors={n: torch.zeros(SMALL, R) for n in names})  # fp32, as the actor returns them


def default_flow(recompute_old_log_prob: bool) -> list[tuple[str, int, int]]:
    """(stage, bytes the driver sends, bytes it receives) replaying verl's fit loop."""
    stages = []
    mask = torch.ones(2, P, dtype=torch.long)
    gen_batch = DataProto.from_dict(tensors={"input_ids": torch.zeros(2, P, dtype=torch.long),
                                             "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1})
    out = rollout_output(gen_batch)
    stages.append(("generate_sequences", row_bytes(gen_batch, gen_batch.batch.keys()) * PROMPTS,
                   row_bytes(out, out.batch.keys()) * B))  # DP_COMPUTE_PROTO: every worker its own chunk
    batch = out
    batch.batch["response_mask"] = compute_response_mask(batch)
    batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()

    def megatron_call(name: str, result: DataProto | None) -> None:
        sent = row_bytes(batch, batch.batch.keys()) * B * REPLICAS + meta_bytes(batch) * WORKERS
        stages.append((name, sent, row_bytes(result, result.batch.keys()) * B if result else 0))

    if recompute_old_log_prob:
        megatron_call("compute_log_prob", log_probs("old_log_probs", "entropys"))
        batch = batch.union(log_probs("old_log_probs"))  # the trainer pops entropys
    megatron_call("compute_ref_log_prob", log_probs("ref_log_prob"))
    batch = batch.union(log_probs("ref_log_prob"))
    batch.batch["token_level_scores"] = torch.zeros(SMALL, R)  # NaiveRewardManager: fp32 like responses
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    batch.non_tensor_batch["uid"] = np.array(["a"] * N + ["b"] * N, dtype=object)
    batch = compute_advantage(batch, AdvantageEstimator.GRPO, num_repeat=N)
    megatron_call("update_actor", None)
    return stages


def request_bytes() -> int:
    """What DP_COMPUTE_CACHED sends each worker instead of tensors: a CacheRequest with 256 DP ranks."""
    from verl.single_controller.base.cached_dispatch import CacheRequest

    return len(pickle.dumps(CacheRequest(stage="train", num_rows=B, get_keys=tuple(MODEL_INPUTS) + ("ref_log_prob",),
                                         dp_rank_of=tuple(r // TP % DP for r in range(WORKERS)))))


class A3Group:
    """What DP_COMPUTE_CACHED reads of the Megatron worker group for the train stage: the DP rank and collect flag
    each worker registered for the "actor" mesh (verl 0.6.1's Worker._register_dispatch_collect_info), in Megatron's
    rank order (TP fastest, then DP, then PP); TP 0 of the last pipeline stage answers for its DP rank."""

    world_size = WORKERS

    def __init__(self):
        self._dispatch_info, self._collect_info = {}, {}

    def _query_dispatch_info(self, mesh: str) -> list[int]:
        assert mesh == "actor", mesh
        return [rank // TP % DP for rank in range(WORKERS)]

    def _query_collect_info(self, mesh: str) -> list[bool]:
        assert mesh == "actor", mesh
        return [rank % TP == 0 and rank // (TP * DP) == PP - 1 for rank in range(WORKERS)]


def advantages_dispatch() -> tuple[float, int]:
    """DP_COMPUTE_CACHED's dispatch of the advantages on the A3 layout: how many workers get each row, and
    the bytes the driver serializes for the workers that get no rows (meta_info apart: counted for all)."""
    from verl.single_controller.base.cached_dispatch import TRAIN, CacheRequest, dispatch_dp_compute_cached

    (_, host), _ = dispatch_dp_compute_cached(A3Group(), CacheRequest(TRAIN, SMALL), log_probs("advantages"))
    rows = sum(len(h) for h in host if isinstance(h, DataProto))
    return rows / SMALL, sum(len(pickle.dumps(h)) for h in host if not isinstance(h, DataProto))


def tensor_cache_flow(copies: float, rowless_bytes: int) -> list[tuple[str, int, int]]:
    """verl/trainer/ppo/tensor_cache_flow.py: prompts in, responses + attention mask back, advantages in,
    each row to `copies` workers, `rowless_bytes` to the workers that get none."""
    mask = torch.ones(2, P, dtype=torch.long)
    gen_batch = DataProto.from_dict(tensors={"input_ids": torch.zeros(2, P, dtype=torch.long),
                                             "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1})
    out = rollout_output(gen_batch)
    request = request_bytes()
    advantages = log_probs("advantages")
    advantages.meta_info["global_token_num"] = []
    return [
        ("generate_sequences_cached", row_bytes(gen_batch, gen_batch.batch.keys()) * PROMPTS + request * WORKERS,
         row_bytes(out, ["responses", "attention_mask"]) * B),
        ("compute_ref_log_prob_cached", request * WORKERS, 0),
        ("update_actor_cached", int(row_bytes(advantages, ["advantages"]) * B * copies) + rowless_bytes
         + (meta_bytes(advantages) + request) * WORKERS, 0),
    ]


def device_reshard() -> tuple[int, int]:
    """Rows moved on the devices instead, rollout DP 256 -> train DP 8 (Megatron rank order TP, DP, PP):
    the largest any worker receives and the total, in bytes of the model inputs."""
    from verl.utils.reshard.plan import row_moves
    from verl.utils.reshard.tensor_cache import layout_rows

    have = layout_rows(B, WORKERS, list(range(WORKERS)))
    need = layout_rows(B, DP, [rank // TP % DP for rank in range(WORKERS)])
    received = [0] * WORKERS
    for _, dst, rows in row_moves(have, need):
        received[dst] += len(rows)
    per_row = 3 * (P + R) * 8 + R * 8  # input_ids, attention_mask, position_ids, responses (int64)
    return max(received) * per_row, sum(received) * per_row


def show(name: str, stages) -> float:
    print(f"{name}:")
    for stage, sent, got in stages:
        print(f"  {stage:30} out {sent / 1e9:8.3f} GB   back {got / 1e9:7.3f} GB")
    total = sum(s + g for _, s, g in stages)
    print(f"  {'total':30} {total / 1e9:8.3f} GB")
    return total


def main() -> None:
    upstream = show("verl 0.4.0 default flow, recompute_old_log_prob=true (verl's default)", default_flow(True))
    a3 = show("verl default flow, A3 profile (on-policy: no old_log_prob stage)", default_flow(False))
    every = show(f"TensorCache, advantages to all {REPLICAS} TP x PP replicas (A3 profile)",
                 tensor_cache_flow(REPLICAS, 0))
    copies, rowless = advantages_dispatch()
    once = show(f"TensorCache, advantages once per DP rank ({copies:g} copy, broadcast on the devices)",
                tensor_cache_flow(copies, rowless))
    peak, total = device_reshard()
    print(f"moved on the devices instead (one all_to_all per input before the ref): {total / 1e9:.1f} GB in all,"
          f" at most {peak / 1e9:.3f} GB into one worker")
    per_dp = row_bytes(log_probs("advantages"), ["advantages"]) * B / DP
    print(f"and the advantages, broadcast from one worker to its DP rank's replicas: {per_dp / 1e6:.1f} MB per DP rank")
    print(f"{'driver payload per step':44} {'GB':>8} {'vs A3 default':>14}")
    for name, total_bytes in [("verl 0.4.0 default flow", upstream), ("verl default flow, A3 profile", a3),
                              ("TensorCache, advantages to every replica", every),
                              ("TensorCache, advantages once per DP rank", once)]:
        print(f"{name:44} {total_bytes / 1e9:8.3f} {a3 / total_bytes:13.1f}x")
    print(f"driver payload per step: A3 default flow {a3 / 1e9:.1f} GB -> TensorCache {every / 1e9:.2f} GB ->"
          f" advantages once per DP rank {once / 1e9:.2f} GB: {a3 / once:.0f}x less than the default flow,"
          f" {every / once:.1f}x less than TensorCache with per-replica advantages")


if __name__ == "__main__":
    main()
