"""The CPU backend of our verl series for the Megatron workers: each guarded change, exercised on this CPU machine.

The end-to-end proof (verl's GRPO trainer with Megatron actor and ref, TensorCache, directed weight sync and the
manual lifecycle, through the launcher) is tests/recipes/test_smoke.py.
"""

from __future__ import annotations

import os

import torch

from tests.gloo import run_processes
from tests.verl.conftest import require

device = require("verl.utils.device")
cpu_models = require("verl.models.mcore.cpu")


def test_current_device_is_cpu_without_an_accelerator():
    assert device.current_device() == "cpu"
    assert torch.zeros(2).to(device.current_device()).device.type == "cpu"


def test_host_copy_survives_freeing_the_original_storage():
    """offload_megatron_model_to_cpu keeps `host_copy(param_data)` and then frees param_data's storage; on CPU
    `.cpu()` returns the tensor itself, so the kept copy would be freed with it."""
    data = torch.arange(6, dtype=torch.float32)
    kept = device.host_copy(data)
    data.untyped_storage().resize_(0)
    assert torch.equal(kept, torch.arange(6, dtype=torch.float32))
    assert data.cpu().data_ptr() == data.data_ptr(), "the hazard this guards against: .cpu() is a no-op on CPU"


def _offload_worker(rank, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule
    from verl.utils.megatron_utils import load_megatron_model_to_gpu, offload_megatron_model_to_cpu

    mpu.initialize_model_parallel(1, 1)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
        bf16=True,
    )

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.proj = ColumnParallelLinear(8, 4, config=config, init_method=torch.nn.init.normal_, bias=False)

    # the actor's settings: the params live in DDP's contiguous buffer, which offload frees
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), Tiny())
    before = model.module.proj.weight.detach().clone()
    offload_megatron_model_to_cpu([model])
    freed = all(b.param_data.untyped_storage().size() == 0 for b in model.buffers)
    load_megatron_model_to_gpu([model])
    results[rank] = {"freed": freed, "restored": torch.equal(model.module.proj.weight.detach(), before)}
    mpu.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def test_megatron_params_offload_and_come_back_on_cpu():
    """The manual lifecycle offloads the Megatron params before the rollout and loads them back for the update."""
    require("megatron.core.distributed")
    # spawn: a fork of a pytest process that already ran torch threads can hang before the worker starts
    result = run_processes(_offload_worker, 1, start_method="spawn")[0]
    assert result == {"freed": True, "restored": True}


def test_transformer_config_drops_cuda_only_kernels_on_cpu():
    from megatron.core.transformer.enums import AttnBackend

    got = cpu_models.device_transformer_config(
        {"attention_backend": AttnBackend.fused, "moe_shared_expert_overlap": True, "num_layers": 3}
    )
    assert got["attention_backend"] is AttnBackend.local and got["use_cpu_initialization"] is True
    assert got["moe_shared_expert_overlap"] is False and got["gradient_accumulation_fusion"] is False
    assert got["num_layers"] == 3
