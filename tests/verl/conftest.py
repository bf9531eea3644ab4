"""Tests of our verl series run against the materialised fork (installed in the test stack)."""

from __future__ import annotations

from tests import stack


def require(module: str):
    """Import a module of our verl series (skips saying why, or fails under the switch: tests/stack.py)."""
    return stack.require(module, stack.series("verl"))


def run_ranks(worker, world: int, *args) -> dict:
    """`worker(rank, port, *args, results)` in `world` processes, spawned (see tests/gloo.py)."""
    from tests.gloo import run_processes  # imports torch: here, so that a missing torch is reported per test

    return run_processes(worker, world, *args)


def owner_of(root, name: str):
    """The submodule of `root` that holds the dotted parameter `name`, made on the way where missing (the fake
    Megatron models of the weight-sync tests), and the leaf name."""
    import torch  # here, so that without torch this directory's tests report it rather than fail to collect

    *path, leaf = name.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    return mod, leaf
