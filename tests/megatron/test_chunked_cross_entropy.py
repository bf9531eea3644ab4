"""The chunked vocab-parallel cross entropy carried in our Megatron fork.

`megatron/core/tensor_parallel/chunked_cross_entropy.py` must give the loss and gradient
of Megatron's plain `vocab_parallel_cross_entropy` without allocating a full fp32 copy of
the logits. Runs on CPU with a one-rank gloo group and model parallel sizes (1, 1).
"""

from __future__ import annotations

import pytest

from tests import stack

torch = stack.require("torch")
try:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import cross_entropy as plain_ce
    from megatron.core.tensor_parallel.chunked_cross_entropy import (
        chunked_vocab_parallel_cross_entropy,
    )
except ImportError as exc:  # megatron-core absent, or our fork patch not applied
    stack.missing(f"megatron.core with chunked cross entropy is not importable ({exc})", stack.series("megatron"))

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tests.gloo import single_rank_model_parallel  # noqa: E402

SEQ, BATCH, VOCAB = 8, 2, 5000  # 5000 is not a multiple of the 1024-column chunk
# Tolerances against the plain implementation. The loss differs only by the order of the
# fp32 summation of exp(); the gradient is a softmax in [0, 1] (fp32 for fp32 logits, and
# for bf16 logits rounded to bf16 by both paths: at most one bf16 ulp of 1.0 apart).
TOL = {
    torch.float32: {"loss": 1e-5, "grad": 1e-6},
    torch.bfloat16: {"loss": 1e-5, "grad": 2**-8},
}


@pytest.fixture(scope="module")
def tp1():
    """torch.distributed on gloo with one rank, Megatron model parallel (1, 1)."""
    with single_rank_model_parallel():
        yield


def _plain(logits, target, label_smoothing):
    return plain_ce.vocab_parallel_cross_entropy(logits, target, label_smoothing)


def _loss_and_grad(fn, logits, target, grad_out, **kwargs):
    # The plain path mutates fp32 logits in place (`.float()` is a no-op there): use a copy.
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x, target, **kwargs)
    loss.backward(grad_out)
    return loss.detach(), x.grad


# Runs before any test that uses the module-scoped tp1 fixture.
def test_does_not_modify_logits_and_works_without_process_group():
    """No torch.distributed and no model parallel state: one rank, no communication."""
    assert not parallel_state.model_parallel_is_initialized(), \
        "model parallel state is already initialised: this test runs before the tp1 fixture, so an earlier test left it"
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 3000, generator=gen)
    before = logits.clone()
    target = torch.randint(0, 3000, (4, 3), generator=gen)
    loss = chunked_vocab_parallel_cross_entropy(logits, target)
    want = torch.nn.functional.cross_entropy(before.view(-1, 3000), target.view(-1), reduction="none").view(4, 3)
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-5)
    assert torch.equal(logits, before)


def test_rejects_bad_chunk_size():
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_vocab_parallel_cross_entropy(torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.long), chunk_size=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk_size", [1024, 999])
def test_matches_plain_implementation(tp1, dtype, label_smoothing, chunk_size):
    gen = torch.Generator().manual_seed(1234)
    logits = (torch.randn(SEQ, BATCH, VOCAB, generator=gen) * 4).to(dtype)
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)
    grad_out = torch.rand(SEQ, BATCH, generator=gen)

    want_loss, want_grad = _loss_and_grad(lambda x, t: _plain(x, t, label_smoothing), logits, target, grad_out)
    got_loss, got_grad = _loss_and_grad(
        chunked_vocab_parallel_cross_entropy,
        logits,
        target,
        grad_out,
        label_smoothing=label_smoothing,
        chunk_size=chunk_size,
    )

    assert got_loss.shape == want_loss.shape == (SEQ, BATCH)
    assert got_loss.dtype == want_loss.dtype == torch.float32
    assert got_grad.dtype == logits.dtype and got_grad.shape == logits.shape
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=TOL[dtype]["loss"])
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=0, atol=TOL[dtype]["grad"])


def test_switch_in_vocab_parallel_cross_entropy(tp1):
    """`chunk_size=None` (the default) keeps Megatron's path; an int selects the chunked one."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(SEQ, BATCH, VOCAB, generator=gen).to(torch.bfloat16)
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)
    with _AllocationCounter() as default:
        want = plain_ce.vocab_parallel_cross_entropy(logits, target)
    with _AllocationCounter() as chunked:
        got = plain_ce.vocab_parallel_cross_entropy(logits, target, chunk_size=1024)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert default.bytes >= logits.numel() * 4  # the full fp32 copy: default unchanged
    assert chunked.bytes < logits.numel() * 4 // 4


class _AllocationCounter(TorchDispatchMode):
    """Bytes of new storage allocated by the aten ops run while active.

    An op's output counts when its storage is not one of its inputs' storages (views,
    in-place and out= ops allocate nothing). The total bounds the peak from above, so
    "total allocated < X" proves "peak extra memory < X". torch.profiler's memory events
    are empty on this CPU build, and RSS is too coarse for a few MB.
    """

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        seen = set()
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in inputs and ptr not in seen:
                    seen.add(ptr)
                    self.bytes += storage.nbytes()
        return out


def test_extra_memory_is_a_small_fraction_of_a_full_fp32_copy(tp1):
    """Logits [1, 4, 256000] bf16: the plain path allocates a full fp32 copy (4 MB), the
    chunked path one [4, 1024] fp32 buffer and per-row vectors in the forward pass, and in
    the backward pass only the bf16 gradient it must return plus such a buffer."""
    gen = torch.Generator().manual_seed(0)
    vocab = 256000
    logits = torch.randn(1, 4, vocab, generator=gen).to(torch.bfloat16)
    target = torch.randint(0, vocab, (1, 4), generator=gen)
    fp32_copy = logits.numel() * 4
    bf16_grad = logits.numel() * 2

    def forward_backward(fn):
        x = logits.detach().requires_grad_(True)
        with _AllocationCounter() as fwd:
            loss = fn(x, target)
        with _AllocationCounter() as bwd:
            loss.sum().backward()
        return fwd.bytes, bwd.bytes

    plain_fwd, plain_bwd = forward_backward(lambda x, t: _plain(x, t, 0.0))
    chunk_fwd, chunk_bwd = forward_backward(chunked_vocab_parallel_cross_entropy)

    # The measure sees the plain path's fp32 copy ...
    assert plain_fwd >= fp32_copy
    # ... and the chunked forward allocates under 5% of it (here about 0.4%).
    assert chunk_fwd < 0.05 * fp32_copy, (chunk_fwd, fp32_copy)
    # Backward: the returned bf16 gradient plus under 5% of an fp32 copy.
    assert chunk_bwd < bf16_grad + 0.05 * fp32_copy, (chunk_bwd, bf16_grad, fp32_copy)
    assert chunk_fwd + chunk_bwd < plain_fwd + plain_bwd
