"""vLLM-Ascend series: per-step DP synchronisation on the DP device group behind
additional_config "dp_sync_on_device" (vllm_ascend/distributed/dp_sync.py and its hooks).

The all-reduces are real: two processes on gloo. There is no HCCL here, so the coordinator's
"device group" is a second gloo group, and torch.distributed.all_reduce is wrapped to record
which of the two groups each call used. The runner under test is the patched
NPUModelRunner._get_forward_metadata_across_dp on a runner built without __init__ (no device)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from tests.vllm_ascend.conftest import run_forked

WORLD = 2


def coordinator_and_spy(rank, port):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    cpu_group = dist.new_group(backend="gloo")
    device_group = dist.new_group(backend="gloo")  # stands in for the HCCL group
    coordinator = SimpleNamespace(cpu_group=cpu_group, device_group=device_group, device=torch.device("cpu"),
                                  rank_in_group=rank, world_size=WORLD)
    used = []
    real_all_reduce = dist.all_reduce

    def spy(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        used.append({id(cpu_group): "cpu", id(device_group): "device"}.get(id(group), "other"))
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = spy
    return coordinator, used


def make_runner(mr, rank, on_device, torchair):
    runner = mr.NPUModelRunner.__new__(mr.NPUModelRunner)
    runner.dp_size, runner.dp_rank = WORLD, rank
    runner.dp_sync_on_device = on_device
    runner.is_kv_producer = runner.is_kv_consumer = False
    runner.torchair_graph_enabled = torchair
    runner.torchair_graph_batch_sizes = [4, 8]
    runner.in_profile_run = False
    return runner


# Per rank: (maybe_padded_num_tokens, num_tokens, with_prefill, enable_dbo) as _process_reqs /
# _dummy_run pass them. Rank 1 is idle in the decode case: it runs the dummy batch of 1 token
# (padded to the smallest graph size 4), while rank 0 decodes 5 requests (padded to 8).
CASES = {
    "decode, rank 1 idle (dummy batch)": ([(8, 5, False, False), (4, 1, False, False)], True),
    "rank 0 prefills, rank 1 decodes": ([(100, 100, True, False), (8, 3, False, False)], True),
    "eager, both decode": ([(5, 5, False, False), (2, 2, False, False)], False),
}


def dp_worker(rank, port, results):
    import torch

    mr = sys.modules["vllm_ascend.worker.model_runner_v1"]
    dp_sync = sys.modules["vllm_ascend.distributed.dp_sync"]
    coordinator, used = coordinator_and_spy(rank, port)
    mr.get_dp_group = lambda: coordinator
    out = {}
    for name, (args, torchair) in CASES.items():
        for on_device in (False, True):
            del used[:]
            runner = make_runner(mr, rank, on_device, torchair)
            padded, across, with_prefill, dbo = runner._get_forward_metadata_across_dp(*args[rank])
            out[(name, on_device)] = (padded, tuple(across.tolist()), with_prefill, dbo, across.device.type, list(used))

    # The LLMEngine's unfinished-requests check: rank 0 has requests, rank 1 has none.
    import vllm.distributed.parallel_state as ps
    from vllm_ascend import ascend_config

    engine = SimpleNamespace(dp_group=coordinator.cpu_group, should_execute_dummy_batch=False)
    for on_device, workers_here in ((False, True), (True, True), (True, False)):
        ascend_config.init_ascend_config(
            SimpleNamespace(additional_config={"dp_sync_on_device": on_device, "refresh": True}))
        ps._DP = coordinator if workers_here else None
        engine.should_execute_dummy_batch = False
        del used[:]
        aggregated = dp_sync.llm_engine_has_unfinished_requests_dp(engine, rank == 0)
        out[("engine", on_device, workers_here)] = (aggregated, engine.should_execute_dummy_batch, list(used))
    ps._DP = None
    results[rank] = out
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def dp_results(va):
    va("vllm_ascend.worker.model_runner_v1")
    va("vllm_ascend.distributed.dp_sync")
    return run_forked(dp_worker, WORLD)


def test_forward_metadata_uses_the_device_group_only_when_switched_on(dp_results):
    for rank in range(WORLD):
        for name in CASES:
            assert dp_results[rank][(name, False)][-1] == ["cpu"], name
            assert dp_results[rank][(name, True)][-1] == ["device"], name


def test_forward_metadata_is_the_same_on_either_group_and_on_every_rank(dp_results):
    for name in CASES:
        results = {dp_results[rank][(name, on)][:5] for rank in range(WORLD) for on in (False, True)}
        padded_per_rank = {dp_results[rank][(name, True)][0] for rank in range(WORLD)}
        assert len({r[1:] for r in results}) == 1, f"{name}: ranks or groups disagree: {results}"
        if name.startswith("decode"):
            assert padded_per_rank == {8}, "graph mode pads every rank to the largest batch"
    decode = dp_results[1][("decode, rank 1 idle (dummy batch)", True)]
    assert decode[:5] == (8, (8, 8), False, False, "cpu")
    mixed = dp_results[1][("rank 0 prefills, rank 1 decodes", True)]
    assert mixed[:5] == (3, (100, 3), True, False, "cpu"), "a prefill anywhere undoes the decode padding"
    eager = dp_results[0][("eager, both decode", True)]
    assert eager[:5] == (5, (5, 2), False, False, "cpu")


def test_unfinished_check_follows_the_switch_and_idle_ranks_run_a_dummy_batch(dp_results):
    for rank in range(WORLD):
        off = dp_results[rank][("engine", False, True)]
        on = dp_results[rank][("engine", True, True)]
        fallback = dp_results[rank][("engine", True, False)]
        assert off[2] == ["cpu"], "switch off: vLLM's own all-reduce on the engine's gloo group"
        assert on[2] == ["device"], "switch on: the workers' DP device group"
        assert fallback[2] == ["cpu"], "no workers in this process: stays on the engine's group"
        for aggregated, dummy, _ in (off, on, fallback):
            assert aggregated is True
            assert dummy is (rank == 1), "only the idle rank runs a dummy batch"


def test_dp1_makes_no_collective(va, monkeypatch):
    """DP=1: the runner returns its inputs before any all-reduce (all_reduce replaced by a failing stub)."""
    import torch.distributed as dist

    mr = va("vllm_ascend.worker.model_runner_v1")
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("DP=1 must not all-reduce"))
    runner = make_runner(mr, 0, on_device=True, torchair=True)
    runner.dp_size = 1
    assert runner._get_forward_metadata_across_dp(8, 5, False, False) == (8, None, False, False)


def test_switch_is_read_from_additional_config_and_off_by_default(va):
    ascend_config = va("vllm_ascend.ascend_config")
    assert ascend_config.AscendConfig(SimpleNamespace(additional_config=None)).dp_sync_on_device is False
    on = ascend_config.AscendConfig(SimpleNamespace(additional_config={"dp_sync_on_device": True}))
    assert on.dp_sync_on_device is True


def hook_worker(rank, port, results):
    """Importing the platform patches (as vLLM-Ascend's pre_register_and_update does) installs the hook."""
    import importlib

    from vllm.v1.engine.llm_engine import LLMEngine

    before = LLMEngine.has_unfinished_requests_dp
    importlib.import_module("vllm_ascend.patch.platform")
    dp_sync = sys.modules["vllm_ascend.distributed.dp_sync"]
    results[rank] = (before is not dp_sync.llm_engine_has_unfinished_requests_dp,
                     LLMEngine.has_unfinished_requests_dp is dp_sync.llm_engine_has_unfinished_requests_dp)


def test_platform_patches_install_the_engine_hook(va):
    """In a forked process, so that the platform patches do not stay in this test session."""
    va("vllm_ascend.distributed.dp_sync")
    assert run_forked(hook_worker, 1) == {0: (True, True)}
