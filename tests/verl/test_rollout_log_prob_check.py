"""training/rollout_logprob_diff_* in the Megatron actor's update (verl series, trainer/ppo/rollout_log_prob_check.py
+ the hooks in megatron_actor.py): max and mean |rollout - update| log-prob over the response mask only;
near zero when the rollout and the update forward use the same weights; the update keeps rollout_log_probs."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

from tests.verl.conftest import require

check = require("verl.trainer.ppo.rollout_log_prob_check")


def test_zero_ish_when_rollout_and_update_share_the_weights(tmp_path):
    transformers = require("transformers")
    from verl import DataProto
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.rollout.hf_rollout import HFRollout

    from tools.weights.tiny import make_tiny

    make_tiny(tmp_path, tokenizer=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, torch_dtype=torch.float32, attn_implementation="sdpa"
    )
    config = OmegaConf.create(
        dict(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            n=2,
            response_length=8,
            dtype="float32",
            calculate_log_probs=True,
            val_kwargs={},
        )
    )
    ids = torch.randint(40, 320, (3, 5), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    prompts = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": compute_position_id_with_mask(mask)}
    )
    prompts.meta_info.update(eos_token_id=list(range(1, 33)), pad_token_id=0)
    torch.manual_seed(1)
    out = HFRollout(model, config).generate_sequences(prompts).batch
    # the update forward's log_prob, as the Megatron actor slices it: logits of position t predict token t + 1
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits
    log_prob = torch.log_softmax(logits[:, -9:-1].float(), -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)
    response_mask = out["attention_mask"][:, -8:]
    got = check.rollout_log_prob_metrics(out["rollout_log_probs"], log_prob, response_mask)
    assert got["training/rollout_logprob_diff_max"] < 2e-5 and got["training/rollout_logprob_diff_mean"] < 1e-5
    # and a weight the rollout did not get shows up
    with torch.no_grad():
        model.lm_head.weight.mul_(1.1)
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits
    log_prob = torch.log_softmax(logits[:, -9:-1].float(), -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)
    assert (
        check.rollout_log_prob_metrics(out["rollout_log_probs"], log_prob, response_mask)[
            "training/rollout_logprob_diff_max"
        ]
        > 1e-3
    )


def test_the_update_keeps_rollout_log_probs():
    megatron_actor = require("verl.workers.actor.megatron_actor")
    from verl import DataProto

    n, length = 4, 3
    tensors = {
        k: torch.zeros(n, length)
        for k in ("responses", "input_ids", "attention_mask", "position_ids", "advantages", "rollout_log_probs")
    }
    actor = SimpleNamespace(
        config=OmegaConf.create(
            dict(use_kl_loss=False, ppo_mini_batch_size=n, ppo_epochs=1, data_loader_seed=0, shuffle=False)
        )
    )
    batch = next(iter(megatron_actor.MegatronPPOActor.make_minibatch_iterator(actor, DataProto.from_dict(tensors))))
    assert "rollout_log_probs" in batch.batch.keys() and "old_log_probs" not in batch.batch.keys()
    del tensors["rollout_log_probs"]
    batch = next(iter(megatron_actor.MegatronPPOActor.make_minibatch_iterator(actor, DataProto.from_dict(tensors))))
    assert "rollout_log_probs" not in batch.batch.keys()
