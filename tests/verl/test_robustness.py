"""Memory and robustness fixes of the verl series (issue 8, item 7), on CPU:

- a DataProto stays writable after it was sent to a worker (pickled), and union unlocks a locked TensorDict;
- `actor_rollout_ref.{actor,ref}.megatron.logits_chunk_size` selects Megatron's chunked cross entropy (our Megatron
  fork): same log-probs and gradients as Megatron's path next to verl's entropy, and no full fp32 copy of the logits;
- the entropy is not torch.compiled on Ascend NPU (is_npu_available patched; the guard is on the called path).

Undefined names in the files the series touches: ruff's F rules, tests/forks/test_series_pyflakes.py.
"""

from __future__ import annotations

import importlib
import pickle
import re
from pathlib import Path

import pytest
import torch

from tests import stack
from tests.gloo import single_rank_model_parallel

protocol = stack.require("verl.protocol", "verl not installed (nox -s tests installs the stack)")
DataProto = protocol.DataProto


# ---------------------------------------------------------------- TensorDict locks


def _sent(data):
    """What a Ray call does to its DataProto argument: pickle it (DataProto.__getstate__)."""
    return pickle.loads(pickle.dumps(data))


def test_a_batch_sent_to_a_worker_still_takes_the_union_of_its_results():
    batch = DataProto.from_dict(tensors={"responses": torch.arange(8).view(4, 2)})
    received = _sent(batch)
    assert torch.equal(received.batch["responses"], batch.batch["responses"])
    result = DataProto.from_dict(tensors={"old_log_probs": torch.full((4, 2), -0.5)})
    merged = batch.union(result)  # tensordict 0.15 locked the sender's batch here: RuntimeError before the fix
    assert sorted(merged.batch.keys()) == ["old_log_probs", "responses"]
    assert torch.equal(merged.batch["old_log_probs"], result.batch["old_log_probs"])


def test_a_batch_sent_to_a_worker_still_takes_new_keys_and_sends_them():
    batch = DataProto.from_dict(tensors={"responses": torch.arange(8).view(4, 2)})
    _sent(batch)
    batch.batch["token_level_scores"] = torch.ones(4, 2)  # what the trainer does after an async reward call
    assert sorted(_sent(batch).batch.keys()) == ["responses", "token_level_scores"]


def test_the_trainer_sequence_of_sends_and_unions_keeps_every_key_and_value():
    """generate -> old_log_prob -> ref -> update: each stage pickles the batch, then unions the result (mixed
    dtypes, so that the consolidated storage is viewed as several types)."""
    batch = DataProto.from_dict(
        tensors={"responses": torch.arange(8).view(4, 2), "mask": torch.ones(4, 2, dtype=torch.bool)}
    )
    for step, key in enumerate(["old_log_probs", "ref_log_prob"]):
        received = _sent(batch)
        batch = batch.union(DataProto.from_dict(tensors={key: received.batch["responses"].float() * (step + 1)}))
    batch.batch["advantages"] = torch.full((4, 2), 0.25)
    final = _sent(batch)
    assert sorted(final.batch.keys()) == ["advantages", "mask", "old_log_probs", "ref_log_prob", "responses"]
    assert torch.equal(final.batch["ref_log_prob"], torch.arange(8.0).view(4, 2) * 2)
    assert final.batch["mask"].dtype == torch.bool and torch.equal(final.batch["responses"], torch.arange(8).view(4, 2))


def test_union_unlocks_a_locked_tensordict_and_still_refuses_conflicts():
    batch = DataProto.from_dict(tensors={"a": torch.zeros(3)})
    batch.batch.lock_()
    batch.union(DataProto.from_dict(tensors={"b": torch.ones(3)}))
    assert torch.equal(batch.batch["b"], torch.ones(3))
    with pytest.raises(AssertionError, match="not the same"):
        batch.union(DataProto.from_dict(tensors={"a": torch.ones(3)}))


# ---------------------------------------------------------------- chunked cross entropy


def _megatron_config(*overrides: str):
    import verl
    from omegaconf import OmegaConf

    base = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/ppo_megatron_trainer.yaml")
    return OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))


@pytest.fixture(scope="module")
def chunking():
    mod = stack.require("verl.utils.megatron.chunked_log_probs", "verl series not applied")
    try:
        importlib.import_module("megatron.core.tensor_parallel.chunked_cross_entropy")
    except ImportError as exc:
        stack.missing(f"Megatron lacks the chunked cross entropy of our fork ({exc})", stack.series("megatron"))
    return mod


@pytest.fixture(scope="module")
def tp1():
    """torch.distributed on gloo with one rank and Megatron model parallel (1, 1), as in a TP1 worker."""
    with single_rank_model_parallel():
        yield


def test_chunk_size_defaults_to_megatrons_path_and_the_ref_follows_the_actor(chunking):
    assert chunking.check_config(_megatron_config()) == {"actor": None, "ref": None}
    on = "actor_rollout_ref.actor.megatron.logits_chunk_size=1024"
    assert chunking.check_config(_megatron_config(on)) == {"actor": 1024, "ref": 1024}
    off_for_ref = "actor_rollout_ref.ref.megatron.logits_chunk_size=null"
    assert chunking.check_config(_megatron_config(on, off_for_ref)) == {"actor": 1024, "ref": None}


@pytest.mark.parametrize("section", ["actor", "ref"])
@pytest.mark.parametrize("value", ["0", "-8", "true", "1.5", "big"])
def test_a_bad_chunk_size_is_refused_naming_its_field(chunking, section, value):
    field = f"actor_rollout_ref.{section}.megatron.logits_chunk_size"
    with pytest.raises(ValueError, match=re.escape(field) + " must be null"):
        chunking.check_config(_megatron_config(f"{field}={value}"))


def test_a_megatron_without_chunking_is_refused_naming_the_field(chunking, monkeypatch):
    from megatron.core import tensor_parallel

    monkeypatch.setattr(
        tensor_parallel, "vocab_parallel_cross_entropy", lambda vocab_parallel_logits, target, label_smoothing=0.0: None
    )
    chunking.megatron_has_chunking.cache_clear()
    try:
        assert chunking.check_config(_megatron_config()) == {"actor": None, "ref": None}  # null needs nothing
        with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.megatron\.logits_chunk_size is set, but"):
            chunking.check_config(_megatron_config("actor_rollout_ref.actor.megatron.logits_chunk_size=1024"))
    finally:
        monkeypatch.undo()
        chunking.megatron_has_chunking.cache_clear()
    assert chunking.megatron_has_chunking()  # the real one (our fork) has it


def test_fsdp_configs_are_not_checked(chunking):
    import verl
    from omegaconf import OmegaConf

    assert chunking.check_config(OmegaConf.load(Path(verl.__file__).parent / "trainer/config/ppo_trainer.yaml")) == {}


class _Fp32Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest new fp32 storage created by the ops run while active (views and in-place ops create none)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves
        inputs = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and t.dtype == torch.float32
                and t.untyped_storage().data_ptr() not in inputs
            ):
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _entropy_and_log_probs(logits, labels, mask, chunk_size):
    """What MegatronPPOActor's logits_processor computes (entropy first, then log-probs, from the same logits),
    and the gradient of an entropy-regularised objective through both."""
    from verl.utils.megatron.tensor_parallel import vocab_parallel_entropy, vocab_parallel_log_probs_from_logits

    x = logits.detach().clone().requires_grad_(True)
    entropy = vocab_parallel_entropy(x)
    log_probs = vocab_parallel_log_probs_from_logits(x, labels, chunk_size=chunk_size)
    ((log_probs * mask).sum() + 0.01 * (entropy * mask).sum()).backward()
    return log_probs.detach(), entropy.detach(), x.grad


@pytest.mark.parametrize("chunk_size", [1024, 999])
def test_chunked_log_probs_and_gradients_match_megatrons_path_next_to_the_entropy(chunking, tp1, chunk_size):
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 7, 3000, generator=gen) * 3).to(torch.bfloat16)  # [batch, seq, vocab] as verl passes
    labels = torch.randint(0, 3000, (2, 7), generator=gen)
    mask = (torch.rand(2, 7, generator=gen) > 0.3).float()
    want_lp, want_ent, want_grad = _entropy_and_log_probs(logits, labels, mask, None)
    got_lp, got_ent, got_grad = _entropy_and_log_probs(logits, labels, mask, chunk_size)
    exact = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(got_lp.double(), exact, rtol=0, atol=2e-5)
    torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=2e-5)
    assert torch.equal(got_ent, want_ent)
    assert got_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=0, atol=2**-8)


def test_chunked_path_makes_no_full_fp32_copy_of_the_logits(chunking, tp1):
    from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_from_logits

    logits = torch.randn(1, 64, 16384).to(torch.bfloat16)
    labels = torch.randint(0, 16384, (1, 64))
    full_fp32 = logits.numel() * 4
    with _Fp32Allocations() as plain:
        vocab_parallel_log_probs_from_logits(logits, labels)
    with _Fp32Allocations() as chunked:
        vocab_parallel_log_probs_from_logits(logits, labels, chunk_size=1024)
    assert plain.largest >= full_fp32  # the measure sees Megatron's fp32 copy
    assert chunked.largest <= 64 * 1024 * 4, (chunked.largest, full_fp32)  # one [tokens, 1024] fp32 buffer


def _megatron_actor(section_config):
    """A MegatronPPOActor around a one-layer Megatron module (its constructor reads the model config)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig
    from verl.workers.actor.megatron_actor import MegatronPPOActor

    tf_config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    module = ColumnParallelLinear(8, 16, config=tf_config, init_method=torch.nn.init.zeros_)
    return MegatronPPOActor(
        config=section_config,
        model_config=None,
        hf_config=None,
        tf_config=tf_config,
        actor_module=[module],
        actor_optimizer=None,
    )


def test_the_actor_and_the_ref_read_their_chunk_size(chunking, tp1):
    config = _megatron_config("actor_rollout_ref.actor.megatron.logits_chunk_size=512")
    assert _megatron_actor(config.actor_rollout_ref.actor).logits_chunk_size == 512
    assert _megatron_actor(config.actor_rollout_ref.ref).logits_chunk_size == 512  # through the interpolation
    assert _megatron_actor(_megatron_config().actor_rollout_ref.ref).logits_chunk_size is None


# ---------------------------------------------------------------- torch.compile of the entropy on NPU


@pytest.fixture
def compile_calls(monkeypatch):
    """torch.compile replaced by a recorder that returns the function unchanged (so nothing compiles here)."""
    calls = []

    def fake_compile(fn=None, **kwargs):
        if fn is None:  # the decorator form, @torch.compile(dynamic=True)
            return lambda f: fake_compile(f, **kwargs)
        calls.append((fn, kwargs))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    return calls


@pytest.fixture
def guard():
    return stack.require("verl.utils.compile_guard", "verl series not applied")


@pytest.mark.parametrize("npu", [False, True], ids=["cuda-or-cpu", "npu"])
def test_compile_unless_npu(guard, compile_calls, monkeypatch, npu):
    import verl.utils.device as device

    monkeypatch.setattr(device, "is_npu_available", npu)

    def f(x):
        return x

    assert guard.compile_unless_npu(f, dynamic=True) is f
    assert compile_calls == ([] if npu else [(f, {"dynamic": True})])
    compile_calls.clear()
    assert guard.compile_unless_npu(f, enabled=False, dynamic=True) is f and compile_calls == []


@pytest.mark.parametrize("npu", [False, True], ids=["cuda-or-cpu", "npu"])
def test_megatron_entropy_is_eager_on_npu_and_compiled_elsewhere(guard, tp1, compile_calls, monkeypatch, npu):
    import verl.utils.device as device
    from verl.utils.megatron.tensor_parallel import vocab_parallel_entropy

    monkeypatch.setattr(device, "is_npu_available", npu)
    logits = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(2))
    want = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(vocab_parallel_entropy(logits.clone()), want, rtol=1e-5, atol=1e-5)
    assert [kwargs for _, kwargs in compile_calls] == ([] if npu else [{"dynamic": True}])


@pytest.mark.parametrize("npu", [False, True], ids=["cuda-or-cpu", "npu"])
def test_fsdp_actor_entropy_is_eager_on_npu(guard, tp1, compile_calls, monkeypatch, npu):
    import verl.utils.device as device
    import verl.utils.torch_functional as verl_F
    from omegaconf import OmegaConf
    from verl.workers.actor.dp_actor import DataParallelPPOActor

    monkeypatch.setattr(device, "is_npu_available", npu)
    config = OmegaConf.create({"ulysses_sequence_parallel_size": 1, "use_torch_compile": True})
    actor = DataParallelPPOActor(config=config, actor_module=torch.nn.Linear(2, 2))
    assert actor.compute_entropy_from_logits is verl_F.entropy_from_logits
    assert [fn for fn, _ in compile_calls] == ([] if npu else [verl_F.entropy_from_logits])
