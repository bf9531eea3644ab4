"""On-policy old_log_prob skip (verl series) against verl's trainer config: taken where the loss stays the same,
refused where it would change it, and the touched verl modules import on CPU. The loss and gradient checks are
unit tests in the fork (tests/trainer/ppo/test_on_policy.py)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from tests.verl.conftest import require

on_policy = require("verl.trainer.ppo.on_policy")


def _config(*overrides: str):
    import verl
    from omegaconf import OmegaConf

    # v0.6.1's ppo_megatron_trainer.yaml is Hydra defaults only; the generated file is its flat rendering
    base = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_megatron_trainer.yaml")
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
    # v0.6.1's rollout correction reads or replaces old_log_probs (#3984)
    ("algorithm.rollout_correction.rollout_is=token", "rollout_correction.rollout_is must be null"),
    ("algorithm.rollout_correction.bypass_mode=true", "rollout_correction.bypass_mode must be false"),
])
def test_off_policy_settings_are_refused(override, words):
    with pytest.raises(ValueError, match=re.escape(words)) as err:
        on_policy.skip_old_log_prob(_config(override))
    assert "recompute_old_log_prob=true" in str(err.value)


@pytest.mark.parametrize("module", ["verl.trainer.ppo.ray_trainer", "verl.workers.actor.dp_actor",
                                    "verl.workers.actor.megatron_actor"])
def test_touched_modules_import(module):
    importlib.import_module(module)  # verl itself is present (the module skip above did not fire)
