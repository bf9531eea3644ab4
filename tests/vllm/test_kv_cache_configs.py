"""vLLM series: EngineCore keeps the KV cache configs it computed, frees the cache while idle and
re-creates it with the same layout. Unit test of EngineCore's own methods with a stub executor and
a stub scheduler standing in for the devices (vLLM 0.9.1 here has no device to allocate on); the
KV cache configs themselves come from vLLM's real get_kv_cache_config."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tests import stack

os.environ.setdefault("VLLM_PLUGINS", "none")  # never let a platform plugin import torch_npu here
torch = stack.require("torch")
core_mod = stack.require("vllm.v1.engine.core", "vLLM (our fork) is not installed")
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

if not hasattr(core_mod.EngineCore, "reinit_kv_cache"):
    stack.missing("the installed vLLM lacks our series", stack.series("vllm"))


class StubExecutor:
    """Two workers with one attention layer each; records the calls the engine makes."""

    def __init__(self):
        self.calls = []

    def get_kv_cache_specs(self):
        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, use_mla=False)
        return [{"model.layers.0.self_attn": spec}, {"model.layers.0.self_attn": spec}]

    def determine_available_memory(self):
        return [64 << 20, 48 << 20]  # the smaller worker decides the block count

    def initialize_from_config(self, kv_cache_configs):
        self.calls.append(("initialize_from_config", kv_cache_configs))

    def collective_rpc(self, method, args=()):
        self.calls.append((method, *args))


class StubScheduler:
    def __init__(self, unfinished=0):
        self.unfinished, self.resets = unfinished, 0

    def get_num_unfinished_requests(self):
        return self.unfinished

    def reset_prefix_cache(self):
        self.resets += 1
        return True


def vllm_config():
    return SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks_override=None, block_size=16),
        model_config=SimpleNamespace(max_model_len=4096),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
    )


@pytest.fixture
def core():
    engine = core_mod.EngineCore.__new__(core_mod.EngineCore)  # __init__ would build a model
    engine.model_executor = StubExecutor()
    engine.scheduler = StubScheduler()
    return engine


def test_configs_are_kept_and_the_cache_is_recreated_with_them(core):
    blocks, _, scheduler_config = core._initialize_kv_caches(vllm_config())
    first = core.model_executor.calls[0]
    assert first[0] == "initialize_from_config" and first[1] is core.kv_cache_configs
    assert [c.num_blocks for c in core.kv_cache_configs] == [blocks, blocks] and scheduler_config.num_blocks == blocks
    core.free_kv_cache()
    core.reinit_kv_cache()
    assert core.model_executor.calls[1:] == [("free_kv_cache",), ("initialize_from_config", core.kv_cache_configs)]
    assert core.scheduler.resets == 1, "cached prefixes point into the freed cache"


def test_freeing_with_unfinished_requests_is_refused(core):
    core._initialize_kv_caches(vllm_config())
    core.scheduler.unfinished = 3
    with pytest.raises(RuntimeError, match="3 requests are unfinished"):
        core.free_kv_cache()
    assert ("free_kv_cache",) not in core.model_executor.calls
