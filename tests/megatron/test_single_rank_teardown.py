"""The single-rank model parallel context of tests/gloo.py leaves no gloo thread running in the pytest process.

Megatron-core 0.12.3's destroy_model_parallel keeps two of its groups referenced; without dropping them their
gloo worker threads and the default group's TCPStore server ran on into interpreter exit."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")
dist = pytest.importorskip("torch.distributed")

from tests.gloo import single_rank_model_parallel  # noqa: E402
from tests.threads import GLOO_THREADS, native_threads  # noqa: E402


def gloo_threads() -> set[str]:
    return GLOO_THREADS.intersection(native_threads())


def test_single_rank_model_parallel_stops_every_gloo_thread_it_started():
    if dist.is_initialized() or gloo_threads():
        pytest.skip(f"a process group of another test is alive here ({sorted(gloo_threads())})")
    with single_rank_model_parallel():
        assert gloo_threads() == GLOO_THREADS, "the context started no gloo group: the test proves nothing"
    assert not dist.is_initialized()
    assert not gloo_threads(), "gloo threads outlive the context: a process group is still referenced"
