"""rollout.calculate_log_probs in verl's HFRollout (verl series, workers/rollout/hf_sampling.py + the hook in
hf_rollout.py): rollout_log_probs are the log-probs of the sampled tokens under the distribution that
sampled them, equal to a teacher-forced forward's (fp32), with temperature and top-k too; -1 after the
end as verl's vLLM rollout pads them; absent unless asked. The unit tests of hf_sampling.py are the fork's
tests/workers/rollout/test_hf_sampling.py."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from tests.verl.conftest import require
from tests.verl.hf_rollouts import generating_hf_rollout

hf_rollout = require("verl.workers.rollout.hf_rollout")
hf_sampling = require("verl.workers.rollout.hf_sampling")
transformers = require("transformers")
from verl import DataProto  # noqa: E402
from verl.utils.model import compute_position_id_with_mask  # noqa: E402

EOS = list(range(1, 65))  # a fifth of the vocabulary: most responses end early, so the padding is exercised
PAD = 0
RESPONSE = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tools.weights.tiny import make_tiny

    path = tmp_path_factory.mktemp("tiny")
    make_tiny(path, tokenizer=False)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=torch.float32, attn_implementation="sdpa"
    )


def _config(**kw):
    base = dict(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        n=1,
        response_length=RESPONSE,
        dtype="float32",
        calculate_log_probs=True,
        micro_batch_size=4,
        val_kwargs=dict(top_k=0, top_p=1.0, temperature=0, n=1, do_sample=False),
    )
    base.update(kw)
    return OmegaConf.create(base)


def _prompts(batch=4, length=6):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(40, 320, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.int64)
    for i in range(batch):  # left padding of 0..batch-1 tokens
        mask[i, :i] = 0
        ids[i, :i] = PAD
    data = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)}
    )
    data.meta_info.update(eos_token_id=EOS, pad_token_id=PAD)
    return data


def _teacher_forced(model, out, temperature, top_k):
    """The sampling distribution's log-probs of the responses, from one forward over prompt + response."""
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits
    logits = logits[:, -RESPONSE - 1 : -1].float() / temperature
    if top_k:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("temperature, top_k, n", [(1.0, 0, 1), (0.7, 20, 2)])
def test_rollout_log_probs_equal_a_teacher_forced_forward(model, temperature, top_k, n):
    torch.manual_seed(0)
    rollout = generating_hf_rollout(model, _config(temperature=temperature, top_k=top_k, n=n))
    # v0.6.1's fit loop repeats each prompt rollout.n times before the rollout, which samples one response a row
    out = rollout.generate_sequences(_prompts().repeat(repeat_times=n, interleave=True)).batch
    got = out["rollout_log_probs"]
    assert got.dtype == torch.float32 and got.shape == (4 * n, RESPONSE)
    valid = out["attention_mask"][:, -RESPONSE:].bool()
    assert (~valid).any() and valid.sum(1).min() >= 1  # some responses ended early: the padding is exercised
    assert torch.all(got[~valid] == -1)
    want = _teacher_forced(model, out, temperature, top_k)
    assert torch.isfinite(got[valid]).all()
    torch.testing.assert_close(got[valid], want[valid], rtol=0, atol=2e-5)


def test_greedy_validation_log_probs_are_the_plain_softmax(model):
    rollout = generating_hf_rollout(model, _config())
    prompts = _prompts()
    prompts.meta_info.update(validate=True, do_sample=False)  # what verl's trainer sends for validation
    out = rollout.generate_sequences(prompts).batch
    valid = out["attention_mask"][:, -RESPONSE:].bool()
    torch.testing.assert_close(
        out["rollout_log_probs"][valid], _teacher_forced(model, out, 1.0, 0)[valid], rtol=0, atol=2e-5
    )


def test_no_rollout_log_probs_unless_asked(model):
    out = generating_hf_rollout(model, _config(calculate_log_probs=False)).generate_sequences(_prompts())
    assert "rollout_log_probs" not in out.batch.keys()
