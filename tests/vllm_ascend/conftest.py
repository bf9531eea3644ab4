"""Integration tests of our recipe against vLLM-Ascend, read from the fork's source tree (third_party/vllm-ascend).

vLLM-Ascend is an NPU-only fork: it is never installed in the cpu stack, and torch_npu, torchair
and CANN's acl do not exist here. The fixture below puts the fork's tree on sys.path and uses the
fork's own CPU stubs (tests/ut/cpu_stubs.py, added by our series): imports of those device modules
get stub modules whose every attribute is a MagicMock, torch gets a MagicMock `npu`, and
vllm_ascend gets the _build_info module that its build writes (an A3 die). So the tests run the
patched Python code itself; each test says which device calls it stubs and what it checks for
real. The stubs are removed again after this directory's tests.
The unit tests of our series' patches are in the fork's own tree (tests/ut/, `python -m tools.forks test`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests import stack

os.environ.setdefault("VLLM_PLUGINS", "none")  # never let a platform plugin pick a device here

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "third_party" / "vllm-ascend"
GET_TREE = ("sync and apply it: `python -m tools.forks sync vllm-ascend && python -m tools.forks apply "
            "vllm-ascend` (nox -s tests does both)")
# A file that only our series adds: its absence means the tree is at the bare pin.
SERIES_MARKER = TREE / "vllm_ascend" / "distributed" / "dp_sync.py"
# The stubs our series gives the fork's unit tests; the same for these tests, so there is one copy.
FORK_STUBS = TREE / "tests" / "ut" / "cpu_stubs.py"


def _fork_stubs():
    """The fork's tests/ut/cpu_stubs.py as a module of its own: imported by path, since the fork's `tests`
    package would shadow ours."""
    spec = importlib.util.spec_from_file_location("_vllm_ascend_cpu_stubs", FORK_STUBS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="package")
def va():
    """Import modules of the patched vLLM-Ascend tree: `va("vllm_ascend.worker.model_runner_v1")`.

    Package scope: the stubs (which make find_spec("torch_npu") succeed) are gone again before
    the tests of any other directory run."""
    if not (TREE / "vllm_ascend").is_dir():
        stack.missing(f"the vLLM-Ascend source is absent ({TREE})", GET_TREE)
    if not SERIES_MARKER.is_file() or not FORK_STUBS.is_file():
        stack.missing(f"our vLLM-Ascend series is not applied in {TREE}", GET_TREE)
    stack.require("torch")
    stack.require("vllm", "vLLM (our fork) is not installed; vLLM-Ascend runs on top of it")
    import torch

    stubs = _fork_stubs()
    had_npu = hasattr(torch, "npu")
    roots: set[str] = set()
    sys.path.insert(0, str(TREE))  # first: the stubs look vllm_ascend._build_info up in the tree
    try:
        roots.update(stubs.stub_absent_device_modules())
        yield importlib.import_module
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, stubs._StubFinder)]
        sys.path.remove(str(TREE))
        if not had_npu and hasattr(torch, "npu"):
            del torch.npu
        for name in list(sys.modules):  # vllm_ascend.* includes the stand-in vllm_ascend._build_info
            if name.split(".")[0] in roots | {"vllm_ascend"}:
                del sys.modules[name]
