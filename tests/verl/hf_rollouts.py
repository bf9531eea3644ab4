"""verl's HFRollout as the tests drive it on verl 0.6.1."""

from __future__ import annotations


def generating_hf_rollout(module, config):
    """verl 0.6.1's HFRollout no longer instantiates: BaseRollout makes resume/update_weights/release abstract and
    takes (config, model_config, device_mesh) (the registered 'hf' rollout is the fork's HFEngineRollout). Its
    generate path is unchanged: run it on the module and config its old constructor set."""
    from verl.workers.rollout import hf_rollout

    cls = type("HFRollout", (hf_rollout.HFRollout,), dict.fromkeys(("resume", "update_weights", "release"), None))
    rollout = cls.__new__(cls)
    rollout.config, rollout.module = config, module
    return rollout
