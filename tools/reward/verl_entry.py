"""The reward under verl's `custom_reward_function` signature.

verl 0.4 loads this file by path and calls `compute_score(data_source, solution_str, ground_truth,
extra_info)`; anything under `custom_reward_function.reward_kwargs` arrives as keyword arguments:

    custom_reward_function.path=tools/reward/verl_entry.py
    custom_reward_function.name=compute_score
    +custom_reward_function.reward_kwargs.mode=lax      # only to reproduce the reference curves
"""

import sys
from pathlib import Path

if not __package__:  # loaded by file path, as verl does: make `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.reward import math_score  # noqa: E402

# Every source the data tools write (tools/data) is scored by its final boxed answer.
MATH_SOURCES = frozenset({"deepscaler", "openai/gsm8k", "synthetic-arith"})


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, *,
                  mode: str = "strict", timeout_s: float = 5.0) -> float:
    """1.0 or 0.0 for one response; raises ValueError for a data_source without a reward."""
    if data_source not in MATH_SOURCES:
        raise ValueError(f"no reward for data_source {data_source!r}; known: {', '.join(sorted(MATH_SOURCES))}")
    return math_score.compute_score(solution_str, ground_truth, mode=mode, timeout_s=timeout_s)
