"""TensorCache data flow (issue 7) of the verl series, on CPU.

- DP_COMPUTE_CACHED (verl/single_controller/base/cached_dispatch.py) feeds the worker methods below; its own unit
  tests are the fork's tests/single_controller/test_cached_dispatch.py.
- The worker methods (verl/workers/tensor_cache_worker.py) on 4 gloo processes with fake model calls: rollout DP 4
  -> train TP2 x DP2. The ref and the update get exactly the rows verl's collect-then-split hands each rank, the
  driver gets back only responses and attention mask, and the update (same layout as the ref) moves zero bytes.
- The trainer's limits (verl/trainer/ppo/tensor_cache_flow.py) are refused naming each field.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests import stack
from tests.verl.conftest import require, run_ranks

SERIES = "verl series not applied (sync, apply and install the verl fork; nox -s tests does)"
cached = stack.require("verl.single_controller.base.cached_dispatch", SERIES)
flow = stack.require("verl.trainer.ppo.tensor_cache_flow", SERIES)
decorator = stack.require("verl.single_controller.base.decorator")
DataProto = stack.require("verl").DataProto

P, R, N = 3, 5, 2  # prompt length, response length, samples per prompt
PROMPTS = 8  # -> 16 sequences


class FakeMegatronGroup:
    """What the dispatch reads of the worker group: the DP ranks and collect flags each worker registered per mesh
    (verl 0.6.1's Worker._register_dispatch_collect_info), as the Megatron worker registers them: "actor" in
    Megatron's rank order (TP fastest, then DP, then PP; TP 0 of the last stage answers), "rollout" in TP groups of
    consecutive ranks (TP 0 answers)."""

    def __init__(self, tp: int, dp: int, pp: int, infer_tp: int = 1):
        from verl.single_controller.base.worker_group import WorkerGroup

        self.__class__ = type("Group", (FakeMegatronGroup, WorkerGroup), {})  # verl's collect asserts the type
        world = tp * dp * pp
        self._workers = [None] * world
        self._dispatch_info, self._collect_info = {}, {}
        last = [r // (tp * dp) == pp - 1 for r in range(world)]
        self.registered = {
            "actor": ([r // tp % dp for r in range(world)], [r % tp == 0 and last[r] for r in range(world)]),
            "rollout": ([r // infer_tp for r in range(world)], [r % infer_tp == 0 for r in range(world)]),
        }

    def _query_dispatch_info(self, mesh):
        return self.registered[mesh][0]

    def _query_collect_info(self, mesh):
        return self.registered[mesh][1]


def _rows(n: int, width: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 1000, (n, width), generator=torch.Generator().manual_seed(seed))


def _prompts() -> DataProto:
    """The rollout's input as verl 0.6.1's fit loop makes it: each prompt repeated rollout.n times, interleaved."""
    return DataProto.from_dict(tensors={"input_ids": _rows(PROMPTS, P, 0)}).repeat(repeat_times=N, interleave=True)


def fake_rollout(prompts: DataProto) -> DataProto:
    """A deterministic rollout of a chunk of repeated prompts: one response per row, each sample of a prompt its
    own (chunks hold whole groups of N)."""
    idx = prompts.batch["input_ids"]
    sample = torch.arange(len(idx)).remainder(N).unsqueeze(1)
    responses = (idx.sum(-1, keepdim=True) * 7 + sample * 31 + torch.arange(R)) % 1000
    attention_mask = torch.cat([torch.ones_like(idx), (torch.arange(R) < 2 + idx[:, :1] % (R - 1)).long()], dim=1)
    return DataProto.from_dict(tensors={
        "prompts": idx, "responses": responses, "input_ids": torch.cat([idx, responses], 1),
        "attention_mask": attention_mask, "position_ids": attention_mask.cumsum(-1) - 1,
    })


def fake_ref(data: DataProto) -> torch.Tensor:
    return (data.batch["input_ids"][:, -R:] * data.batch["attention_mask"][:, -R:]).float() / 1000


# ---------------------------------------------------------------- the worker methods on gloo


def _worker(rank, port, requests, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    worker_mod = require("verl.workers.tensor_cache_worker")
    moved = []
    all_to_all = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):  # noqa: A002 (torch's own parameter name)
        moved.append(output.numel() * output.element_size())
        return all_to_all(output, input, *args, **kwargs)

    dist.all_to_all_single = counting

    class Worker(worker_mod.TensorCacheWorkerMixin):
        def generate_sequences(self, prompts):
            return fake_rollout(prompts)

        def compute_ref_log_prob(self, data):
            return DataProto.from_dict(tensors={"ref_log_prob": fake_ref(data)})

        def update_actor(self, data):
            self.update_input = {k: v.clone() for k, v in data.batch.items()}
            return DataProto(meta_info={"metrics": {"rank": [rank]}, "seen": data.meta_info.get("global_token_num")})

    try:
        worker = Worker()
        (gen_req, prompts), (ref_req, _), (upd_req, advantages) = requests[rank]
        gen = worker.generate_sequences_cached(gen_req, prompts)
        worker.compute_ref_log_prob_cached(ref_req)
        moved_ref, calls_ref = sum(moved), len(moved)
        update = worker.update_actor_cached(upd_req, advantages)
        results[rank] = dict(gen=gen, update=update, update_input=worker.update_input, moved_ref=moved_ref,
                             calls_ref=calls_ref, moved_update=sum(moved) - moved_ref,
                             calls_update=len(moved) - calls_ref, cache_left=sorted(worker.tensor_cache().entries))
    finally:
        dist.destroy_process_group()


def _per_worker(group, request, data):
    (requests, chunks), _ = cached.dispatch_dp_compute_cached(group, request, data)
    return list(zip(requests, chunks, strict=True))


def test_cached_flow_hands_each_train_rank_the_rows_of_collect_then_split():
    group = FakeMegatronGroup(tp=2, dp=2, pp=1)  # train DP 2; the rollout stage is DP 4 (one per worker)
    prompts, rows = _prompts(), PROMPTS * N
    assert len(prompts) == rows
    # verl's default flow: collect the rollout on the driver, then split it by train DP rank
    full = DataProto.concat([fake_rollout(c) for c in prompts.chunk(4)])
    full.batch["ref_log_prob"] = fake_ref(full)
    full.batch["advantages"] = torch.randn(rows, R, generator=torch.Generator().manual_seed(1))
    full.batch["response_mask"] = full.batch["attention_mask"][:, -R:]
    # what flow.update_actor sends: the two tensors made on the driver (one worker per DP rank gets them)
    host = DataProto.from_dict(tensors={k: full.batch[k] for k in ("advantages", "response_mask")},
                               meta_info={"global_token_num": full.batch["attention_mask"].sum(-1).tolist()})

    keys = (*flow.MODEL_INPUTS, "ref_log_prob")
    gen = _per_worker(group, cached.CacheRequest(cached.ROLLOUT, rows, return_keys=flow.HOST_KEYS), prompts)
    ref = _per_worker(group, cached.CacheRequest(cached.TRAIN, rows, get_keys=flow.MODEL_INPUTS), None)
    upd = _per_worker(group, cached.CacheRequest(cached.TRAIN, rows, get_keys=keys), host)
    results = run_ranks(_worker, 4, {r: (gen[r], ref[r], upd[r]) for r in range(4)})

    collect = decorator.get_predefined_dispatch_fn(decorator.Dispatch.DP_COMPUTE_CACHED)["collect_fn"]
    back = collect(group, [results[r]["gen"] for r in range(4)])
    assert sorted(back.batch.keys()) == sorted(flow.HOST_KEYS)  # only what the reward needs came back
    for key in flow.HOST_KEYS:
        assert torch.equal(back.batch[key], full.batch[key])

    row_bytes = sum(full.batch[k][0].numel() * full.batch[k].element_size() for k in flow.MODEL_INPUTS)
    for rank in range(4):
        split = full.chunk(2)[rank // 2]  # collect-then-split: train DP rank rank // 2
        got = results[rank]["update_input"]
        assert sorted(got) == sorted((*keys, "advantages", "response_mask"))
        for key in got:
            assert torch.equal(got[key], split.batch[key]), f"rank {rank}: {key} differs from the driver's split"
        # rollout DP 4 -> train DP 2: each rank already holds 4 of its 8 rows; only the other 4 travel, every
        # model input packed into one all_to_all
        assert results[rank]["moved_ref"] == 4 * row_bytes and results[rank]["calls_ref"] == 1
        # ref -> update: the same layout, no all_to_all (the host rows reach the TP replica by a broadcast)
        assert results[rank]["moved_update"] == 0 and results[rank]["calls_update"] == 0
        assert results[rank]["cache_left"] == []  # the update frees the step's batch
    update = collect(group, [results[r]["update"] for r in range(4)])
    # the update reports what the step's reshards brought: 4 rows of each model input (the ref's take); verl 0.6.1's
    # concat keeps every collector's metrics: TP 0 of each train DP rank (ranks 0 and 2), nothing from the others
    assert update.batch is None
    received = 4 * len(flow.MODEL_INPUTS)
    assert update.meta_info["metrics"] == {"rank": [[0], [2]], "tensor_cache/rows_received": [received, received]}
    assert update.meta_info["seen"] == host.meta_info["global_token_num"]


# ---------------------------------------------------------------- the driver's side of the flow


class RecordingGroup:
    """The trainer's actor_rollout_wg: records what each cached call would put on the wire."""

    def __init__(self):
        self.calls = []

    def generate_sequences_cached(self, request, prompts):
        self.calls.append(("generate", request, prompts))
        answering = cached.CacheRequest(request.stage, request.num_rows, return_keys=request.return_keys, collect=True)
        return cached.host_part(fake_rollout(prompts), answering)

    def compute_ref_log_prob_cached(self, request, data=None):
        self.calls.append(("ref", request, data))

    def update_actor_cached(self, request, data):
        self.calls.append(("update", request, data))
        return DataProto(meta_info={"metrics": {}})


def test_the_driver_sends_prompts_and_advantages_and_gets_responses_and_mask():
    wg = RecordingGroup()
    config = _config(f"actor_rollout_ref.rollout.n={N}", "actor_rollout_ref.actor.use_kl_loss=true")
    trainer = SimpleNamespace(config=config, actor_rollout_wg=wg, ref_policy_wg=wg, use_reference_policy=True,
                              ref_in_actor=False)
    prompts = _prompts()
    out = flow.generate(trainer, prompts)
    full = fake_rollout(prompts)
    assert sorted(out.batch.keys()) == ["attention_mask", "prompts", "responses"]
    for key in out.batch.keys():  # prompts rebuilt on the driver equal the rollout's own
        assert torch.equal(out.batch[key], full.batch[key])
    made = {"advantages": torch.ones(len(full), R), "response_mask": full.batch["attention_mask"][:, -R:]}
    batch = full.union(DataProto.from_dict(tensors=made,
                                           meta_info={"global_token_num": [1] * len(full)}))
    flow.compute_ref(trainer, batch)
    flow.update_actor(trainer, batch)
    (_, gen_req, gen_data), (_, ref_req, ref_data), (_, upd_req, upd_data) = wg.calls
    assert gen_req.stage == cached.ROLLOUT and gen_req.num_rows == PROMPTS * N and gen_data is prompts
    assert ref_req.stage == cached.TRAIN and ref_req.get_keys == flow.MODEL_INPUTS and ref_data is None
    assert upd_req.get_keys == (*flow.MODEL_INPUTS, "ref_log_prob")
    # the Megatron actor's loss reads response_mask from the batch since verl 0.6.1: made on the driver, sent too
    assert sorted(upd_data.batch.keys()) == ["advantages", "response_mask"] and upd_data.meta_info == batch.meta_info
    trainer.config.actor_rollout_ref.actor.use_kl_loss = False  # no KL loss: the update does not read ref_log_prob
    flow.update_actor(trainer, batch)
    assert wg.calls[-1][1].get_keys == flow.MODEL_INPUTS
    trainer.ref_policy_wg = RecordingGroup()  # a ref group of its own (the share switch not honoured): refused
    with pytest.raises(RuntimeError, match="the ref runs in a worker group of its own"):
        flow.compute_ref(trainer, batch)


# ---------------------------------------------------------------- the trainer's limits


def _config(*overrides: str):
    import verl
    from omegaconf import OmegaConf

    # v0.6.1's ppo_megatron_trainer.yaml is Hydra defaults only; the generated file is its flat rendering
    base = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_megatron_trainer.yaml")
    ok = ["actor_rollout_ref.tensor_cache.enable=true", "trainer.balance_batch=false",
          "actor_rollout_ref.actor.recompute_old_log_prob=false", "actor_rollout_ref.ref.share_actor_worker=true",
          "algorithm.adv_estimator=grpo", "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
          "actor_rollout_ref.actor.entropy_coeff=0"]
    return OmegaConf.merge(base, OmegaConf.from_dotlist(ok + list(overrides)))


def _trainer(config, **flags):
    roles = dict(use_critic=False, use_rm=False, use_reference_policy=True, ref_in_actor=False) | flags
    return SimpleNamespace(config=config, **roles)


def test_a_supported_config_passes_and_off_means_unchecked():
    assert flow.check_limits(_trainer(_config())) is True
    off = _config("actor_rollout_ref.tensor_cache.enable=false", "trainer.balance_batch=true")
    assert flow.check_limits(_trainer(off)) is False
    import verl
    from omegaconf import OmegaConf

    shipped = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_megatron_trainer.yaml")
    assert flow.enabled(shipped) is False  # verl's default stays the default flow


@pytest.mark.parametrize(("override", "flags", "message"), [
    ("trainer.balance_batch=true", {}, "trainer.balance_batch must be false"),
    ("actor_rollout_ref.actor.use_dynamic_bsz=true", {}, "actor_rollout_ref.actor.use_dynamic_bsz must be false"
                                                         " (sequence packing"),
    ("actor_rollout_ref.model.use_remove_padding=true", {}, "actor_rollout_ref.model.use_remove_padding must be false"),
    ("actor_rollout_ref.ref.share_actor_worker=false", {}, "the ref must share the actor/rollout workers"),
    ("actor_rollout_ref.actor.recompute_old_log_prob=true", {}, "recompute_old_log_prob must be false"),
    ("actor_rollout_ref.rollout.mode=async", {}, "rollout.mode is 'async'"),
    ("algorithm.adv_estimator=gae", {"use_critic": True}, "a critic"),
    ("reward_model.enable=true", {"use_rm": True}, "reward_model.enable must be false"),
    ("actor_rollout_ref.actor.strategy=fsdp", {}, "strategy is 'fsdp'"),
])
def test_each_limit_is_refused_naming_its_field(override, flags, message):
    with pytest.raises(ValueError, match=r"tensor_cache\.enable=true: .*" + message.replace("(", r"\(")) as err:
        flow.check_limits(_trainer(_config(override), **flags))
    assert "set actor_rollout_ref.tensor_cache.enable=false" in str(err.value)


def test_all_problems_are_named_at_once_and_on_policy_is_checked():
    config = _config("trainer.balance_batch=true", "actor_rollout_ref.actor.use_dynamic_bsz=true")
    problems = flow.limit_problems(config, use_critic=False, use_rm=False, use_reference_policy=True,
                                   ref_in_actor=False)
    assert len(problems) == 4  # balance_batch, actor + ref + rollout log-prob dynamic bsz (interpolated)
    with pytest.raises(ValueError, match="ppo_epochs is 2"):  # on_policy.py's own conditions still apply
        flow.check_limits(_trainer(_config("actor_rollout_ref.actor.ppo_epochs=2")))
