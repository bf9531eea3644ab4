"""Bytes that pass through verl's single controller per GRPO step: verl's default data flow vs
TensorCache, for the A3 batch (512 prompts x 16 = 8192 sequences, prompt 1024 + response 3072).

verl's default flow (Megatron workers, verl 0.4.0): the driver collects every rollout output, then
dispatches each stage's inputs to every worker, each getting its data-parallel chunk, so each chunk
is sent TP x PP = 32 times (the 256 workers of TP4 PP8 DP8). With TensorCache the batch stays on the
devices; only what the host needs travels: responses and attention mask to the driver (reward
decoding), advantages back, dispatched like the default flow (conservative: chunk x 32).
Computed from the real tensor list and dtypes; no devices needed.

  python benchmarks/driver_payload.py
"""

from __future__ import annotations

B, P, R = 8192, 1024, 3072  # sequences, prompt length, response length
L = P + R
REPLICAS = 4 * 8  # TP x PP: workers sharing one data-parallel chunk
I64, F32 = 8, 4

TENSORS = {  # name: bytes for the whole batch
    "prompts": B * P * I64,
    "responses": B * R * I64,
    "input_ids": B * L * I64,
    "attention_mask": B * L * I64,
    "position_ids": B * L * I64,
    "ref_log_prob": B * R * F32,
    "old_log_probs": B * R * F32,  # = log_prob.detach() on-policy: still dispatched by verl's flow
    "advantages": B * R * F32,
}
MODEL_INPUTS = ["input_ids", "attention_mask", "position_ids", "responses"]

DEFAULT = [  # (what, tensors, copies)
    ("rollout -> driver", ["prompts", "responses", "input_ids", "attention_mask", "position_ids"], 1),
    ("driver -> ref workers", MODEL_INPUTS, REPLICAS),
    ("ref -> driver", ["ref_log_prob"], 1),
    ("driver -> actor update", MODEL_INPUTS + ["old_log_probs", "ref_log_prob", "advantages"], REPLICAS),
]
TENSOR_CACHE = [
    ("rollout -> driver (reward)", ["responses", "attention_mask"], 1),
    ("driver -> workers", ["advantages"], REPLICAS),
]


def total(flow) -> float:
    return sum(sum(TENSORS[t] for t in tensors) * copies for _, tensors, copies in flow)


def show(name: str, flow) -> None:
    print(f"{name}:")
    for what, tensors, copies in flow:
        gb = sum(TENSORS[t] for t in tensors) * copies / 1e9
        print(f"  {what:28} {gb:8.2f} GB  ({', '.join(tensors)}{f' x {copies}' if copies > 1 else ''})")
    print(f"  {'total':28} {total(flow) / 1e9:8.2f} GB")


def main() -> None:
    show("verl 0.4.0 default flow", DEFAULT)
    show("TensorCache", TENSOR_CACHE)
    print(f"driver payload per step: {total(DEFAULT) / 1e9:.1f} GB -> {total(TENSOR_CACHE) / 1e9:.1f} GB,"
          f" ratio {total(DEFAULT) / total(TENSOR_CACHE):.1f}x less")


if __name__ == "__main__":
    main()
