"""What verl 0.6.1 does, without our series, in place of each patch we drop on moving there.

Each test runs one check of tests/verl/upstream_checks.py against verl 0.6.1's sdist (tests/verl/upstream.py), in
a fresh process of the cpu stack's interpreter; third_party/patches/verl/REBASE-v0.4.0-v0.6.1.md gives the verdicts.
A check fails where the release lacks the mechanism: run against verl 0.4.0's sdist, each of them fails.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests import stack
from tests.verl.upstream import release_tree, run_check

VERSION = "0.6.1"
# network: verl 0.6.1's sdist comes from the package index (cached after the first run)
pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def tree():
    for module in ("torch", "tensordict", "megatron.core", "transformers", "omegaconf", "vllm"):
        if importlib.util.find_spec(module) is None:  # found, not imported: the checks import in their process
            stack.missing(f"{module} is not installed")
    return release_tree(VERSION)


def test_a_dataproto_stays_writable_after_it_is_sent(tree):
    """keep-a-dataproto-writable-after-it-is-sent-to-a-worker: DataProto.__getstate__ consolidates a copy (#2962)."""
    run_check(tree, VERSION, "dataproto_stays_writable_after_send")


def test_the_critic_and_megatron_workers_import_without_flash_attn(tree):
    """import-flash-attn-in-the-fsdp-critic-only-on-cuda: dp_critic takes its padding helpers from
    verl.utils.attention_utils, which imports flash_attn only on CUDA (#2017, #3608)."""
    run_check(tree, VERSION, "critic_and_megatron_workers_import_without_flash_attn")


def test_a_text_model_gets_no_multimodal_vllm_arguments(tree):
    """pass-vllm-s-multimodal-arguments-only-for-multimodal-models: vLLMRollout sets limit_mm_per_prompt only with
    limit_images and passes no disable_mm_preprocessor_cache (#1880, #2068)."""
    run_check(tree, VERSION, "vllm_text_model_gets_no_multimodal_arguments")


def test_the_megatron_update_reports_rollout_vs_update_drift(tree):
    """report-rollout-vs-update-log-prob-drift-in-the-megatron-actor-s: MegatronPPOActor keeps rollout_log_probs in
    its mini-batches, and its loss reports rollout_corr/* from them and the update's own log-probs (#4070)."""
    run_check(tree, VERSION, "megatron_update_reports_rollout_vs_update_drift")


def test_a_megatron_checkpoint_restores_the_rng_on_cpu(tree):
    """save-the-megatron-checkpoint-s-device-rng-through-verl-s-device: get_rng_state/load_rng_states use
    get_torch_device() and skip the device generator on CPU (#2089)."""
    run_check(tree, VERSION, "megatron_checkpoint_restores_the_rng_on_cpu")


def test_a_megatron_checkpoint_resumes_the_optimizer(tree):
    """restore-the-megatron-optimizer-s-step-and-moments-on-resume: the optimizer goes through dist_checkpointing
    (optimizer.sharded_state_dict / load_state_dict, #2125)."""
    run_check(tree, VERSION, "megatron_checkpoint_resumes_the_optimizer")


def test_a_megatron_checkpoint_holds_every_expert_parallel_shard(tree):
    """save-every-expert-parallel-rank-s-megatron-model-shard: every rank saves its shards through
    save_dist_checkpointing (#2125)."""
    run_check(tree, VERSION, "megatron_checkpoint_saves_every_expert_parallel_shard")
