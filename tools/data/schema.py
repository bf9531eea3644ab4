"""verl's RLHF row schema, and the one row builder every converter shares.

A row, as verl's RLHFDataset and reward manager read it:

    data_source   "deepscaler" | "openai/gsm8k" | "synthetic-arith"  (picks the reward function)
    prompt        [{"role": "user", "content": problem + " " + instruction}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": answer}
    extra_info    {"index": position in the source, "split": "train" | "test", "solution": worked solution}
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

# The reward reads only the last \boxed{} of a response, so the prompt asks for one.
DEFAULT_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(MESSAGE)),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("index", pa.int64()), ("split", pa.string()), ("solution", pa.string())])),
])


@dataclass(frozen=True)
class Example:
    """One problem, whatever its source: `index` is its position in that source."""

    index: int
    problem: str
    answer: str
    solution: str


@dataclass(frozen=True)
class BadRow:
    """A source row that cannot become an Example, and why."""

    index: int
    reason: str


def make_row(example: Example, data_source: str, split: str, instruction: str) -> dict:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{example.problem} {instruction}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": example.answer},
        "extra_info": {"index": example.index, "split": split, "solution": example.solution},
    }
