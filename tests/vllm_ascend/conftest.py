"""Integration tests of our recipe against vLLM-Ascend, read from the fork's source tree (third_party/vllm-ascend).

vLLM-Ascend is an NPU-only fork: it is never installed in the cpu stack, and torch_npu, torchair
and CANN's acl do not exist here. The fixture below puts the fork's tree on sys.path and answers
imports of those device modules with stub modules whose every attribute is a MagicMock (plus
`torch.npu`). So the tests run the patched Python code itself; each test says which device calls
it stubs and what it checks for real. The stubs are removed again after this directory's tests.
The unit tests of our series' patches are in the fork's own tree (tests/ut/, `python -m tools.forks test`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from unittest import mock

import pytest

from tests import stack

os.environ.setdefault("VLLM_PLUGINS", "none")  # never let a platform plugin pick a device here

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "third_party" / "vllm-ascend"
GET_TREE = ("sync and apply it: `python -m tools.forks sync vllm-ascend && python -m tools.forks apply "
            "vllm-ascend` (nox -s tests does both)")
# A file that only our series adds: its absence means the tree is at the bare pin.
SERIES_MARKER = TREE / "vllm_ascend" / "distributed" / "dp_sync.py"
DEVICE_MODULES = ("torch_npu", "torchair", "acl")


class _StubModule(types.ModuleType):
    """A device module that does not exist on CPU: any attribute is a MagicMock, created once."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _absent(name: str) -> bool:
    return importlib.util.find_spec(name) is None


@pytest.fixture(scope="package")
def va():
    """Import modules of the patched vLLM-Ascend tree: `va("vllm_ascend.worker.model_runner_v1")`.

    Package scope: the stubs (which make find_spec("torch_npu") succeed) are gone again before
    the tests of any other directory run."""
    if not (TREE / "vllm_ascend").is_dir():
        stack.missing(f"the vLLM-Ascend source is absent ({TREE})", GET_TREE)
    if not SERIES_MARKER.is_file():
        stack.missing(f"our vLLM-Ascend series is not applied in {TREE}", GET_TREE)
    stack.require("torch")
    stack.require("vllm", "vLLM (our fork) is not installed; vLLM-Ascend runs on top of it")
    import torch

    # numba is a vLLM requirement the cpu stack leaves out; only vLLM's n-gram drafter uses it.
    roots = DEVICE_MODULES + (("numba",) if _absent("numba") else ())
    finder = _StubFinder(roots)
    sys.meta_path.insert(0, finder)
    sys.path.insert(0, str(TREE))
    had_npu = hasattr(torch, "npu")
    if not had_npu:
        torch.npu = mock.MagicMock(name="torch.npu")
    try:
        yield importlib.import_module
    finally:
        sys.meta_path.remove(finder)
        sys.path.remove(str(TREE))
        if not had_npu:
            del torch.npu
        for name in list(sys.modules):
            if name.split(".")[0] in roots or name.split(".")[0] == "vllm_ascend":
                del sys.modules[name]

