"""vLLM-Ascend series: every Python file our patches touch compiles (py_compile on the patched
tree). Needs the source only, not torch_npu: this is the whole check the NPU-only code paths get
beyond the stubbed unit tests next to this file."""

from __future__ import annotations

import py_compile

from tests import stack
from tests.vllm_ascend.conftest import GET_TREE, SERIES_MARKER, TREE, series_python_files


def test_every_touched_file_compiles(tmp_path):
    if not SERIES_MARKER.is_file():
        stack.missing(f"the vLLM-Ascend tree with our series is absent ({TREE})", GET_TREE)
    files = series_python_files()
    assert "vllm_ascend/attention/mla_v1.py" in files and "vllm_ascend/worker/worker_v1.py" in files
    for i, path in enumerate(files):
        py_compile.compile(str(TREE / path), cfile=str(tmp_path / f"{i}.pyc"), doraise=True)
