"""The CPU backend of our verl series: each guarded change, exercised on this CPU machine. The CPU device's memory
and seeding calls (verl/utils/cpu_device.py) and the FSDP workers' CPU guards are tested in the fork's
tests/utils/test_cpu_device.py and tests/workers/test_cpu_fsdp_guards.py, the CPU resource pools in
tests/trainer/ppo/test_resource_pool_cpu.py (their placement on a real Ray cluster stays here) and the
Megatron workers' CPU answers in tests/utils/megatron/test_cpu_backend.py.

The end-to-end proof (verl's GRPO trainer on FSDP + HF rollout, through the launcher) is tests/recipes/test_smoke.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import stack
from tests.verl.conftest import require, run_ranks
from tests.verl.hf_rollouts import generating_hf_rollout

device = require("verl.utils.device")


def test_cpu_machine_is_seen_as_cpu():
    assert not device.is_cuda_available and not device.is_npu_available
    assert device.get_device_name() == "cpu"


def _all_reduce_worker(rank, port, world, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from verl.utils.device import get_dist_backend

    torch.distributed.init_process_group(backend=get_dist_backend(), rank=rank, world_size=world)
    t = torch.tensor([rank + 1.0])
    torch.distributed.all_reduce(t)
    results[rank] = (get_dist_backend(), float(t))
    torch.distributed.destroy_process_group()


def test_dist_backend_is_gloo_on_cpu_and_runs_a_collective():
    results = run_ranks(_all_reduce_worker, 2, 2)
    assert results == {0: ("gloo", 3.0), 1: ("gloo", 3.0)}


def _fsdp2_load_worker(rank, port, world, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from verl.utils.fsdp_utils import fsdp2_load_full_state_dict

    torch.manual_seed(rank)  # every rank starts from different weights; rank 0's must win
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    full = {k: v.clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)
    fsdp2_load_full_state_dict(model, {k: v.clone() for k, v in full.items()}, mesh)  # it replaces the values
    got = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    results[rank] = (full, got)
    torch.distributed.destroy_process_group()


def test_fsdp2_loads_rank0_weights_into_cpu_shards():
    results = run_ranks(_fsdp2_load_worker, 2, 2)
    rank0_weights = results[0][0]
    for rank in (0, 1):
        got = results[rank][1]
        assert got.keys() == rank0_weights.keys()
        for key in got:
            assert torch.equal(got[key], rank0_weights[key]), (rank, key)
    assert not torch.equal(results[1][0]["0.weight"], rank0_weights["0.weight"]), "the ranks should start apart"


def test_resource_pool_counts_cpus_on_a_cpu_cluster():
    """The placement on a real local Ray cluster of 3 CPUs (the fork tests its check against a stated answer).
    It runs here, where tests/conftest.py holds one Ray auth mode and handles Ray's threads at exit."""
    ray = stack.require("ray")
    trainer = require("verl.trainer.ppo.ray_trainer")
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)  # never a stale cluster
    try:
        mapping = {trainer.Role.ActorRollout: "pool"}
        manager = trainer.ResourcePoolManager({"pool": [2]}, mapping, device_name="cpu")
        manager.create_resource_pool()
        pool = manager.get_resource_pool(trainer.Role.ActorRollout)
        assert pool.use_gpu is False
        bundles = pool.get_placement_groups(device_name="cpu")[0].bundle_specs
        assert bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
        with pytest.raises(ValueError, match="Total available GPUs 1.0 is less than total desired GPUs 8"):
            trainer.ResourcePoolManager({"big": [8]}, mapping, device_name="cpu").create_resource_pool()
        with pytest.raises(ValueError, match="Total available GPUs 0 is less"):  # accelerator default unchanged
            trainer.ResourcePoolManager({"gpu": [2]}, mapping).create_resource_pool()
    finally:
        ray.shutdown()


def test_hf_rollout_samples_n_responses_on_cpu():
    transformers = stack.require("transformers")
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from verl import DataProto

    require("verl.workers.rollout.hf_rollout")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, attn_implementation=device.default_attn_implementation()))
    config = OmegaConf.create({"n": 3, "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                               "response_length": 6, "micro_batch_size": 2,
                               "val_kwargs": {"top_k": 0, "top_p": 1.0, "temperature": 0.0}})
    prompts = torch.tensor([[0, 5, 6, 7], [9, 10, 11, 12]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    batch = TensorDict({"input_ids": prompts, "attention_mask": mask,
                        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}, batch_size=2)
    # v0.6.1's fit loop repeats each prompt rollout.n times before the rollout, which samples one response a row
    repeated = DataProto(batch=batch, meta_info={"eos_token_id": 1, "pad_token_id": 0}).repeat(3, interleave=True)
    out = generating_hf_rollout(model, config).generate_sequences(repeated)
    assert out.batch["responses"].shape == (6, 6)
    assert out.batch["input_ids"].shape == (6, 10)
    assert torch.equal(out.batch["prompts"][:3], prompts[:1].expand(3, -1))  # the n samples of a prompt stay together
    assert out.batch["attention_mask"][:, :4].tolist()[0] == [0, 1, 1, 1]
