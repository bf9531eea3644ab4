"""On-policy old_log_prob skip (verl series): same loss and gradients as the recompute with identical
weights, refused where it would change the loss, and the touched verl modules import on CPU."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

from tests.verl.conftest import require

on_policy = require("verl.trainer.ppo.on_policy")
core_algos = require("verl.trainer.ppo.core_algos")


def _config(*overrides: str):
    import verl
    from omegaconf import OmegaConf

    base = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/ppo_megatron_trainer.yaml")
    on = ["actor_rollout_ref.actor.recompute_old_log_prob=false", "data.train_batch_size=8",
          "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.entropy_coeff=0"]
    return OmegaConf.merge(base, OmegaConf.from_dotlist(on + list(overrides)))


def test_default_recomputes():
    assert on_policy.skip_old_log_prob(_config("actor_rollout_ref.actor.recompute_old_log_prob=true")) is False


def test_on_policy_setting_skips():
    assert on_policy.skip_old_log_prob(_config()) is True


@pytest.mark.parametrize("override, words", [
    ("actor_rollout_ref.actor.ppo_mini_batch_size=4", "ppo_mini_batch_size (4) must equal data.train_batch_size (8)"),
    ("actor_rollout_ref.actor.ppo_epochs=2", "ppo_epochs is 2"),
    ("actor_rollout_ref.actor.entropy_coeff=0.001", "entropy_coeff is 0.001"),
    ("algorithm.use_kl_in_reward=true", "use_kl_in_reward must be false"),
])
def test_off_policy_settings_are_refused(override, words):
    with pytest.raises(ValueError, match=re.escape(words)) as err:
        on_policy.skip_old_log_prob(_config(override))
    assert "recompute_old_log_prob=true" in str(err.value)


def _policy_loss(old_of, seed=0):
    """GRPO policy loss of a tiny policy; `old_of(log_prob)` supplies old_log_prob. Returns loss and grads."""
    gen = torch.Generator().manual_seed(seed)
    policy = torch.nn.Linear(6, 11)
    with torch.no_grad():
        policy.weight.copy_(torch.randn(11, 6, generator=gen))
        policy.bias.copy_(torch.randn(11, generator=gen))
    states, tokens = torch.randn(4, 5, 6, generator=gen), torch.randint(0, 11, (4, 5), generator=gen)
    advantages, mask = torch.randn(4, 5, generator=gen), (torch.rand(4, 5, generator=gen) > 0.2).float()

    def log_probs():
        return torch.log_softmax(policy(states), -1).gather(-1, tokens[..., None]).squeeze(-1)

    log_prob = log_probs()
    old = old_of(log_prob, log_probs)
    loss, clipfrac, _, _ = core_algos.compute_policy_loss(old_log_prob=old, log_prob=log_prob, advantages=advantages,
                                                          response_mask=mask, cliprange=0.2, loss_agg_mode="token-mean")
    loss.backward()
    return loss.detach(), policy.weight.grad.clone(), policy.bias.grad.clone(), clipfrac


def test_skip_gives_the_same_loss_and_gradients_as_the_recompute():
    def recomputed(log_prob, forward):  # the old_log_prob forward with identical weights, no grad
        with torch.no_grad():
            return forward()

    def skipped(log_prob, forward):
        return on_policy.old_log_prob_for_loss(None, log_prob)

    a, b = _policy_loss(recomputed), _policy_loss(skipped)
    for x, y in zip(a[:3], b[:3], strict=True):
        assert torch.equal(x, y)
    assert b[3] == 0, "ratio exactly 1: the clip is inert"


def test_a_recorded_old_log_prob_is_used_as_is():
    recorded, current = torch.zeros(2, 3), torch.ones(2, 3, requires_grad=True)
    assert on_policy.old_log_prob_for_loss(recorded, current) is recorded
    assert not on_policy.old_log_prob_for_loss(None, current).requires_grad


def test_update_keys_drop_old_log_probs_only_when_absent():
    keys = ["responses", "old_log_probs", "advantages"]
    assert on_policy.drop_missing_old_log_probs(keys, {"responses", "advantages"}) == ["responses", "advantages"]
    assert on_policy.drop_missing_old_log_probs(keys, {"responses", "old_log_probs", "advantages"}) == keys


@pytest.mark.parametrize("module", ["verl.trainer.ppo.ray_trainer", "verl.workers.actor.dp_actor",
                                    "verl.workers.actor.megatron_actor"])
def test_touched_modules_import(module):
    importlib.import_module(module)  # verl itself is present (the module skip above did not fire)
