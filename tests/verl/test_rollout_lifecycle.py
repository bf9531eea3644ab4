"""verl series: the rollout lifecycle without vLLM sleep mode (rollout.lifecycle=manual,
verl/workers/rollout/rollout_lifecycle.py) and vLLM's external DP groups (rollout.data_parallel_size).

The order test drives verl's real ActorRolloutRefWorker.rollout_mode/trainer_mode and the real vLLMRollout's
resume/update_weights/release over the real VLLMManualEngine and vLLM's real EngineCore (our series'
free_kv_cache / reinit_kv_cache, with a stub executor for the devices, as the vLLM fork's
tests/v1/engine/test_kv_cache_configs.py does), and records every call.
The DP tests feed the derived environment to vLLM's own ParallelConfig and get_ip, and gather the rank table over
4 gloo ranks; the unit tests of the DP groups are the fork's tests/workers/rollout/test_dp_groups.py.

Left to the fork's tests/workers/test_worker_lifecycle.py: verl's own sleep-mode order through the same worker calls
(test_sleep_mode_keeps_verls_own_steps) and the refusal of calls out of the manual order
(test_the_manual_order_is_enforced)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from types import SimpleNamespace

import pytest

from tests import stack

os.environ.setdefault("VLLM_PLUGINS", "none")  # never let a platform plugin import torch_npu here
torch = stack.require("torch")

from omegaconf import OmegaConf  # noqa: E402

from tests.verl.conftest import require  # noqa: E402

lc = require("verl.workers.rollout.rollout_lifecycle")
dpg = require("verl.workers.rollout.vllm_rollout.dp_groups")
core_mod = stack.require("vllm.v1.engine.core", "vLLM (our fork) is not installed")
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

if not hasattr(core_mod.EngineCore, "reinit_kv_cache"):
    stack.missing("the installed vLLM lacks our series", stack.series("vllm"))


@pytest.fixture
def no_moe_loader_patch(monkeypatch):
    """verl's MoE weight-loader patch wants a vLLM model (with .model); the stand-ins have no experts (the real
    model takes it in tests/verl/test_megatron_vllm_load_gloo.py)."""
    import verl.utils.vllm.patch as vllm_patch

    monkeypatch.setattr(vllm_patch, "patch_vllm_moe_model_weight_loader", lambda model: None)


# ---------------------------------------------------------------- fakes that record


class StubExecutor:
    """One worker with one attention layer; the KV cache is 'present' between init and free."""

    def __init__(self, calls):
        self.calls, self.kv_present = calls, False

    def get_kv_cache_specs(self):
        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
        return [{"model.layers.0.self_attn": spec}]

    def determine_available_memory(self):
        return [8 << 20]

    def initialize_from_config(self, kv_cache_configs):
        self.kv_present = True

    def collective_rpc(self, method, args=()):
        self.calls.append(f"worker.{method}")
        self.kv_present = method == "initialize_from_config"
        return [8 << 20] if method == "free_kv_cache" else [None]  # our vLLM series: bytes released per worker


class StubScheduler:
    kv_cache_manager = SimpleNamespace(block_pool=SimpleNamespace(num_gpu_blocks=64))

    def get_num_unfinished_requests(self):
        return 0

    def reset_prefix_cache(self):
        return True


class TinyVLLMModel(torch.nn.Module):
    """Stands in for vLLM's model on the driver worker: real parameters, vLLM's load_weights shape."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls
        self.embed = torch.nn.Embedding(8, 4)
        self.proj = torch.nn.Linear(4, 4, bias=False)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        self.calls.append("model.load_weights")
        return loaded


class FakeTrainer:
    """Megatron's side: params can be on the device or not; records the lifecycle's calls."""

    def __init__(self, calls, weights):
        self.calls, self.weights, self.params_on_device = calls, weights, True

    def load_params(self):
        self.calls.append("trainer.load_params")
        self.params_on_device = True

    def offload_params(self):
        self.calls.append("trainer.offload_params")
        self.params_on_device = False

    def offload_grads(self):
        self.calls.append("trainer.offload_grads")


def vllm_config():
    return SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks_override=None, block_size=16),
        model_config=SimpleNamespace(max_model_len=64, dtype=torch.float32),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1),
    )


def fake_llm(calls):
    """An object with the attribute paths verl and VLLMManualEngine use on vLLM 0.11.0's LLM."""
    core = core_mod.EngineCore.__new__(core_mod.EngineCore)  # __init__ would build a model
    core.model_executor, core.scheduler = StubExecutor(calls), StubScheduler()
    core._initialize_kv_caches(vllm_config())
    model = TinyVLLMModel(calls)
    runner = SimpleNamespace(model=model, kv_caches=[torch.zeros(2, 4)])
    engine = SimpleNamespace(
        model_executor=SimpleNamespace(driver_worker=SimpleNamespace(worker=SimpleNamespace(model_runner=runner))),
        engine_core=SimpleNamespace(engine_core=core),
        vllm_config=vllm_config(),
    )
    return SimpleNamespace(
        llm_engine=engine,
        sleep=lambda level: calls.append(f"llm.sleep(level={level})"),
        wake_up=lambda tags=None: calls.append(f"llm.wake_up({tags})"),
        reset_prefix_cache=lambda: True,
    ), model, core


def vllm_rollout(llm, mode: str):
    """verl's vLLMRollout around an engine built elsewhere: __init__'s lifecycle hook, without the engine's build."""
    spmd = require("verl.workers.rollout.vllm_rollout.vllm_rollout_spmd")
    rollout = spmd.vLLMRollout.__new__(spmd.vLLMRollout)
    rollout.config = OmegaConf.create({"free_cache_engine": True, "lifecycle": mode})
    rollout.inference_engine, rollout.sleep_level = llm, 1
    rollout.lifecycle = lc.manual_lifecycle(llm, lc.lifecycle_mode(rollout.config))
    return rollout


def megatron_workers():
    """Imported where used: the gloo test's spawned ranks import this module too, and need none of it."""
    return require("verl.workers.megatron_workers")


def megatron_worker(monkeypatch, rollout, trainer, calls):
    """verl's ActorRolloutRefWorker without its process groups (param_offload on); Megatron's offload helpers
    become the fake trainer's (what they move is tested below), and the weight source is faked."""
    mw = megatron_workers()
    monkeypatch.setattr(mw, "load_megatron_model_to_gpu", lambda models, load_grad=True: trainer.load_params())
    monkeypatch.setattr(mw, "offload_megatron_model_to_cpu", lambda models: trainer.offload_params())
    monkeypatch.setattr(lc, "offload_megatron_grads", lambda models: trainer.offload_grads())
    worker = mw.ActorRolloutRefWorker.__new__(mw.ActorRolloutRefWorker)
    worker.config = OmegaConf.create({"rollout": rollout.config})
    worker.rollout, worker.bridge, worker._is_offload_param = rollout, None, True
    worker.actor = SimpleNamespace(actor_module=[])
    worker.actor_module = worker.actor.actor_module
    worker.actor_model_config = worker.weight_converter = worker.tf_config = worker.layer_name_mapping = None
    worker.gen_random_states = worker.torch_random_states = torch.get_rng_state()
    model = llm_model(rollout.inference_engine)

    def weight_generator(*_):
        calls.append("reshard")
        assert trainer.params_on_device, "the reshard reads the Megatron params: they must still be on the device"
        assert all(p.numel() for p in model.parameters()), "the reshard writes into onloaded buffers"
        yield from trainer.weights.items()

    worker.weight_generator = weight_generator
    return worker


def llm_model(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


# ---------------------------------------------------------------- the order of a step


def test_manual_step_order_on_a_fake_engine(monkeypatch, no_moe_loader_patch):
    calls = []
    llm, model, core = fake_llm(calls)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    trainer = FakeTrainer(calls, {n: torch.full(s, 3.0) for n, s in shapes.items()})
    for owner, name in ((lc.VLLMManualEngine, "onload_weights"), (lc.VLLMManualEngine, "offload_weights"),
                        (lc, "post_process_attention")):
        monkeypatch.setattr(owner, name, _recorded(getattr(owner, name), calls, f"engine.{name}"))

    worker = megatron_worker(monkeypatch, vllm_rollout(llm, "manual"), trainer, calls)
    asyncio.run(worker.trainer_mode())  # what _build_rollout ends in
    assert all(p.numel() == 0 for p in model.parameters()) and not core.model_executor.kv_present
    calls.append("--- rollout")
    asyncio.run(worker.rollout_mode())
    assert core.model_executor.kv_present and worker.rollout.lifecycle.state == "rollout"
    assert all(torch.equal(p, torch.full(shapes[n], 3.0)) for n, p in model.named_parameters())
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    asyncio.run(worker.trainer_mode())
    calls.append("--- update")
    worker.lifecycle.offload_actor_after_update()  # update_actor's hook, with param_offload

    assert calls == [
        "worker.free_kv_cache", "engine.offload_weights",  # park after the engine is built
        "--- rollout",
        "trainer.load_params", "engine.onload_weights", "reshard", "model.load_weights",
        "engine.post_process_attention", "trainer.offload_params", "worker.initialize_from_config",
        "worker.free_kv_cache", "engine.offload_weights",
        "--- update",
        "trainer.offload_grads",
    ]
    assert all(p.numel() == 0 for p in model.parameters()) and not core.model_executor.kv_present


def _recorded(fn, calls, label):
    def wrapper(*args, **kwargs):
        calls.append(label)
        return fn(*args, **kwargs)

    return wrapper


def test_manual_onload_makes_fresh_buffers_without_host_copies():
    calls = []
    llm, model, _ = fake_llm(calls)
    engine = lc.VLLMManualEngine(llm)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    engine.offload_weights()
    engine.onload_weights()
    assert all(p.shape != torch.Size([0]) for p in model.parameters())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} != before, "onload allocates new buffers"


def test_mla_post_processing_reaches_every_attention_layer():
    from vllm.attention.layer import Attention

    done = []

    def attention():
        layer = Attention.__new__(Attention)  # Attention.__init__ needs a vLLM config and a backend
        torch.nn.Module.__init__(layer)
        layer.impl, layer.backend = SimpleNamespace(process_weights_after_loading=done.append), None  # 0.11 reads it
        return layer

    model = torch.nn.ModuleDict({"a": attention(), "mlp": torch.nn.Linear(2, 2), "b": attention()})
    assert lc.post_process_attention(model, torch.bfloat16) == 2 and done == [torch.bfloat16, torch.bfloat16]


class TinyMLAModel(torch.nn.Module):
    """kv_b_proj and an attention layer whose impl is vLLM's own MLACommonImpl (GPU path), so that
    W_UK_T / W_UV are derived by vLLM's code: views of kv_b_proj's weight."""

    LORA, HEADS, NOPE, V = 8, 2, 4, 4

    def __init__(self):
        from vllm.attention.layer import Attention
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.v1.attention.backends.mla.common import MLACommonImpl

        super().__init__()
        self.kv_b_proj = torch.nn.Linear(self.LORA, self.HEADS * (self.NOPE + self.V), bias=False)
        self.kv_b_proj.quant_method = UnquantizedLinearMethod()
        class DecodeLess(MLACommonImpl):  # the abstract decode kernel is not used here
            def _forward_decode(self, *args):
                raise NotImplementedError

        impl = DecodeLess.__new__(DecodeLess)  # __init__ needs a backend and a vLLM config
        impl.kv_b_proj, impl.kv_lora_rank, impl.num_heads = self.kv_b_proj, self.LORA, self.HEADS
        impl.qk_nope_head_dim, impl.v_head_dim = self.NOPE, self.V
        self.attn = Attention.__new__(Attention)  # Attention.__init__ needs a vLLM config
        torch.nn.Module.__init__(self.attn)
        self.attn.impl, self.attn.backend = impl, None  # vLLM 0.11 reads backend after the impl's post-processing

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)
        return set(params)

    def expected_w_uv(self, weight):
        w = weight.T.view(self.LORA, self.HEADS, self.NOPE + self.V)
        return w[..., self.NOPE:].transpose(0, 1)


@pytest.fixture
def mla_common(monkeypatch):
    """vLLM's GPU MLA module, importable on the CPU build: it imports a flash-attention kernel at module level
    (which the CPU wheel does not carry) that the weight post-processing never calls."""
    import types

    try:
        import vllm.vllm_flash_attn  # noqa: F401
    except ImportError:
        stub = types.ModuleType("vllm.vllm_flash_attn")
        stub.flash_attn_varlen_func = None  # not reached: only process_weights_after_loading runs here
        monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", stub)


def test_mla_derivatives_are_released_with_the_weights_and_derived_from_the_new_ones(mla_common,
                                                                                     no_moe_loader_patch):
    calls = []
    llm, _, _ = fake_llm(calls)
    model = TinyMLAModel()
    llm.llm_engine.model_executor.driver_worker.worker.model_runner.model = model
    engine = lc.VLLMManualEngine(llm)
    engine.load_weights([("kv_b_proj.weight", torch.randn(16, 8))])
    old = model.kv_b_proj.weight.detach().clone()
    assert torch.equal(model.attn.impl.W_UV, model.expected_w_uv(old))

    engine.offload_weights()
    assert model.kv_b_proj.weight.numel() == 0
    assert model.attn.impl.W_UV.numel() == model.attn.impl.W_UK_T.numel() == 0, "views would pin kv_b_proj"

    engine.onload_weights()
    new = torch.randn(16, 8)
    engine.load_weights([("kv_b_proj.weight", new)])
    assert torch.equal(model.attn.impl.W_UV, model.expected_w_uv(new)), "MLA must use the updated weights"
    assert not torch.equal(model.attn.impl.W_UV, model.expected_w_uv(old))


# ---------------------------------------------------------------- refusals


def test_unknown_lifecycle_is_refused_with_the_key_and_the_choices():
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.lifecycle='sleeep'.*sleep, manual"):
        lc.lifecycle_mode({"lifecycle": "sleeep"})


def test_each_step_of_the_order_is_timed():
    class SlowEngine:
        def __getattr__(self, name):  # every RolloutEngine call takes 10 ms
            return lambda *a: time.sleep(0.01)

    lifecycle = lc.RolloutLifecycle(SlowEngine())
    lifecycle.release()
    lifecycle.resume(["weights"])
    lifecycle.update_weights(iter(()))
    lifecycle.resume(["kv_cache"])
    steps = ("onload", "reshard", "init_kv_cache", "free_kv_cache", "offload_weights")
    assert sorted(lifecycle.seconds) == sorted(steps)  # the Megatron offload is the worker's now, not timed here
    assert all(lifecycle.seconds[s] >= 0.01 for s in steps)


def test_manual_needs_the_in_process_engine_core():
    calls = []
    llm, _, _ = fake_llm(calls)
    llm.llm_engine.engine_core = SimpleNamespace()  # a multiprocess client holds no EngineCore
    with pytest.raises(RuntimeError, match="lifecycle=manual needs vLLM's in-process EngineCore"):
        lc.VLLMManualEngine(llm).free_kv_cache()


# ---------------------------------------------------------------- DP groups


def rank_table(nodes: int, per_node: int) -> list[str]:
    return [f"10.0.{n // 250}.{n % 250 + 1}" for n in range(nodes) for _ in range(per_node)]


def test_vllm_reads_the_derived_environment_and_never_probes_the_network(monkeypatch):
    from vllm.config import ParallelConfig
    from vllm.utils import get_ip

    ips = rank_table(4, 4)
    env = dpg.dp_env(13, ips, tp=2, dp=4)  # instance 1 = ranks 8..15: rank 13 is DP rank 2, TP rank 1
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def no_connect(*_):
        raise AssertionError("vLLM connected out to find its address")

    monkeypatch.setattr(socket.socket, "connect", no_connect)
    assert get_ip() == ips[13]
    config = ParallelConfig(tensor_parallel_size=2)  # data_parallel_size left at 1: vLLM reads VLLM_DP_*
    assert (config.data_parallel_size, config.data_parallel_rank) == (4, 2)
    master = (config.data_parallel_master_ip, config.data_parallel_master_port)
    assert master == (ips[9], dpg.DEFAULT_BASE_PORT + 3 * dpg.PORT_STRIDE)  # group 3: instance 1, TP rank 1


# ---------------------------------------------------------------- trainer side and config


def fake_ddp_chunk(numel: int):
    """A Megatron DDP chunk with one param/grad buffer (DDP.__init__ allocates on the accelerator)."""
    from megatron.core.distributed import DistributedDataParallel as DDP

    chunk = DDP.__new__(DDP)
    torch.nn.Module.__init__(chunk)
    chunk.buffers = [SimpleNamespace(param_data=torch.arange(numel, dtype=torch.float32), grad_data=torch.ones(numel))]
    bf16 = dict(dtype=torch.bfloat16)
    chunk.expert_parallel_buffers = [SimpleNamespace(param_data=torch.ones(3, **bf16), grad_data=torch.ones(3, **bf16))]
    return chunk


def test_after_update_offloads_grads_only_and_verl_reloads_them():
    from verl.utils.megatron_utils import load_megatron_model_to_gpu

    chunks = [fake_ddp_chunk(10)]
    lc.worker_lifecycle(SimpleNamespace(lifecycle=object()), chunks).offload_actor_after_update()
    buffers = [*chunks[0].buffers, *chunks[0].expert_parallel_buffers]
    assert all(b.grad_data.untyped_storage().size() == 0 for b in buffers), "grads released"
    assert torch.equal(buffers[0].param_data, torch.arange(10, dtype=torch.float32)), "params kept for the reshard"
    load_megatron_model_to_gpu(chunks)  # update_actor's reload: verl's helper must find the sizes it needs
    assert [b.grad_data.numel() for b in buffers] == [10, 3] and all(not b.grad_data.any() for b in buffers)


@pytest.mark.parametrize("param_offload", [False, True])
def test_update_actor_offloads_the_grads_only_with_param_offload(param_offload):
    """verl reloads grads only with param_offload, so only then may the update release them."""
    from verl import DataProto

    chunks = [fake_ddp_chunk(4)]
    buffers = [*chunks[0].buffers, *chunks[0].expert_parallel_buffers]
    for b in buffers:
        b.grad_data_size = b.grad_data.numel()  # as init_model's offload leaves them
    mw = megatron_workers()
    worker = mw.ActorRolloutRefWorker.__new__(mw.ActorRolloutRefWorker)
    worker.config = OmegaConf.create({"actor": {"ppo_micro_batch_size_per_gpu": 1, "ppo_epochs": 1}})
    worker._is_actor = worker._is_rollout = True
    worker._is_offload_param, worker._is_offload_optimizer, worker._world_size = param_offload, False, 1
    worker.actor_module, worker.rollout = chunks, SimpleNamespace(lifecycle=object())  # a manual-lifecycle rollout
    worker.actor = SimpleNamespace(make_minibatch_iterator=lambda data: [], update_policy=lambda dataloader: {})
    worker.flops_counter = SimpleNamespace(estimate_flops=lambda tokens, seconds: (0.0, 1.0))
    worker.actor_optimizer = SimpleNamespace(param_groups=[{"lr": 1.0}])
    worker.actor_optimizer_scheduler = SimpleNamespace(step=lambda increment: None)
    worker.update_actor(DataProto(meta_info={"global_token_num": [1]}))
    assert all((b.grad_data.untyped_storage().size() == 0) == param_offload for b in buffers)
    assert torch.equal(buffers[0].param_data, torch.arange(4, dtype=torch.float32)), "params kept for the reshard"


def test_the_megatron_config_defaults_to_sleep_and_fsdp_refuses_manual():
    # the Megatron trainer's config as hydra composes it
    yaml = os.path.join(os.path.dirname(lc.__file__), "../../trainer/config/_generated_ppo_megatron_trainer.yaml")
    rollout = OmegaConf.load(yaml).actor_rollout_ref.rollout
    OmegaConf.set_struct(rollout, True)
    assert lc.lifecycle_mode(rollout) == "sleep" and rollout.data_parallel_size == 1
    rollout.lifecycle = "manual"
    assert lc.lifecycle_mode(rollout) == "manual"
    with pytest.raises(ValueError, match="lifecycle=manual is wired for the Megatron worker .* not for the FSDP"):
        lc.require_sleep_mode(rollout, "the FSDP worker")
    lc.require_sleep_mode(OmegaConf.create({}), "the FSDP worker")  # absent key: verl's default


def _apply_dp_env_worker(rank, port, base_port, results):
    import torch.distributed as dist

    os.environ["VLLM_HOST_IP"] = f"10.0.0.{rank // 2 + 1}"  # two ranks per "node"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    try:
        config = {"data_parallel_size": 2, "tensor_model_parallel_size": 1, "dp_master_port": base_port}
        results[rank] = dpg.apply_dp_env(config, rank, 4)
        assert os.environ["VLLM_DP_MASTER_IP"] == results[rank]["VLLM_DP_MASTER_IP"]
    finally:
        dist.destroy_process_group()


def test_apply_dp_env_gathers_the_rank_table_over_the_world():
    from tests.gloo import free_port, run_processes

    base = free_port()  # a port free here; the masters' check binds it on this machine
    envs = run_processes(_apply_dp_env_worker, 4, base)
    assert [envs[r]["VLLM_DP_MASTER_IP"] for r in range(4)] == ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2"]
    assert [int(envs[r]["VLLM_DP_MASTER_PORT"]) for r in range(4)] == [base, base, base + 16, base + 16]  # tp=1
    assert [envs[r]["VLLM_DP_RANK"] for r in range(4)] == ["0", "1", "0", "1"]
    assert dpg.apply_dp_env({}, 0, 1) == {}, "data_parallel_size 1 leaves vLLM's environment alone"
