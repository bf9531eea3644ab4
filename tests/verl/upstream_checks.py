"""Checks that a verl release does, without our series, what a patch of the series did (tests/verl/upstream.py runs
each in a fresh process whose verl is the release's tree). Each check raises on a failure; tiny tensors, one process
or two gloo ranks.

Imports of verl are inside the functions: the module itself is imported before `loaded_from` has checked which verl
the process sees.
"""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import sys
import tempfile
import types
from pathlib import Path


def loaded_from(tree: str, version: str) -> None:
    """The process imports verl `version` from `tree`, not the stack's own (our fork at the pin)."""
    import verl

    where = Path(verl.__file__).resolve()
    assert Path(tree).resolve() in where.parents, f"verl came from {where}, not from {tree}"
    assert verl.__version__ == version, f"verl {verl.__version__} loaded, expected {version}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo(rank: int = 0, world: int = 1, port: int | None = None) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or _free_port()), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)


# ------------------------------------------------------------- 20: keep-a-dataproto-writable-after-it-is-sent


def dataproto_stays_writable_after_send() -> None:
    """Pickling a DataProto (what a Ray call does to it) leaves the sender's batch as it was: it still takes the
    union of a worker's result and new keys, through the trainer's sequence of sends (mixed dtypes, so that the
    consolidated copy views one storage as several types). tensordict >= 0.15 locks a consolidated TensorDict;
    verl 0.4.0 put that copy in place of the sender's batch."""
    import tensordict
    import torch
    from verl.protocol import DataProto

    def sent(data):
        return pickle.loads(pickle.dumps(data))

    batch = DataProto.from_dict(tensors={"responses": torch.arange(8).view(4, 2),
                                         "mask": torch.ones(4, 2, dtype=torch.bool)})
    received = sent(batch)
    assert torch.equal(received.batch["responses"], batch.batch["responses"])
    assert not batch.batch.is_locked, f"tensordict {tensordict.__version__}: the sender's batch is locked"
    for step, key in enumerate(["old_log_probs", "ref_log_prob"]):
        received = sent(batch)
        batch = batch.union(DataProto.from_dict(tensors={key: received.batch["responses"].float() * (step + 1)}))
    batch.batch["advantages"] = torch.full((4, 2), 0.25)  # what the trainer does after the reward
    final = sent(batch)
    assert sorted(final.batch.keys()) == ["advantages", "mask", "old_log_probs", "ref_log_prob", "responses"]
    assert torch.equal(final.batch["ref_log_prob"], torch.arange(8.0).view(4, 2) * 2)
    assert final.batch["mask"].dtype == torch.bool
    # the worker's side: MegatronPPOActor selects its keys from what it received, iterates mini-batches and sets
    # keys on them (forward_backward_batch: attention_mask)
    minis = sent(final).select(batch_keys=["responses", "mask"]).make_iterator(
        mini_batch_size=2, epochs=1, seed=0, dataloader_kwargs={"shuffle": False})
    for mini in minis:
        mini.batch["mask"] = mini.batch["mask"].to(torch.int64)
        mini.batch["seen"] = torch.ones(2)


# ------------------------------------------------------------- 23: import-flash-attn-in-the-fsdp-critic-only-on-cuda


def critic_and_megatron_workers_import_without_flash_attn() -> None:
    """verl.workers.critic (and through it megatron_workers) imports where flash_attn cannot be imported, as on
    Ascend NPU and CPU; flash_attn is blocked so that the check means the same on a machine that has it."""
    import importlib

    for name in ("flash_attn", "flash_attn.bert_padding"):
        sys.modules[name] = None  # `import flash_attn...` now raises ImportError
    try:
        importlib.import_module("flash_attn.bert_padding")
    except ImportError:
        pass
    else:
        raise AssertionError("flash_attn is not blocked")
    critic = importlib.import_module("verl.workers.critic")
    dp_critic = importlib.import_module("verl.workers.critic.dp_critic")
    assert critic.DataParallelPPOCritic is dp_critic.DataParallelPPOCritic
    workers = importlib.import_module("verl.workers.megatron_workers")
    assert hasattr(workers, "ActorRolloutRefWorker")


# ------------------------------------------------------------- 37: pass-vllm-s-multimodal-arguments-only-for-mm


class _EngineBuilt(Exception):
    pass


def _vllm_engine_kwargs(model_dir: str, **rollout) -> dict:
    """The keyword arguments verl's SPMD vLLM rollout gives vllm.LLM for the model in `model_dir`."""
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.vllm_rollout import vllm_rollout_spmd

    seen = {}

    def recording_llm(**kwargs):
        seen.update(kwargs)
        raise _EngineBuilt

    vllm_rollout_spmd.LLM = recording_llm
    config = RolloutConfig(name="vllm", tensor_model_parallel_size=1, prompt_length=16, response_length=16,
                           **rollout)
    model = HFModelConfig(path=model_dir, load_tokenizer=False)
    try:
        vllm_rollout_spmd.vLLMRollout(config=config, model_config=model, device_mesh=None)
    except _EngineBuilt:
        return seen
    raise AssertionError("vLLMRollout did not build its engine")


def vllm_text_model_gets_no_multimodal_arguments() -> None:
    """A text model's engine gets neither limit_mm_per_prompt nor disable_mm_preprocessor_cache, both of which
    vLLM 0.9's ModelConfig refuses for it (verl 0.4.0 passed both always); vLLM accepts the arguments; a set
    limit_images still reaches vLLM as the image limit."""
    from transformers import LlamaConfig

    _gloo()
    mm_keys = {"limit_mm_per_prompt", "disable_mm_preprocessor_cache", "mm_processor_cache_gb"}
    with tempfile.TemporaryDirectory() as model_dir:
        LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=2, vocab_size=64,
                    max_position_embeddings=64).save_pretrained(model_dir)
        kwargs = _vllm_engine_kwargs(model_dir)
        assert kwargs["model"] == model_dir and not mm_keys & kwargs.keys(), sorted(mm_keys & kwargs.keys())
        from vllm.engine.arg_utils import EngineArgs

        # vLLM's model config takes what verl gave it, multimodal keys included (none here)
        names = {"model", "dtype", "max_model_len", "trust_remote_code", "seed", *mm_keys}
        EngineArgs(**{k: v for k, v in kwargs.items() if k in names}).create_model_config()
        assert _vllm_engine_kwargs(model_dir, limit_images=2)["limit_mm_per_prompt"] == {"image": 2}


# ------------------------------------------------------------- 41, 42, 44: Megatron checkpoints (dist_checkpointing)


def _load(manager, ckpt: str) -> None:
    """manager.load_checkpoint(ckpt). verl 0.6.1's load_checkpoint imports transformer_engine (#3850) only to
    allow-list TE's FusedAdam for torch.load, and fails without it (CPU; NPU without a TE build). That is not what
    these checks are about: where TE is missing, a module with that one class stands in during the call, and only
    then (Megatron would take it for TE). Our series carries the guard (`load-a-megatron-checkpoint-s-optimizer-
    without-transformer-engine`); these checks run upstream's tree, without it."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        pass
    else:
        manager.load_checkpoint(ckpt)
        return
    fused_adam = types.ModuleType("transformer_engine.pytorch.optimizers.fused_adam")
    fused_adam.FusedAdam = type("FusedAdam", (), {})
    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.optimizers"]
    modules = [types.ModuleType(n) for n in names] + [fused_adam]
    for parent, child in itertools.pairwise(modules):
        setattr(parent, child.__name__.rsplit(".", 1)[1], child)
    sys.modules.update({m.__name__: m for m in modules})
    try:
        manager.load_checkpoint(ckpt)
    finally:
        for m in modules:
            del sys.modules[m.__name__]


def _megatron(ep: int = 1) -> None:
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _tiny_actor(seed: int, experts: int = 0):
    """A Megatron model as verl's actor has it (DDP, distributed optimizer, Adam): a column-parallel layer and,
    with `experts`, a SequentialMLP holding one of `experts` routed experts per EP rank, initialised per rank."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.experts import SequentialMLP

    moe = dict(num_moe_experts=experts, moe_ffn_hidden_size=8, ffn_hidden_size=8,
               expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size()) if experts else {}
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                               params_dtype=torch.bfloat16, bf16=True, add_bias_linear=False, **moe)

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(config)
            torch.manual_seed(seed)
            self.proj = ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.normal_, bias=False)
            if experts:
                torch.manual_seed(seed * 100 + parallel_state.get_expert_model_parallel_rank() + 1)
                self.experts = SequentialMLP(experts // parallel_state.get_expert_model_parallel_world_size(), config,
                                             MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                           linear_fc2=RowParallelLinear))

        def forward(self, x):
            h = self.proj(x)[0]
            if experts:
                h = h + self.experts(h, torch.tensor([h.shape[0]]), torch.ones(h.shape[0], dtype=h.dtype))[0]
            return h

    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), Tiny())
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, params_dtype=torch.bfloat16,
                        use_distributed_optimizer=True, clip_grad=1.0), [model])
    return model, optimizer, config


def _train_step(model, optimizer, step: int) -> None:
    import torch

    x = torch.linspace(-1, 1, 16, dtype=torch.bfloat16).view(2, 8) * (step + 1)
    optimizer.zero_grad()
    model.zero_grad_buffer()
    model(x).float().pow(2).sum().backward()
    model.finish_grad_sync()
    optimizer.step()


def _manager(model, optimizer, config, contents):
    import torch
    from omegaconf import OmegaConf
    from transformers import LlamaConfig
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager

    return MegatronCheckpointManager(
        config=OmegaConf.create({"model": {"path": "unused"}}),
        checkpoint_config=OmegaConf.create({"save_contents": contents, "load_contents": contents,
                                            "async_save": False}),
        model_config=None, transformer_config=config, role="actor", model=[model], arch="LlamaForCausalLM",
        hf_config=LlamaConfig(), param_dtype=torch.bfloat16, share_embeddings_and_output_weights=False,
        processing_class=None, optimizer=optimizer, optimizer_scheduler=None, use_distributed_optimizer=True)


def megatron_checkpoint_restores_the_rng_on_cpu() -> None:
    """MegatronCheckpointManager saves and loads the RNG states on a host without CUDA (verl 0.4.0 called
    torch.cuda.get_rng_state, which raises there): after a load, the host stream and Megatron's model-parallel
    stream continue from where they were at the save."""
    import torch
    from megatron.core import tensor_parallel

    _gloo()
    _megatron()
    model, optimizer, config = _tiny_actor(seed=0)
    with tempfile.TemporaryDirectory() as ckpt:
        manager = _manager(model, optimizer, config, ["model", "extra"])  # without "model" 0.6.1 fails (a log line)
        manager.save_checkpoint(ckpt, global_step=1)
        expected = torch.rand(4), tensor_parallel.get_cuda_rng_tracker().get_states()["model-parallel-rng"].clone()
        torch.rand(100)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            torch.rand(100)
        _load(manager, ckpt)
    assert torch.equal(torch.rand(4), expected[0])
    assert torch.equal(tensor_parallel.get_cuda_rng_tracker().get_states()["model-parallel-rng"], expected[1])


def _torch_adam(optimizer):
    """The torch Adam inside Megatron's (chained) distributed optimizer."""
    (inner,) = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    return inner


def megatron_checkpoint_resumes_the_optimizer() -> None:
    """A freshly built actor that loads the checkpoint takes the same next step as the saved one: Adam's step and
    moments come back with the parameters (verl 0.4.0's save_parameter_state alone left a fresh optimizer at step
    1 with zero moments)."""
    import torch

    _gloo()
    _megatron()
    saved, saved_opt, config = _tiny_actor(seed=0)
    for step in range(3):
        _train_step(saved, saved_opt, step)
    with tempfile.TemporaryDirectory() as ckpt:
        _manager(saved, saved_opt, config, ["model", "optimizer"]).save_checkpoint(ckpt, global_step=3)
        resumed, resumed_opt, _ = _tiny_actor(seed=1)
        assert not torch.equal(resumed.module.proj.weight, saved.module.proj.weight)
        _load(_manager(resumed, resumed_opt, config, ["model", "optimizer"]), ckpt)
    assert torch.equal(resumed.module.proj.weight, saved.module.proj.weight)
    _train_step(saved, saved_opt, 3)
    _train_step(resumed, resumed_opt, 3)
    assert torch.equal(resumed.module.proj.weight, saved.module.proj.weight), "the resumed step differs"
    (state,) = _torch_adam(resumed_opt).state.values()
    assert float(state["step"]) == 4 and state["exp_avg"].abs().sum() > 0, state


def _ep_rank(rank: int, port: int, ckpt: str) -> None:
    import torch
    import torch.distributed as dist

    _gloo(rank, 2, port)
    _megatron(ep=2)
    saved, saved_opt, config = _tiny_actor(seed=0, experts=2)
    _train_step(saved, saved_opt, 0)
    _manager(saved, saved_opt, config, ["model"]).save_checkpoint(ckpt, global_step=1)
    resumed, resumed_opt, _ = _tiny_actor(seed=1, experts=2)
    _load(_manager(resumed, resumed_opt, config, ["model"]), ckpt)
    for (name, got), want in zip(resumed.module.state_dict().items(), saved.module.state_dict().values(), strict=True):
        if torch.is_tensor(got):
            assert torch.equal(got, want), f"rank {rank}: {name} is not what this rank saved"
    expert = saved.module.experts.local_experts[0].linear_fc1.weight.detach().float()
    both = [torch.empty_like(expert) for _ in range(2)]
    dist.all_gather(both, expert)
    assert not torch.equal(both[0], both[1]), "the two EP ranks hold the same expert: the check proves nothing"
    dist.barrier()
    dist.destroy_process_group()


def megatron_checkpoint_saves_every_expert_parallel_shard() -> None:
    """On 2 gloo ranks with EP 2 (DP 2), each rank holding another routed expert: a checkpoint written by the
    manager loads back on each rank its own expert and the shared layer (verl 0.4.0 wrote model files only on
    data-parallel rank 0, so EP rank 1's expert was never saved and the load failed)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as ckpt:
        mp.start_processes(_ep_rank, args=(_free_port(), ckpt), nprocs=2, start_method="spawn")


# ------------------------------------------------------------- 34: report-rollout-vs-update-log-prob-drift


VOCAB, PROMPT, RESPONSE, ROWS = 16, 3, 3, 4


def _tiny_policy():
    """A Megatron language model in miniature (embedding + vocab-parallel head) in DDP with the distributed
    optimizer, as verl's Megatron actor holds its model."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.enums import ModelType
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                               params_dtype=torch.float32)

    class TinyLM(MegatronModule):
        def __init__(self):
            super().__init__(config)
            self.model_type = ModelType.encoder_or_decoder  # what Megatron's schedules read
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(VOCAB, 8)
            self.head = ColumnParallelLinear(8, VOCAB, config=config, init_method=torch.nn.init.normal_, bias=False)

        def set_input_tensor(self, tensor):  # what Megatron's schedules call on every model
            pass

        def forward(self, input_ids):
            return self.head(self.embed(input_ids))[0]

    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), TinyLM())
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, params_dtype=torch.float32, use_distributed_optimizer=True,
                        clip_grad=1.0), [model])
    return model, optimizer, config


def _forward_fn(hf_config):
    """Stands in for verl.models.mcore.get_mcore_forward_fn (the GPT forward with packed sequences, which needs a
    GPTModel): logits of the whole sequence, handed to the actor's own logits_processor."""

    def forward(model, input_ids, attention_mask, position_ids, multi_modal_inputs, logits_processor,
                logits_processor_args):
        return logits_processor(model(input_ids), **logits_processor_args)

    return forward


def megatron_update_reports_rollout_vs_update_drift() -> None:
    """The Megatron actor's update compares the rollout's log-probs with its own forward over the response tokens
    (rollout_corr/* metrics): zero KL when they are the update's own log-probs, the drift when the rollout's are
    off by 0.3 nat, and masked-out tokens do not count (verl 0.4.0 compared them only in fit()'s old_log_prob
    branch on the driver)."""
    import torch
    import verl.models.mcore
    from verl import DataProto
    from verl.workers.actor.megatron_actor import MegatronPPOActor
    from verl.workers.config import McoreActorConfig

    _gloo()
    _megatron()
    if not hasattr(torch.cpu, "empty_cache"):  # the actor empties the device cache; our patch 9 (ported) answers it
        torch.cpu.empty_cache = lambda: None
    verl.models.mcore.get_mcore_forward_fn = _forward_fn
    model, optimizer, tf_config = _tiny_policy()
    config = McoreActorConfig(ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=2, data_loader_seed=0,
                              rollout_n=1)
    actor = MegatronPPOActor(config=config, model_config=None, hf_config=None, tf_config=tf_config,
                             actor_module=[model], actor_optimizer=optimizer)

    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, VOCAB, (ROWS, PROMPT + RESPONSE), generator=gen)
    response_mask = torch.ones(ROWS, RESPONSE, dtype=torch.int64)
    response_mask[1, -1] = response_mask[3, -2:] = 0
    attention_mask = torch.cat([torch.ones(ROWS, PROMPT, dtype=torch.int64), response_mask], dim=1)
    batch = {"input_ids": input_ids, "responses": input_ids[:, PROMPT:], "attention_mask": attention_mask,
             "position_ids": torch.arange(PROMPT + RESPONSE).expand(ROWS, -1).clone(),
             "response_mask": response_mask, "advantages": torch.randn(ROWS, RESPONSE, generator=gen)}
    meta = {"temperature": 1.0, "micro_batch_size": 2}
    own, _ = actor.compute_log_prob(DataProto.from_dict(tensors=dict(batch), meta_info=dict(meta)))
    assert own.shape == (ROWS, RESPONSE)

    def update(rollout_log_probs):
        data = DataProto.from_dict(tensors={**batch, "old_log_probs": own.clone(),
                                            "rollout_log_probs": rollout_log_probs}, meta_info=dict(meta))
        before = [p.detach().clone() for p in model.parameters()]
        metrics = actor.update_policy(actor.make_minibatch_iterator(data))
        for p, b in zip(model.parameters(), before, strict=True):  # each call starts from the same weights
            p.data.copy_(b)
        return metrics

    same = update(own.clone())
    assert "rollout_corr/kl" in same, sorted(same)
    # every micro-batch's update forward saw the weights the log-probs came from (one optimizer step per mini-batch)
    assert max(abs(v) for v in _per_micro_batch(same, "rollout_corr/kl")) < 1e-6, same
    assert max(abs(v) for v in _per_micro_batch(same, "rollout_corr/k3_kl")) < 1e-6, same
    drifted = own.clone() - 0.3
    drifted[response_mask == 0] = -50.0  # masked-out tokens: any value, they must not count
    off = update(drifted)
    for kl in _per_micro_batch(off, "rollout_corr/kl"):
        assert abs(kl + 0.3) < 1e-4, off["rollout_corr/kl"]
    for diff in _per_micro_batch(off, "rollout_corr/log_ppl_abs_diff"):
        assert abs(diff - 0.3) < 1e-4, off["rollout_corr/log_ppl_abs_diff"]
    assert min(_per_micro_batch(off, "rollout_corr/k3_kl")) > 0.03, off["rollout_corr/k3_kl"]


def _per_micro_batch(metrics: dict, key: str) -> list[float]:
    """update_policy's values of `key`, one per micro-batch (it appends each micro-batch's list)."""
    values = []
    for value in metrics[key]:
        values.extend(value if isinstance(value, list) else [value])
    assert len(values) == ROWS // 2, (key, metrics[key])
    return values
