"""Reading the input files of `python -m tools.weights`: the one place that knows how they break.

Every input file is read through one of these readers (`read_json`, `safetensors_header`,
`open_safetensors`, `load_torch`): a missing or unreadable file, a JSON file that is not JSON or not
an object, a safetensors file whose header length is absurd, whose header is not JSON, or which is cut
short, all become one CheckpointError that names the file and what is wrong with it; the CLI prints
it as one line and exits 2. Nothing here imports torch at import time (tools.weights.hf uses it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class CheckpointError(ValueError):
    """Bad input checkpoint or destination; the message names the tensor, file or field."""


# ---------------------------------------------------------------- reading input files (the one place)

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header
DTYPE_BYTES = {"U64": 8, "I64": 8, "F64": 8, "F32": 4, "U32": 4, "I32": 4, "BF16": 2, "F16": 2, "U16": 2,
               "I16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _unreadable(path: Path, exc: OSError) -> CheckpointError:
    if isinstance(exc, FileNotFoundError):
        return CheckpointError(f"{path}: not found")
    if isinstance(exc, IsADirectoryError):
        return CheckpointError(f"{path}: is a directory, not a file")
    return CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})")


def read_json(path: Path, what: str = "JSON file") -> dict:
    """The JSON object in `path` (a config.json, an index, a manifest), or CheckpointError naming the
    file and what is wrong: missing, unreadable, not JSON, or JSON but not an object."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise _unreadable(path, exc) from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not a {what} (not UTF-8 text)") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not a {what}: not JSON ({exc.msg} at line {exc.lineno}"
                              f" column {exc.colno})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a {what}: JSON {type(value).__name__}, expected an object")
    return value


def safetensors_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file (tensor entries and `__metadata__`) and where its data
    begins, checked as far as the header alone allows: a length that fits the file, JSON, entries
    whose byte ranges match their dtype and shape and lie inside the file (a truncated file fails
    here, not at a read deep into a conversion)."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a readable safetensors file: {what}; re-download it")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length (truncated?)")
            length = int.from_bytes(f.read(8), "little")
            if length > MAX_HEADER_BYTES:
                raise bad(f"header length {length} bytes is absurd (safetensors allows {MAX_HEADER_BYTES})")
            if length > size - 8:
                raise bad(f"header length {length} bytes, but only {size - 8} bytes follow (truncated?)")
            raw = f.read(length)
    except OSError as exc:
        raise _unreadable(path, exc) from None
    try:
        head = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"the {length}-byte header is not JSON ({getattr(exc, 'msg', None) or exc.reason})") from None
    if not isinstance(head, dict):
        raise bad(f"the header is a JSON {type(head).__name__}, expected an object")
    data = size - 8 - length
    for name, entry in head.items():
        if name == "__metadata__":
            if entry is not None and not isinstance(entry, dict):
                raise bad("__metadata__ is not an object")
            continue
        if not _valid_entry(entry):
            raise bad(f"tensor {name!r} has no valid dtype, shape and data_offsets: {json.dumps(entry)[:200]}")
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype in DTYPE_BYTES:
            n = DTYPE_BYTES[dtype]
            for d in shape:
                n *= d
            if end - begin != n:
                raise bad(f"tensor {name!r} spans {end - begin} bytes, its {dtype} shape {shape} needs {n}")
        if end > data:
            raise bad(f"tensor {name!r} ends at data byte {end}, but the file holds {data} (truncated?)")
    return head, 8 + length


def _valid_entry(entry) -> bool:
    """A header entry as safetensors writes it: a dtype name, a shape of sizes, [begin, end] byte offsets."""
    def count(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(entry, dict):
        return False
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    return (isinstance(dtype, str) and isinstance(shape, list) and all(count(d) for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(count(o) for o in offsets)
            and offsets[0] <= offsets[1])


def open_safetensors(path: Path):
    """safetensors' `safe_open` of a file whose header `safetensors_header` accepted (safetensors'
    own errors name no file); anything it still refuses becomes a CheckpointError too."""
    from safetensors import SafetensorError, safe_open

    safetensors_header(path)
    try:
        return safe_open(path, "pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file: {first_line(exc)}; re-download it") from None


def load_torch(path: Path, what: str = "file") -> object:
    """torch.load of one of our own rank files (weights only), or CheckpointError naming it."""
    try:
        import torch

        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise _unreadable(path, exc) from None
    except Exception as exc:  # noqa: BLE001 - a corrupt zip or pickle raises many types; each is this error
        raise CheckpointError(f"{path}: not a readable {what}: {first_line(exc)}") from None
