"""Colocated hybrid engine of the verl series, on CPU: the workers and the single controller. The unit tests of
the batch-size check (verl/trainer/ppo/batch_sizes.py) and of the role mapping (verl/trainer/ppo/colocated_ref.py)
live in the fork's tests/trainer/ppo/.

- Megatron's ActorRolloutRefWorker normalises the batch sizes with Megatron's DP size on 2 gloo ranks, the ref's
  sizes included when the ref shares the worker, and builds the ref as a ref.
- One worker group for actor, rollout and ref (`actor_rollout_ref.ref.share_actor_worker`): verl's own roles
  (main_ppo's TaskRunner methods), trainer and Ray single controller on a local Ray cluster with fake GPUs and a
  tiny fake worker class in place of the Megatron worker (no model), showing that one worker group with role
  "actor_rollout_ref" is spawned and that the trainer's ref call (`ref_policy_wg.compute_ref_log_prob`) is served
  by the same worker objects as the actor's calls.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import stack
from tests.gloo import run_processes

SERIES = "verl series not applied (sync, apply and install the verl fork; nox -s tests does)"
colocated_ref = stack.require("verl.trainer.ppo.colocated_ref", SERIES)
DataProto = stack.require("verl").DataProto
Worker = stack.require("verl.single_controller.base").Worker
decorator = stack.require("verl.single_controller.base.decorator")


def _config(*overrides: str, strategy: str = "megatron"):
    import verl
    from omegaconf import OmegaConf

    # v0.6.1's trainer yamls are Hydra defaults only; the generated files are their flat renderings
    name = "_generated_ppo_megatron_trainer.yaml" if strategy == "megatron" else "_generated_ppo_trainer.yaml"
    base = OmegaConf.load(Path(verl.__file__).parent / "trainer/config" / name)
    # 8 GPUs, TP2 x PP2 -> DP 2; 16 prompts x 4 samples; mini-batch of 8 prompts -> 16 sequences per rank
    sizes = [
        "trainer.n_gpus_per_node=8",
        "trainer.nnodes=1",
        "data.train_batch_size=16",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    ]
    if strategy == "megatron":
        sizes += [
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        ]
    return OmegaConf.merge(base, OmegaConf.from_dotlist(sizes + list(overrides)))


# ---------------------------------------------------------------- Megatron's worker, 2 gloo ranks (DP 2)


def _megatron_worker(rank, port, role, overrides, results):
    import torch.distributed as dist
    from megatron.core import parallel_state

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    dist.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(1, 1)  # DP 2
    try:
        from verl.workers.megatron_workers import ActorRolloutRefWorker

        arr = _config(
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
            *overrides,
        ).actor_rollout_ref
        try:
            worker = ActorRolloutRefWorker(arr, role=role)
        except ValueError as exc:
            results[rank] = str(exc)
            return
        results[rank] = {
            "mini": arr.actor.ppo_mini_batch_size,
            "rollout_micro": arr.rollout.log_prob_micro_batch_size_per_gpu,
            "ref_micro": arr.ref.log_prob_micro_batch_size_per_gpu,
            "ref_offload": getattr(worker, "_ref_is_offload_param", "unset"),
        }
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_megatron_worker_normalises_the_ref_next_to_the_actor():
    stack.require("megatron.core")
    overrides = [
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=null",
        "actor_rollout_ref.ref.log_prob_micro_batch_size=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size=16",
    ]
    got = run_processes(_megatron_worker, 2, "actor_rollout_ref", overrides)
    # before the series, role actor_rollout_ref skipped the ref (an elif): ref micro None and no _ref_is_offload_param
    assert got[0] == got[1] == {"mini": 16, "rollout_micro": 8, "ref_micro": 4, "ref_offload": False}


def test_megatron_worker_refuses_a_size_that_does_not_split_over_its_dp():
    stack.require("megatron.core")
    got = run_processes(_megatron_worker, 2, "actor_rollout",
                        ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"])
    assert all("must be a multiple of the per-rank micro-batch 3" in got[r] for r in (0, 1)), got


# ---------------------------------------------------------------- one worker group for actor, rollout and ref

SHARE = "actor_rollout_ref.ref.share_actor_worker=true"
SAME_LAYOUT = [
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2",
]


def _build_models_in_shared_worker(rank, port, results):
    """Megatron's ActorRolloutRefWorker with role actor_rollout_ref builds the actor and then the ref through
    _build_model_optimizer. Model construction itself needs a device (the provider calls .cuda()), so
    make_megatron_module, the weight loader, the optimizer and its scheduler, the training hooks, the HF/TF config
    step and the device memory log are replaced by recorders: what is checked is which branch each call takes and
    what it returns."""
    import torch.distributed as dist
    import verl.utils.megatron.optimizer as optimizer
    import verl.utils.megatron_utils as megatron_utils
    import verl.utils.model as model_utils
    import verl.workers.megatron_workers as workers
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        built = []
        # v0.6.1 builds both models by make_megatron_module (get_model before), imported at call time
        megatron_utils.make_megatron_module = lambda wrap_config, **kw: (
            built.append(wrap_config.wrap_with_ddp) or [f"module{len(built)}"]
        )
        optimizer.init_megatron_optim_config = lambda c, **kw: c
        optimizer.get_megatron_optimizer = lambda model, config: f"optimizer of {model[0]}"
        optimizer.get_megatron_optimizer_param_scheduler = lambda optimizer, config: f"scheduler of {optimizer}"
        model_utils.get_generation_config = lambda path: None
        model_utils.print_model_size = lambda m: None
        workers.load_megatron_gptmodel_weights = lambda *a, **kw: None
        workers.register_megatron_training_hooks = lambda *a, **kw: None  # hooks on the DDP buffers the fakes lack
        workers.log_gpu_memory_usage = lambda *a, **kw: None  # reads device memory counters that CPU lacks

        def fake_hf_tf_config(self, *args, **kwargs):
            self.hf_config, self.tf_config, self.local_path, self.share_embeddings_and_output_weights = (
                "hf",
                "tf",
                "/nowhere",
                False,
            )
            self.bridge = None  # no mbridge: verl's own converter path

        workers.ActorRolloutRefWorker._init_hf_config_and_tf_config = fake_hf_tf_config
        arr = _config(
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
        ).actor_rollout_ref
        worker = workers.ActorRolloutRefWorker(arr, role="actor_rollout_ref")
        worker.dtype = torch.bfloat16
        args = {"model_path": "/nowhere", "override_model_config": {}, "override_transformer_config": {}}
        actor = worker._build_model_optimizer(optim_config={}, **args)
        ref = worker._build_model_optimizer(optim_config=None, for_ref=True, **args)
        results[0] = {"actor": actor, "ref": ref, "ddp": built}
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_the_shared_megatron_worker_builds_the_ref_as_a_ref():
    stack.require("megatron.core")
    got = run_processes(_build_models_in_shared_worker, 1)[0]
    assert got["actor"] == (["module1"], "optimizer of module1", "scheduler of optimizer of module1", "hf", {})
    # before the series, the ref call took the actor branch too (a DDP-wrapped model with an optimizer, five
    # values for the caller's two: ValueError in init_model)
    assert got["ref"] == (["module2"], "hf") and got["ddp"] == [True, False]


# verl's single controller on a local Ray cluster. The worker class is a stand-in for ActorRolloutRefWorker that
# holds no model: it records its role and which worker object serves each call. Everything else is verl's own:
# TaskRunner's role and pool methods, RayPPOTrainer (__init__ with its config validation, init_workers),
# create_colocated_worker_cls, RayWorkerGroup.


class FakeActorRolloutRefWorker(Worker):
    def __init__(self, config, role):
        super().__init__()
        self.role = role
        self.models = []

    @decorator.register(dispatch_mode=decorator.Dispatch.ONE_TO_ALL)
    def init_model(self):
        self.models = [
            m
            for m, roles in (
                ("actor", ("actor_rollout", "actor_rollout_ref")),
                ("ref", ("ref", "actor_rollout_ref")),
            )
            if self.role in roles
        ]

    @decorator.register(dispatch_mode=decorator.Dispatch.ONE_TO_ALL)
    def whoami(self):
        return f"{os.getpid()}:{id(self)}:{self.role}:{'+'.join(self.models)}"

    @decorator.register(dispatch_mode=decorator.Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data):
        assert "ref" in self.models, f"{self.role} worker holds no ref model"
        return DataProto.from_dict(
            tensors={"ref_log_prob": data.batch["responses"].float() / 2},
            non_tensors={"served_by": np.array([self.whoami()] * len(data), dtype=object)},
        )


@pytest.fixture(scope="module")
def local_ray():
    ray = stack.require("ray")
    import verl

    # Ray's workers import this module and the same verl as this process
    paths = [str(Path(__file__).resolve().parents[2]), str(Path(verl.__file__).resolve().parents[1])]
    ray.init(
        address="local",  # a cluster of our own, never one already running on this machine
        num_cpus=8,
        num_gpus=4,
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(paths), "TOKENIZERS_PARALLELISM": "false"}},
    )
    yield
    ray.shutdown()


def _main_ppo_roles(config, pool: str):
    """The roles, pools and resource pool manager as v0.6.1's TaskRunner.run builds them, its share hook
    (colocated_ref.assign_roles) included, after init_resource_pool_mgr: the manager must see the hook's changes to
    the mapping. The pool is renamed to `pool` (Ray placement group names must differ within one cluster)."""
    from verl.trainer.main_ppo import TaskRunner

    runner = TaskRunner()
    actor_rollout_cls, _ = runner.add_actor_rollout_worker(config)
    runner.add_critic_worker(config)
    runner.add_ref_policy_worker(config, actor_rollout_cls)
    manager = runner.init_resource_pool_mgr(config)
    colocated_ref.assign_roles(config, runner.role_worker_mapping, runner.mapping)
    manager.resource_pool_spec = {pool: manager.resource_pool_spec.pop("global_pool")}
    runner.mapping.update(dict.fromkeys(runner.mapping, pool))
    assert manager.mapping is runner.mapping
    return runner, manager


def _trainer(pool: str, *overrides):
    """verl's RayPPOTrainer for 2 fake GPUs (DP 2, GRPO with a KL loss), the roles as main_ppo assigns them; `pool`
    names the resource pool (Ray placement group names must differ within one cluster)."""
    import ray
    from verl.single_controller.ray import RayWorkerGroup
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    config = _config(
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "algorithm.adv_estimator=grpo",
        "data.dataloader_num_workers=0",
        *overrides,
    )
    runner, manager = _main_ppo_roles(config, pool)
    # the stand-in serves every role main_ppo assigned (GRPO: the trainer leaves the critic out)
    workers = dict.fromkeys(runner.role_worker_mapping, ray.remote(FakeActorRolloutRefWorker))
    rows = [{"responses": torch.tensor([i, i + 1])} for i in range(4)]
    trainer = RayPPOTrainer(
        config=config,
        tokenizer=None,
        role_worker_mapping=workers,
        resource_pool_manager=manager,
        ray_worker_group_cls=RayWorkerGroup,
        train_dataset=rows,
        val_dataset=rows,
        collate_fn=lambda batch: batch,
        device_name="cuda",
    )
    trainer.init_workers()
    return trainer


def _ref_call(trainer):
    """The trainer's ref call, as RayPPOTrainer.fit makes it."""
    batch = DataProto.from_dict(tensors={"responses": torch.arange(16).view(8, 2)})
    out = trainer.ref_policy_wg.compute_ref_log_prob(batch)
    assert torch.equal(out.batch["ref_log_prob"], torch.arange(16.0).view(8, 2) / 2)
    return sorted(set(out.non_tensor_batch["served_by"]))


def test_one_worker_group_holds_actor_rollout_and_ref_and_serves_the_ref_call(local_ray):
    trainer = _trainer("shared", SHARE)
    assert list(trainer.resource_pool_to_cls[trainer.resource_pool_manager.get_resource_pool(trainer.actor_role)]) == [
        "actor_rollout_ref"
    ]
    assert trainer.use_reference_policy and trainer.ref_policy_wg is trainer.actor_rollout_wg
    actor_workers = sorted(trainer.actor_rollout_wg.whoami())
    assert len(actor_workers) == 2 and all(w.endswith(":actor_rollout_ref:actor+ref") for w in actor_workers)
    assert _ref_call(trainer) == actor_workers  # both DP ranks, each the worker object that holds the actor


def test_without_the_switch_the_ref_has_a_worker_group_of_its_own(local_ray):
    trainer = _trainer("separate")
    assert sorted(
        trainer.resource_pool_to_cls[trainer.resource_pool_manager.get_resource_pool(trainer.actor_role)]
    ) == ["actor_rollout", "ref"]
    assert trainer.ref_policy_wg is not trainer.actor_rollout_wg
    actor_workers = sorted(trainer.actor_rollout_wg.whoami())
    served = _ref_call(trainer)
    assert all(w.endswith(":ref:ref") for w in served) and not set(served) & set(actor_workers)
    # same processes (verl colocates both roles in one Ray actor per rank), different worker objects
    assert {w.split(":")[0] for w in served} == {w.split(":")[0] for w in actor_workers}
