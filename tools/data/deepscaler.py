"""DeepScaleR-Preview: a JSON list of {"problem", "answer", "solution"} objects.

`answer` is already the final answer in LaTeX (e.g. "\\frac{1}{2}"); it becomes the ground truth
unchanged apart from outer whitespace. `solution` is optional.
"""

from __future__ import annotations

from pathlib import Path

from tools.data.records import read_examples, text_field
from tools.data.schema import BadRow, Example

DATA_SOURCE = "deepscaler"


def read(path: Path) -> tuple[list[Example], list[BadRow]]:
    return read_examples(path, to_example)


def to_example(index: int, record: object) -> Example:
    return Example(index=index, problem=text_field(record, "problem").strip(),
                   answer=text_field(record, "answer").strip(),
                   solution=text_field(record, "solution", required=False).strip())
