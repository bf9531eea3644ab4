"""Reading source files: a JSON list of objects or JSON Lines, with per-row problems kept, not raised."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from tools.data.schema import BadRow, Example


class InputError(Exception):
    """The source cannot be read at all (missing, not JSON, not a list): nothing is converted."""


def read_records(path: Path) -> tuple[list[tuple[int, object]], list[BadRow]]:
    """(index, decoded value) for every row of `path`, plus the JSON Lines rows that do not decode.

    The format is told by content: a file whose first non-blank character is `[` is one JSON
    list; anything else is JSON Lines (one value a line, blank lines ignored, not counted).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {path}: {exc}") from exc
    if text.lstrip().startswith("["):
        return _json_list(path, text), []
    return _json_lines(text)


def _json_list(path: Path, text: str) -> list[tuple[int, object]]:
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} is not valid JSON: {exc}") from exc
    return list(enumerate(values))


def _json_lines(text: str) -> tuple[list[tuple[int, object]], list[BadRow]]:
    rows, bad = [], []
    for index, (line_no, line) in enumerate(_content_lines(text)):
        try:
            rows.append((index, json.loads(line)))
        except json.JSONDecodeError as exc:
            bad.append(BadRow(index, f"line {line_no} is not valid JSON ({exc.msg} at column {exc.colno})"))
    return rows, bad


def _content_lines(text: str) -> Iterator[tuple[int, str]]:
    for line_no, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield line_no, line


def text_field(record: object, name: str, *, required: bool = True) -> str:
    """`record[name]` as a string; ValueError with the reason when it is missing, empty or not a string."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if name not in record or record[name] is None:
        if required:
            raise ValueError(f"missing field {name!r}")
        return ""
    value = record[name]
    if not isinstance(value, str):
        raise ValueError(f"field {name!r} must be a string, got {type(value).__name__} {value!r:.40}")
    if required and not value.strip():
        raise ValueError(f"field {name!r} is empty")
    return value


def read_examples(path: Path, to_example: Callable[[int, object], Example]) -> tuple[list[Example], list[BadRow]]:
    """Every row of `path` through `to_example`; a row it rejects (ValueError) becomes a BadRow."""
    records, bad = read_records(path)
    examples = []
    for index, record in records:
        try:
            examples.append(to_example(index, record))
        except ValueError as exc:
            bad.append(BadRow(index, str(exc)))
    return examples, sorted(bad, key=lambda row: row.index)
