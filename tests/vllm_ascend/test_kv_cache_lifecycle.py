"""vLLM-Ascend series: the NPU worker frees its KV cache and re-creates it with the configs
vLLM's EngineCore kept (our vLLM series: EngineCore.free_kv_cache / reinit_kv_cache).

The call chain is real: EngineCore's two methods -> collective_rpc -> vLLM's run_method on a
WorkerWrapperBase -> NPUWorker -> NPUModelRunner.free_kv_cache / initialize_kv_cache, which
allocate real (CPU) tensors in the MLA layout and bind them with vLLM's bind_kv_cache. Stubbed:
the device (the runner is built without __init__, on device "cpu"), NPUPlatform.empty_cache and
mem_get_info (recorders), the runner's InputBatch (its pinned buffers need an accelerator), and
the scheduler."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest

from tests.stack import missing, require, series

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
BLOCKS, BLOCK_SIZE, LORA, ROPE = 4, 16, 32, 16


class Layer:
    """What bind_kv_cache binds to: an attention layer's kv_cache (vLLM's initial placeholder)."""

    def __init__(self):
        import torch

        self.kv_cache = [torch.tensor([])]


def kv_cache_config():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=LORA + ROPE, dtype=torch.float16,
                             use_mla=True)
    return KVCacheConfig(num_blocks=BLOCKS,
                         kv_cache_tensors=[KVCacheTensor(size=BLOCKS * spec.page_size_bytes, shared_by=[name])
                                           for name in LAYERS],
                         kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


@pytest.fixture
def stack(va, monkeypatch):
    """EngineCore (our vLLM series) over one NPU worker and its runner, no device."""
    import torch

    mr = va("vllm_ascend.worker.model_runner_v1")
    wv1 = va("vllm_ascend.worker.worker_v1")
    mla = va("vllm_ascend.attention.mla_v1")
    core_mod = require("vllm.v1.engine.core")
    if not hasattr(core_mod.EngineCore, "reinit_kv_cache"):
        missing("the installed vLLM lacks our series (EngineCore.free_kv_cache / reinit_kv_cache)",
                series("vllm"))
    from vllm.utils import run_method
    from vllm.worker.worker_base import WorkerWrapperBase

    calls = []
    free_memory = iter([1 << 30, 3 << 30])
    monkeypatch.setattr(mr.NPUPlatform, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(wv1.NPUPlatform, "mem_get_info", lambda: (next(free_memory), 64 << 30))
    monkeypatch.setattr(mr, "InputBatch", lambda **kwargs: SimpleNamespace(**kwargs))

    forward_context = {name: Layer() for name in LAYERS}
    vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=forward_context, enabled_custom_ops=(),
                                           disabled_custom_ops=()),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1),
        model_config=SimpleNamespace(enable_sleep_mode=False, trust_remote_code=False))
    runner = mr.NPUModelRunner.__new__(mr.NPUModelRunner)
    runner.vllm_config, runner.kv_caches, runner.device = vllm_config, [], torch.device("cpu")
    runner.max_num_reqs, runner.max_num_tokens = 4, 64
    runner.cache_config = SimpleNamespace(block_size=BLOCK_SIZE)
    runner.model_config = SimpleNamespace(max_model_len=256, get_vocab_size=lambda: 100, is_deepseek_mla=True,
                                          hf_text_config=SimpleNamespace(qk_rope_head_dim=ROPE))
    runner.attn_backend = mla.AscendMLABackend
    worker = wv1.NPUWorker.__new__(wv1.NPUWorker)
    worker.vllm_config, worker.model_runner = vllm_config, runner
    wrapper = WorkerWrapperBase(vllm_config, rpc_rank=0)
    wrapper.worker, wrapper.vllm_config = worker, vllm_config

    class Executor:  # what UniProcExecutor.collective_rpc does, with a record of each call
        def collective_rpc(self, method, args=()):
            calls.append(method)
            return [run_method(wrapper, method, args, {})]

    engine = core_mod.EngineCore.__new__(core_mod.EngineCore)
    engine.model_executor = Executor()
    engine.scheduler = SimpleNamespace(get_num_unfinished_requests=lambda: 0,
                                       reset_prefix_cache=lambda: calls.append("reset_prefix_cache"))
    engine.kv_cache_configs = [kv_cache_config()]
    return SimpleNamespace(engine=engine, runner=runner, forward_context=forward_context, calls=calls)


def test_free_then_reinit_recreates_the_cache_with_the_same_layout(stack):
    engine, runner, layers = stack.engine, stack.runner, stack.forward_context
    engine.model_executor.collective_rpc("initialize_from_config", args=(engine.kv_cache_configs,))  # start-up
    first = [layers[name].kv_cache[0] for name in LAYERS]
    shapes = [(nope.shape, rope.shape) for nope, rope in first]
    assert shapes == [((BLOCKS, BLOCK_SIZE, 1, LORA), (BLOCKS, BLOCK_SIZE, 1, ROPE))] * 2
    assert [id(t) for t in runner.kv_caches] == [id(t) for t in first]
    gone = [weakref.ref(t) for pair in first for t in pair]
    del first

    engine.free_kv_cache()
    gc.collect()
    assert runner.kv_caches == []
    assert all(layer.kv_cache[0].numel() == 0 for layer in layers.values()), "layers hold no cache"
    assert all(ref() is None for ref in gone), "no reference to the freed tensors is left"

    engine.reinit_kv_cache()
    again = [layers[name].kv_cache[0] for name in LAYERS]
    assert [(nope.shape, rope.shape) for nope, rope in again] == shapes
    assert [id(t) for t in runner.kv_caches] == [id(t) for t in again]
    assert stack.calls == ["initialize_from_config", "free_kv_cache", "empty_cache", "initialize_from_config",
                           "reset_prefix_cache"]


def test_reinit_without_free_is_refused_by_bind_kv_cache(stack):
    engine = stack.engine
    engine.model_executor.collective_rpc("initialize_from_config", args=(engine.kv_cache_configs,))
    with pytest.raises(AssertionError):
        engine.reinit_kv_cache()


def test_free_is_refused_while_a_kv_connector_holds_the_cache(stack, va, monkeypatch):
    mr = va("vllm_ascend.worker.model_runner_v1")
    monkeypatch.setattr(mr, "has_kv_transfer_group", lambda: True)
    with pytest.raises(RuntimeError, match="KV transfer connector"):
        stack.runner.free_kv_cache()


def test_release_handles_pairs_lists_and_unbound_layers(va):
    import torch

    release = va("vllm_ascend.worker.kv_cache_lifecycle").release_kv_caches
    pair, listed, unbound = Layer(), Layer(), Layer()
    pair.kv_cache = [(torch.ones(2), torch.ones(2))]
    listed.kv_cache = [[torch.ones(2), torch.ones(2)]]
    runner_list = [pair.kv_cache[0], listed.kv_cache[0]]
    released = release(runner_list, {"a": pair, "b": listed, "c": unbound, "d": object()}, num_virtual_engines=2)
    assert released == 2 and runner_list == []
    assert [len(layer.kv_cache) for layer in (pair, listed)] == [2, 2]
    assert all(t.numel() == 0 for layer in (pair, listed) for t in layer.kv_cache)
