"""vLLM-Ascend series: MLA KV cache writes with enable_kv_nz (vllm_ascend/attention/mla_v1.py).

Runs the patched AscendMLAImpl.forward / exec_kv_prefill on CPU tensors with the NPU kernels
stubbed: torch_npu.npu_kv_rmsnorm_rope_cache and torch_npu._npu_reshape_and_cache are recorders
(they write nothing), and the projections, rotary embedding and attention kernels
(_forward_prefill/_forward_decode) return zeros of the right shapes. What is real: the control
flow of forward() that decides, per attention state, which cache writes happen, for which slots
and in which cache mode."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

HEADS, KV_HEADS, LORA, ROPE, NOPE, V_DIM, HIDDEN = 2, 1, 32, 16, 16, 16, 64


@pytest.fixture(scope="module")
def mla(va):
    return va("vllm_ascend.attention.mla_v1")


class Recorder:
    """Stands in for the two cache-writing NPU kernels; records (kernel, slots, cache_mode)."""

    def __init__(self):
        self.writes = []

    def rmsnorm_rope_cache(self, kv, gamma, cos, sin, index, k_cache, ckv_cache, *, epsilon, cache_mode,
                           is_output_kv=False):
        import torch

        self.writes.append(("npu_kv_rmsnorm_rope_cache", index.tolist(), cache_mode))
        b, n, s, _ = kv.shape
        outs = (torch.zeros(b, n, s, ROPE), torch.zeros(b, n, s, LORA))
        return outs + outs if is_output_kv else outs + (None, None)

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_indices):
        self.writes.append(("_npu_reshape_and_cache", slot_indices.tolist(), "ND"))


def make_impl(mla, *, graph, kv_nz):
    import torch

    impl = mla.AscendMLAImpl.__new__(mla.AscendMLAImpl)  # __init__ needs a vLLM config and a device
    impl.num_heads, impl.num_kv_heads = HEADS, KV_HEADS
    impl.kv_lora_rank, impl.qk_rope_head_dim, impl.qk_nope_head_dim = LORA, ROPE, NOPE
    impl.qk_head_dim, impl.v_head_dim = NOPE + ROPE, V_DIM
    impl.torchair_graph_enabled, impl.enable_kv_nz = graph, kv_nz
    impl.kv_a_proj_with_mqa = lambda x: (torch.zeros(x.shape[0], LORA + ROPE),)
    norm = SimpleNamespace(weight=torch.ones(LORA), variance_epsilon=1e-6)
    impl.kv_a_layernorm = type("Norm", (), {"__call__": lambda self, x: x, "weight": norm.weight,
                                            "variance_epsilon": norm.variance_epsilon})()
    impl.q_proj = lambda x: (torch.zeros(x.shape[0], HEADS * (NOPE + ROPE)),)
    impl.o_proj = type("Linear", (), {"__call__": lambda self, x: (torch.zeros(x.shape[0], HIDDEN),),
                                      "weight": torch.zeros(HIDDEN, HEADS * V_DIM)})()
    impl.rotary_emb = lambda positions, q, k: (q, k)
    impl.rope_single = lambda x, cos, sin: x
    impl._q_proj_and_k_up_proj = lambda x: (torch.zeros(x.shape[0], HEADS, LORA), torch.zeros(x.shape[0], HEADS, ROPE))
    impl._forward_prefill = lambda q, k_c, k_pe, kv_cache, md: torch.zeros(q.shape[0], HEADS * V_DIM)
    impl._forward_decode = lambda q_nope, *a, **k: torch.zeros(q_nope.shape[0], HEADS * V_DIM)
    return impl


def metadata(state, num_decodes, prefill_tokens):
    import torch

    n = num_decodes + prefill_tokens
    rope = SimpleNamespace(cos=torch.zeros(1), sin=torch.zeros(1), input_positions=torch.arange(n))
    return SimpleNamespace(attn_state=state, num_actual_tokens=n, num_decodes=num_decodes,
                           num_decode_tokens=num_decodes, num_prefills=1 if prefill_tokens else 0,
                           slot_mapping=torch.arange(100, 100 + n), prefill=rope if prefill_tokens else None,
                           decode=rope if num_decodes else None)


def run_forward(mla, monkeypatch, *, graph, kv_nz, state, num_decodes, prefill_tokens):
    import torch

    recorder = Recorder()
    monkeypatch.setattr(mla.torch_npu, "npu_kv_rmsnorm_rope_cache", recorder.rmsnorm_rope_cache, raising=False)
    monkeypatch.setattr(mla.torch_npu, "_npu_reshape_and_cache", recorder.reshape_and_cache, raising=False)
    monkeypatch.setattr(mla, "get_multistream_comm_context", lambda: None)
    impl = make_impl(mla, graph=graph, kv_nz=kv_nz)
    md = metadata(state, num_decodes, prefill_tokens)
    n = md.num_actual_tokens
    kv_cache = (torch.zeros(4, 16, KV_HEADS, LORA), torch.zeros(4, 16, KV_HEADS, ROPE))
    hidden = torch.zeros(n, HIDDEN)
    k_pe = None if graph else torch.zeros(n, ROPE)  # the model passes k_pe only in eager mode
    impl.forward(None, torch.zeros(n, HIDDEN), hidden, k_pe, kv_cache, md, output=torch.zeros(n, HIDDEN))
    return recorder.writes, md


PREFILL_STATES = ["PrefillNoCache", "PrefillCacheHit", "ChunkedPrefill"]


@pytest.mark.parametrize("kv_nz", [True, False])
@pytest.mark.parametrize("state", PREFILL_STATES)
def test_graph_mode_prefill_is_written_once_in_the_decode_layout(mla, monkeypatch, state, kv_nz):
    writes, md = run_forward(mla, monkeypatch, graph=True, kv_nz=kv_nz,
                             state=getattr(mla.AscendAttentionState, state), num_decodes=0, prefill_tokens=6)
    expected_mode = "PA_NZ" if kv_nz else "PA"
    assert writes == [("npu_kv_rmsnorm_rope_cache", md.slot_mapping.tolist(), expected_mode)], (
        "one write per prefill token, in the mode exec_kv (decode) uses; no second ND write")


@pytest.mark.parametrize("kv_nz", [True, False])
def test_graph_mode_mixed_batch_writes_each_token_once(mla, monkeypatch, kv_nz):
    writes, md = run_forward(mla, monkeypatch, graph=True, kv_nz=kv_nz, state=mla.AscendAttentionState.ChunkedPrefill,
                             num_decodes=2, prefill_tokens=5)
    slots = md.slot_mapping.tolist()
    assert ("npu_kv_rmsnorm_rope_cache", slots[2:], "PA_NZ" if kv_nz else "PA") in writes
    assert ("_npu_reshape_and_cache", slots[:2], "ND") in writes, "decode tokens: their only write"
    written = [s for _, w, _ in writes for s in w]
    assert sorted(written) == slots, "every token written exactly once"


@pytest.mark.parametrize("kv_nz", [True, False])
def test_graph_decode_uses_pa_nz_like_prefill(mla, monkeypatch, kv_nz):
    """exec_kv (graph decode) and exec_kv_prefill choose the same cache mode."""
    import torch

    recorder = Recorder()
    monkeypatch.setattr(mla.torch_npu, "npu_kv_rmsnorm_rope_cache", recorder.rmsnorm_rope_cache, raising=False)
    impl = make_impl(mla, graph=True, kv_nz=kv_nz)
    cache = (torch.zeros(1), torch.zeros(1))
    impl.exec_kv(torch.zeros(3, HIDDEN), None, None, cache, torch.arange(3))
    impl.exec_kv_prefill(torch.zeros(3, HIDDEN), None, None, cache, torch.arange(3))
    modes = [mode for _, _, mode in recorder.writes]
    assert modes == ["PA_NZ", "PA_NZ"] if kv_nz else modes == ["PA", "PA"]


def test_eager_mode_writes_every_token_once_in_nd(mla, monkeypatch):
    writes, md = run_forward(mla, monkeypatch, graph=False, kv_nz=False, state=mla.AscendAttentionState.ChunkedPrefill,
                             num_decodes=2, prefill_tokens=5)
    assert writes == [("_npu_reshape_and_cache", md.slot_mapping.tolist(), "ND")]
