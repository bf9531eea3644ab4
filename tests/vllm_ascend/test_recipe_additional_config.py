"""The A3 profiles' vLLM-Ascend settings reach the engine: recipe -> launcher -> verl -> vllm.LLM -> vLLM-Ascend.

(a) Each A3 profile goes through the launcher's own code (config.load, config.verl_config) to the verl config the
    trainer gets; verl's real vLLMRollout (verl 0.6.1's spmd one, with vLLM 0.11.0) is built as the Megatron
    worker's _build_rollout builds it: RolloutConfig from the rollout block (omega_conf_to_dataclass), a model
    config (a stand-in with what the constructor reads of HFModelConfig: local_path, tokenizer, hf_config from the
    profile's model dims, trust_remote_code, lora_rank) and no device mesh (the constructor does not read it).
    Stubbed: only the engine, i.e. `vllm.LLM` in the verl module's namespace is a recorder of its keyword
    arguments (and of any `sleep`: the 0.6.1 constructor calls none). The constructor's distributed calls,
    get_world_size and get_rank (verl asserts rollout TP <= world), are answered by a real 2-rank gloo group (TP2).
    It runs in spawned processes, away from this directory's torch_npu stubs. The profiles' prefill budget is 4096
    (= max_model_len): the reference's 1024 is refused at our pins by verl 0.6.1's constructor and by vLLM-Ascend
    0.11.0's ascend scheduler (both shown below; recipes/deepseek_r1/README.md).
(b) The recorded keyword arguments are fed to vLLM-Ascend 0.11.0's own code, from the fork's tree with the device
    modules stubbed (conftest): AscendConfig and check_ascend_config on a stand-in of the engine's VllmConfig
    (engine_config: the parts they read, from verl's arguments), the graph batch sizes of the torchair model
    runner (NPUTorchairModelRunner.update_torchair_graph_batch_sizes, on a runner built without __init__, which
    needs a device; the SoC version is an A3's, through the stubbed torch_npu), and
    AscendSchedulerConfig.initialize_from_config on vLLM's real SchedulerConfig.
(c) Our dp_sync hook reads the switch through get_ascend_config(); torch.distributed.all_reduce is replaced by a
    recorder of the group it is given (no collective runs), the DP coordinator is a namespace of two groups.
Plus: the launcher's lists of known keys (tools/launch/config.py) equal what the fork's source reads.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import stack
from tests.gloo import run_processes
from tests.vllm_ascend.conftest import TREE
from tools.launch import config

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "deepseek_r1" / "configs"
A3 = ("a3-128-true-weight", "a3-128-random-init")
REFERENCE_BUDGET = "actor_rollout_ref.rollout.max_num_batched_tokens=1024"  # the reference's; see the docstring
# The profiles' checkpoint is DeepSeek-V3/R1 (recipe.model_dims: ../model/deepseek-v3.yaml); its config.json's
# model_type, which check_ascend_config holds against the model types torchair graph mode supports.
MODEL_TYPE = "deepseek_v3"
# torch_npu.npu.get_soc_version() on an A3 die: vllm_ascend/utils.py:init_ascend_soc_version maps 250-255 to A3
A3_SOC_VERSION = 250


def build_rollout(name: str, overrides: list[str]) -> dict:
    """verl's vLLMRollout from the profile, with vllm.LLM recording its keyword arguments."""
    from unittest import mock

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.vllm_rollout import vllm_rollout_spmd as spmd

    # vLLM DP needs the rank table of a real cluster and the manual lifecycle parks a real engine (both in
    # tests/verl/test_rollout_lifecycle.py); this test is about what reaches the engine's constructor
    recipe = config.load(CONFIGS / f"{name}.yaml", [*overrides, "actor_rollout_ref.rollout.data_parallel_size=1",
                                                    "actor_rollout_ref.rollout.lifecycle=sleep"])
    # as the Megatron worker's _build_rollout does: the rollout block as verl's RolloutConfig
    rollout_cfg = omega_conf_to_dataclass(config.verl_config(recipe.cfg, config.verl_base()).actor_rollout_ref.rollout)
    assert isinstance(rollout_cfg, RolloutConfig)
    dims, _ = config.model_dims(recipe)
    # HFModelConfig loads the checkpoint's config and tokenizer from its path in __post_init__; BaseRollout passes
    # an object through (omega_conf_to_dataclass), so a stand-in with what the constructor reads of it
    model_cfg = SimpleNamespace(local_path="/models/dsv3", tokenizer=SimpleNamespace(pad_token_id=0),
                                hf_config=SimpleNamespace(**dims), trust_remote_code=True, lora_rank=0)
    calls = []

    class EngineRecorder:
        def __init__(self, **kwargs):
            calls.append(kwargs)

        def sleep(self, level):
            calls[-1]["sleep(level)"] = level

        def generate(self, *args, **kwargs):  # vLLMRollout binds it (rebalance.rollout_generate); never called here
            raise AssertionError("the engine is only built in this test")

    with mock.patch.object(spmd, "LLM", EngineRecorder):
        # the constructor does not read device_mesh (BaseRollout only keeps it)
        spmd.vLLMRollout(config=rollout_cfg, model_config=model_cfg, device_mesh=None)
    assert len(calls) == 1
    return calls[0]


def rollout_worker(rank, port, world, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        if rank == 0:  # one engine is enough to see what verl hands it; the other ranks only make the world
            out = {name: build_rollout(name, []) for name in A3}
            try:
                build_rollout(A3[0], [REFERENCE_BUDGET])
                out["as-is"] = "constructed"
            except ValueError as exc:
                out["as-is"] = str(exc)
            results[rank] = out
        else:
            results[rank] = None
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def engine_kwargs():
    for module in ("verl", "vllm"):
        stack.require(module)
    tp = {config.value(config.load(CONFIGS / f"{n}.yaml").cfg, "actor_rollout_ref.rollout.tensor_model_parallel_size")
          for n in A3}
    assert tp == {2}, f"the profiles' rollout TP changed ({tp}): adjust the world below"
    # A spawned child starts from this sys.path; while the va fixture has put the fork's tree first, its own
    # tests/ package would shadow ours there.
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if p != str(TREE)]
    try:
        return run_processes(rollout_worker, 2, 2)[0]
    finally:
        sys.path[:] = saved


def profile_additional_config(name: str) -> dict:
    return config.value(config.load(CONFIGS / f"{name}.yaml").cfg, config.ADDITIONAL_CONFIG)


@pytest.mark.parametrize("name", A3)
def test_verl_hands_the_profiles_additional_config_to_the_engine(engine_kwargs, name):
    kwargs = engine_kwargs[name]
    assert kwargs["additional_config"] == profile_additional_config(name)
    assert kwargs["max_num_seqs"] == 64, "verl passes max_num_seqs=rollout.max_num_seqs (the profile's 64)"
    assert kwargs["enforce_eager"] is False and kwargs["tensor_parallel_size"] == 2
    # lifecycle=sleep with free_cache_engine: the engine gets sleep mode; the constructor no longer sends it to
    # sleep (the worker's trainer_mode does, through release())
    assert kwargs["enable_sleep_mode"] is True
    assert "sleep(level)" not in kwargs


def test_the_reference_token_budget_is_refused_by_verl(engine_kwargs):
    """Why the profiles use 4096: with the reference's 1024 verl 0.6.1 stops in its constructor (chunked prefill)."""
    assert "max_num_batched_tokens is smaller than max_model_len" in engine_kwargs["as-is"]


def engine_config(kwargs: dict) -> SimpleNamespace:
    """The engine's VllmConfig as far as vLLM-Ascend 0.11.0's AscendConfig (with its TorchairGraphConfig) and
    check_ascend_config read it, from verl's keyword arguments: additional_config; parallel_config's TP and EP
    (read for enable_shared_expert_dp, lmhead/oproj TP and enable_super_kernel); kv_transfer_config, None since
    verl passes none (no prefill/decode disaggregation); model_config's hf_config.model_type. vLLM's real
    VllmConfig would load the checkpoint's config.json from the model path."""
    return SimpleNamespace(
        additional_config=kwargs["additional_config"],
        parallel_config=SimpleNamespace(tensor_parallel_size=kwargs["tensor_parallel_size"],
                                        enable_expert_parallel=kwargs["enable_expert_parallel"]),
        kv_transfer_config=kwargs.get("kv_transfer_config"),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type=MODEL_TYPE)))


@pytest.mark.parametrize("name", A3)
def test_vllm_ascend_reads_the_profiles_settings(va, engine_kwargs, name):
    ascend_config = va("vllm_ascend.ascend_config")
    kwargs = engine_kwargs[name]
    ac = ascend_config.AscendConfig(engine_config(kwargs))
    graph = ac.torchair_graph_config
    assert graph.enabled is True
    assert graph.graph_batch_sizes == [kwargs["max_num_seqs"]] == [64]
    assert graph.enable_kv_nz is True
    assert graph.enable_multistream_mla is True and ac.multistream_overlap_shared_expert is True
    assert graph.enable_view_optimize is False
    assert ac.ascend_scheduler_config.enabled is True
    assert ac.dp_sync_on_device is True
    # the engine's own check of graph mode against eager mode and the model type, with what verl passed
    ascend_config.init_ascend_config(engine_config(kwargs))
    try:
        ascend_config.check_ascend_config(engine_config(kwargs), kwargs["enforce_eager"])
        assert ascend_config.get_ascend_config().torchair_graph_config.enabled is True
    finally:
        ascend_config.clear_ascend_config()


def captured_sizes(tmr, kwargs, graph_batch_sizes, max_num_seqs) -> list[int]:
    """NPUTorchairModelRunner.update_torchair_graph_batch_sizes (its __init__ calls it; the platform picks the
    torchair worker and runner when torchair graph mode is on) on a runner given only what it reads there: TP and
    EP as verl passes them (EP on: on A3 the sizes are aligned to TP), no speculative decoding and no KV transfer
    (one token per request per decode step), the runner's max_num_reqs the scheduler's max_num_seqs."""
    runner = tmr.NPUTorchairModelRunner.__new__(tmr.NPUTorchairModelRunner)
    runner.torchair_graph_batch_sizes = list(graph_batch_sizes)
    runner.is_kv_consumer, runner.speculative_config = False, None
    runner.decode_token_per_req, runner.max_num_reqs = 1, max_num_seqs
    runner.parallel_config = SimpleNamespace(tensor_parallel_size=kwargs["tensor_parallel_size"],
                                             enable_expert_parallel=kwargs["enable_expert_parallel"])
    runner.scheduler_config = SimpleNamespace(max_num_batched_tokens=kwargs["max_num_batched_tokens"],
                                              max_num_seqs=max_num_seqs)
    runner.update_torchair_graph_batch_sizes()
    assert runner.max_num_reqs == runner.scheduler_config.max_num_seqs == max_num_seqs, "no size was re-aligned"
    return runner.torchair_graph_batch_sizes


@pytest.mark.parametrize("name", A3)
def test_the_engine_captures_one_graph_of_max_num_seqs(va, monkeypatch, engine_kwargs, name):
    utils = va("vllm_ascend.utils")
    tmr = va("vllm_ascend.torchair.torchair_model_runner")
    # as NPUWorker.__init__ does (init_ascend_soc_version), with the stubbed torch_npu answering an A3's version
    monkeypatch.setattr(utils, "_ascend_soc_version", None)
    monkeypatch.setattr(utils.torch_npu.npu, "get_soc_version", lambda: A3_SOC_VERSION)
    utils.init_ascend_soc_version()
    assert utils.get_ascend_soc_version() is utils.AscendSocVersion.A3
    kwargs = engine_kwargs[name]
    sizes = kwargs["additional_config"]["torchair_graph_config"]["graph_batch_sizes"]
    assert captured_sizes(tmr, kwargs, sizes, kwargs["max_num_seqs"]) == [64]
    # with vLLM's default max_num_seqs 256 (no rollout.max_num_seqs) the engine captures a second graph; 256:
    # EngineArgs._set_default_args for the LLM class, as NPUPlatform reports no get_device_total_memory
    assert captured_sizes(tmr, kwargs, sizes, 256) == [64, 256]


@pytest.mark.parametrize("name", A3)
def test_the_ascend_scheduler_keeps_prefill_and_decode_apart(va, engine_kwargs, name):
    from vllm.config import SchedulerConfig

    ascend_config = va("vllm_ascend.ascend_config")
    schedule_config = va("vllm_ascend.core.schedule_config")
    kwargs = engine_kwargs[name]
    ac = ascend_config.AscendConfig(engine_config(kwargs))

    def scheduler(budget):
        vllm_scheduler = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=kwargs["max_num_seqs"],
                                         max_model_len=kwargs["max_model_len"],
                                         enable_chunked_prefill=kwargs["enable_chunked_prefill"])
        return schedule_config.AscendSchedulerConfig.initialize_from_config(vllm_scheduler,
                                                                           ac.ascend_scheduler_config)

    chosen = scheduler(kwargs["max_num_batched_tokens"])
    assert chosen.scheduler_cls == "vllm_ascend.core.scheduler.AscendScheduler"
    assert chosen.chunked_prefill_enabled is False, "no chunked prefill: prefill steps and decode steps apart"
    assert (chosen.max_num_seqs, chosen.max_num_batched_tokens) == (64, 4096)
    # the reference's budget (1024 < max_model_len 4096) is refused at this pin: AscendSchedulerConfig.__post_init__
    # (vllm_ascend/core/schedule_config.py) without chunked prefill (vLLM-Ascend #2327)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(1024\) is smaller than max_model_len"):
        scheduler(1024)


def unfinished_check_group(va, monkeypatch, vllm_config) -> list[str]:
    """Which group LLMEngine's unfinished-requests check (our hook) all-reduces on."""
    import torch
    import torch.distributed as dist
    import vllm.distributed.parallel_state as ps

    ascend_config = va("vllm_ascend.ascend_config")
    dp_sync = va("vllm_ascend.distributed.dp_sync")
    cpu_group, device_group = object(), object()
    used = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None, async_op=False: used.append(
        {id(cpu_group): "cpu", id(device_group): "device"}[id(group)]))
    monkeypatch.setattr(ps, "_DP", SimpleNamespace(cpu_group=cpu_group, device_group=device_group,
                                                   device=torch.device("cpu")))
    # refresh: replace whatever AscendConfig an earlier test left (verl's additional_config carries it too)
    vllm_config.additional_config = {**vllm_config.additional_config, "refresh": True}
    ascend_config.init_ascend_config(vllm_config)
    try:
        dp_sync.llm_engine_has_unfinished_requests_dp(SimpleNamespace(dp_group=cpu_group), True)
    finally:
        ascend_config.clear_ascend_config()
    return used


@pytest.mark.parametrize("name", A3)
def test_dp_sync_runs_on_the_device_group_with_the_profile(va, monkeypatch, engine_kwargs, name):
    kwargs = engine_kwargs[name]
    assert unfinished_check_group(va, monkeypatch, engine_config(kwargs)) == ["device"]
    default = engine_config({**kwargs, "additional_config": {}})
    assert unfinished_check_group(va, monkeypatch, default) == ["cpu"], "vLLM-Ascend's default: gloo"


def keys_read(tree: ast.Module, owner: str, mapping: str) -> set[str]:
    """The string keys `owner` (a class or function of ascend_config.py) reads with `<mapping>.get("key", ...)`."""
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef | ast.FunctionDef) and n.name == owner)
    return {call.args[0].value for call in ast.walk(node)
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "get"
            and isinstance(call.func.value, ast.Name) and call.func.value.id == mapping
            and call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)}


def additional_config_keys(package: Path) -> set[str]:
    """The string keys any module of the package reads with `<...>additional_config.get("key", ...)`: AscendConfig's,
    and those the platform and the model runner read themselves (kv_cache_dtype)."""
    keys = set()
    for source in package.rglob("*.py"):
        for call in ast.walk(ast.parse(source.read_text())):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "get"
                    and call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)):
                continue
            owner = call.func.value
            if getattr(owner, "id", None) == "additional_config" or getattr(owner, "attr", None) == "additional_config":
                keys.add(call.args[0].value)
    return keys


def test_the_launchers_known_keys_are_the_ones_vllm_ascend_reads(va):
    source = TREE / "vllm_ascend" / "ascend_config.py"
    tree = ast.parse(source.read_text())
    assert set(config.ASCEND_CONFIG_KEYS) == additional_config_keys(TREE / "vllm_ascend")
    assert set(config.TorchairGraph.__dataclass_fields__) == keys_read(tree, "TorchairGraphConfig",
                                                                       "torchair_graph_config")
    assert keys_read(tree, "AscendSchedulerConfig", "ascend_scheduler_config") == {"enabled"}
    schedule_config = va("vllm_ascend.core.schedule_config")
    scheduler_fields = {f.name for f in dataclasses.fields(schedule_config.AscendSchedulerConfig) if f.init}
    assert set(config.ASCEND_SCHEDULER_KEYS) == {"enabled"} | scheduler_fields
    # and the launcher's defaults are vLLM-Ascend's
    defaults = vars(va("vllm_ascend.ascend_config").TorchairGraphConfig({}, None, {}))
    ours = dataclasses.asdict(config.TorchairGraph())
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in ours.items()} == defaults
