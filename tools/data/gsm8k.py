"""GSM8K: {"question", "answer"} rows, the answer being a worked solution that ends in `#### 42`.

The text after the last `####` is the ground truth (thousands separators dropped: "1,234" ->
"1234"); the text before it is kept as extra_info.solution. A row without `####` is malformed.
"""

from __future__ import annotations

import re
from pathlib import Path

from tools.data.records import read_examples, text_field
from tools.data.schema import BadRow, Example

DATA_SOURCE = "openai/gsm8k"
_MARK = "####"
_NUMBER_WITH_COMMAS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def read(path: Path) -> tuple[list[Example], list[BadRow]]:
    return read_examples(path, to_example)


def to_example(index: int, record: object) -> Example:
    question = text_field(record, "question").strip()
    worked = text_field(record, "answer")
    solution, mark, final = worked.rpartition(_MARK)
    if not mark:
        raise ValueError(f"field 'answer' has no {_MARK!r} before the final answer")
    final = final.strip()
    if not final:
        raise ValueError(f"field 'answer' has nothing after {_MARK!r}")
    return Example(index=index, problem=question, answer=final_number(final), solution=solution.strip())


def final_number(text: str) -> str:
    """"1,234" -> "1234"; anything that is not a comma-grouped number is returned as it is."""
    return text.replace(",", "") if _NUMBER_WITH_COMMAS.fullmatch(text) else text
