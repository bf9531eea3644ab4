"""Count what torch.distributed's collectives deliver to this rank: bytes received and calls by name.

Test and benchmark tooling, not product code: `count_received()` wraps the collectives of
`torch.distributed` only for the duration of its block and restores them on exit, so nothing is
rebound at import and code outside the block runs on the originals. It sees calls made through the
module (`dist.all_to_all_single(...)`, as verl and Megatron call them), not names bound earlier
with `from torch.distributed import ...`. Object collectives (all_gather_object,
broadcast_object_list) are counted through the tensor collectives they are built on.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COUNTED = ("broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all",
           "all_to_all_single")


@dataclass
class Received:
    bytes: int = 0
    calls: Counter = field(default_factory=Counter)

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _arg(args, kwargs, index: int, name: str):
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def _received(name: str, args, kwargs) -> int:
    """Bytes that the collective `name`, called with these arguments, brings to this rank from others."""
    group = kwargs.get("group")
    if name == "broadcast":
        tensor, src, group_src = _arg(args, kwargs, 0, "tensor"), _arg(args, kwargs, 1, "src"), kwargs.get("group_src")
        me = dist.get_rank() if group_src is None else dist.get_rank(group)
        return 0 if (src if group_src is None else group_src) == me else _nbytes(tensor)
    if name == "all_gather":
        outs, tensor = _arg(args, kwargs, 0, "tensor_list"), _arg(args, kwargs, 1, "tensor")
        return (len(outs) - 1) * _nbytes(tensor)
    if name in ("all_gather_into_tensor", "all_gather_single"):
        out, inp = _arg(args, kwargs, 0, "output_tensor"), _arg(args, kwargs, 1, "input_tensor")
        return _nbytes(out) - _nbytes(inp)
    if name == "all_to_all":
        me = dist.get_rank(group)
        return sum(_nbytes(t) for r, t in enumerate(_arg(args, kwargs, 0, "output_tensor_list")) if r != me)
    if name == "all_to_all_single":
        out, splits = _arg(args, kwargs, 0, "output"), _arg(args, kwargs, 2, "output_split_sizes")
        me, world = dist.get_rank(group), dist.get_world_size(group)
        if not splits:
            splits = [out.shape[0] // world] * world
        row = out[0].numel() * out.element_size() if out.dim() > 1 else out.element_size()
        return (sum(splits) - splits[me]) * row
    return 0


def _counting(name: str, original, stats: Received):
    def wrapper(*args, **kwargs):
        stats.bytes += _received(name, args, kwargs)
        stats.calls[name] += 1
        return original(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def count_received():
    """Within the block, count the bytes this rank receives and the collective calls by name; the
    original functions are back in place when the block ends, however it ends."""
    stats = Received()
    with contextlib.ExitStack() as patches:
        for name in COUNTED:
            original = getattr(c10d, name, None)
            if original is None:  # not in this torch version
                continue
            wrapper = _counting(name, original, stats)
            patches.enter_context(mock.patch.object(c10d, name, wrapper))
            if getattr(dist, name, None) is original:
                patches.enter_context(mock.patch.object(dist, name, wrapper))
        yield stats
