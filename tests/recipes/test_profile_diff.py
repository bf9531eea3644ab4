"""cpu-tiny is the A3 path at small scale: its resolved leaf keys equal a3-128-true-weight's except for the
differences listed here, each with its reason. Any other difference (a key in one profile only, or a value that
differs) fails, naming the key: a change to the A3 profile must reach cpu-tiny, or be listed here with why not."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.launch import config

CONFIGS = Path(__file__).resolve().parents[2] / "recipes" / "deepseek_r1" / "configs"
A3, TINY = CONFIGS / "a3-128-true-weight.yaml", CONFIGS / "cpu-tiny.yaml"
ABSENT = "<absent>"

SIZE = "size: the tiny model, 4 ranks, a few seconds per step"
DEVICE = "device: CPU ranks on one machine instead of 16 nodes of Atlas A3"
LEARN = "validation: held-out accuracy before the first step and every 5 steps, the smoke run's learning curve"
ENGINE = "rollout engine: vLLM 0.11.0's CPU engine (our fork's build) instead of vLLM-Ascend"
ASCEND_ONLY = ENGINE + "; a vLLM-Ascend setting (additional_config) the CPU engine does not read"
LAYOUT = "layout: TP2 x PP2 x EP1 on 4 ranks (A3: TP4 x PP8 x EP8 on 256), uneven stages as A3's"
SAVES = ("checkpoints: the A3 run saves 9.39 TB every 15 steps to a directory all 16 nodes mount (the yaml says why);"
         " cpu-tiny saves nothing by default (trainer.save_freq -1) and, told to, saves under its run dir")

# key -> why cpu-tiny differs from a3-128-true-weight (in value, or by having the key alone, or by lacking it)
ALLOWED = {
    # launch and recipe
    "launch.nodes": DEVICE,
    "launch.devices_per_node": DEVICE + " (TP2 x PP2)",
    "launch.accelerator": DEVICE,
    "launch.env_profile": DEVICE + " (env/cpu.yaml: gloo, no HCCL)",
    "launch.ray.join_timeout_s": DEVICE + ": one local node (300 s: a loaded 2-core machine took over 60 s)",
    "recipe.model_dims": SIZE,
    "recipe.rollout.data_parallel_size": LAYOUT + ": 2 instances of DP2 x TP1 (A3: 2 of DP64 x TP2)",
    "recipe.rollout.expert_parallel_size": LAYOUT + ": EP over an instance's DP2 x TP1 (A3: DP64 x TP2)",
    "recipe.rollout.torchair_graph": DEVICE + ": TorchAir graphs are NPU only (refused on cpu)",
    "recipe.checkpoints.dir": SAVES + " (null: <run dir>/checkpoints, one node)",
    "data.dataloader_num_workers": DEVICE + ": 0, verl 0.6.1's 8 loader processes stall two cores",
    "recipe.checkpoints.write_gb_per_s": SAVES + ": the shared filesystem's assumed bandwidth, for the A3 estimate",
    "recipe.checkpoints.step_s": SAVES + ": the A3 reference step, for the estimate of the time spent saving",
    "trainer.save_freq": SAVES,
    "trainer.max_actor_ckpt_to_keep": SAVES + " (A3: the newest two; cpu-tiny: verl's default, every one)",
    # data and batch
    "data.max_prompt_length": SIZE,
    "data.max_response_length": SIZE,
    "data.train_batch_size": SIZE,
    "actor_rollout_ref.actor.ppo_mini_batch_size": SIZE + " (= train_batch_size, as A3)",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": SIZE + ": 16 micro-batches of 8 through 2 stages",
    "actor_rollout_ref.actor.optim.lr": LEARN + ": the warm-started 4-layer model's accuracy rises within 20 steps",
    "actor_rollout_ref.rollout.n": SIZE,
    "trainer.total_training_steps": SIZE + ": the smoke run's 3 steps (A3 runs until stopped)",
    "trainer.total_epochs": SIZE + ": a pass over the tiny task is 23 steps; total_training_steps ends the run",
    # validation: the smoke run's learning curve (issue 17); at A3 scale each validation costs a rollout
    "trainer.test_freq": LEARN,
    "trainer.val_before_train": LEARN,
    "actor_rollout_ref.rollout.val_kwargs.top_k": LEARN + " (plain sampling, as the training rollouts)",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": LEARN + " (plain sampling, as the training rollouts)",
    "actor_rollout_ref.rollout.val_kwargs.temperature": LEARN + " (plain sampling, as the training rollouts)",
    "actor_rollout_ref.rollout.val_kwargs.n": LEARN + " (4 samples of each held-out problem)",
    "trainer.experiment_name": "name: the profile's own",
    # layout
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": LAYOUT,
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": LAYOUT,
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size": LAYOUT,
    "actor_rollout_ref.actor.megatron.num_layer_list": LAYOUT,
    "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers":
        LAYOUT + ": block recompute of the largest stage (3 layers; A3: 8)",
    "actor_rollout_ref.actor.megatron.logits_chunk_size": SIZE + ": chunks of a 160-column vocabulary shard",
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size": LAYOUT + " (the actor's, by interpolation)",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size": LAYOUT + " (the actor's, by interpolation)",
    "actor_rollout_ref.ref.megatron.expert_model_parallel_size": LAYOUT + " (the actor's, by interpolation)",
    "actor_rollout_ref.ref.megatron.num_layer_list": LAYOUT + " (the actor's, by interpolation)",
    # device: what only an NPU runs (each refused with launch.accelerator cpu)
    "actor_rollout_ref.actor.megatron.mindspeed.enable": DEVICE + ": MindSpeed kernels need torch_npu;"
                                                         " Megatron-core's torch layer spec on CPU",
    "actor_rollout_ref.actor.megatron.swap_optimizer": DEVICE + ": a MindSpeed feature, off with MindSpeed",
    "trainer.device": DEVICE,
    "trainer.nnodes": DEVICE + " (${launch.nodes})",
    "trainer.n_gpus_per_node": DEVICE + " (${launch.devices_per_node})",
    # weights
    # rollout engine
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ENGINE + ": its platform turns an external launcher with"
                                                            " TP > 1 into its own mp executor, so TP1",
    "actor_rollout_ref.rollout.data_parallel_size": LAYOUT + " (${recipe.rollout.data_parallel_size})",
    "actor_rollout_ref.rollout.temperature": SIZE + ": plain sampling of a random tiny model",
    "actor_rollout_ref.rollout.top_k": SIZE + ": plain sampling (-1 is off)",
    "actor_rollout_ref.rollout.top_p": SIZE + ": plain sampling",
    "actor_rollout_ref.rollout.verify_weight_sync": "check: a second full weight export and load per step,"
                                                    " affordable only at tiny scale",
    "actor_rollout_ref.rollout.gpu_memory_utilization": DEVICE + ": the CPU engine sizes its KV cache by"
                                                        " VLLM_CPU_KVCACHE_SPACE (env/cpu.yaml) instead",
    "actor_rollout_ref.rollout.enforce_eager": ENGINE + ": no graphs on CPU, and vLLM's Dynamo path does not trace"
                                               " under torch 2.13",
    "actor_rollout_ref.rollout.max_num_batched_tokens": SIZE + ": >= prompt + response (128 + 48)",
    "actor_rollout_ref.rollout.max_num_seqs": SIZE + ": 8 sequences per engine and step",
    "actor_rollout_ref.rollout.rebalance.check_every": SIZE + ": answers of at most 16 tokens (A3: 3072)",
    **{f"actor_rollout_ref.rollout.engine_kwargs.vllm.additional_config.{k}": ASCEND_ONLY for k in (
        "ascend_scheduler_config.enabled", "dp_sync_on_device", "refresh", "torchair_graph_config.enabled",
        "torchair_graph_config.enable_kv_nz", "torchair_graph_config.enable_multistream_mla",
        "multistream_overlap_shared_expert", "torchair_graph_config.enable_view_optimize",
        "torchair_graph_config.graph_batch_sizes")},
}


def leaves(node, prefix: str = "") -> dict:
    """Dotted key -> value of every leaf of a resolved config (lists and empty mappings are leaves)."""
    out = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def resolved_leaves(path: Path, overrides: tuple[str, ...] = ()) -> dict:
    return leaves(config.resolved(config.load(path, list(overrides)).cfg))


def differences(a3: dict, tiny: dict) -> dict[str, tuple]:
    """Key -> (A3 value, cpu-tiny value), ABSENT where a profile lacks the key."""
    return {k: (a3.get(k, ABSENT), tiny.get(k, ABSENT)) for k in sorted(a3.keys() | tiny.keys())
            if a3.get(k, ABSENT) != tiny.get(k, ABSENT)}


def unlisted(diff: dict[str, tuple]) -> list[str]:
    out = []
    for key, (a3, tiny) in diff.items():
        if key in ALLOWED:
            continue
        what = ("in a3-128-true-weight only" if tiny == ABSENT else "in cpu-tiny only" if a3 == ABSENT
                else "differs")
        out.append(f"{key}: {what} (a3-128-true-weight {a3!r}, cpu-tiny {tiny!r})")
    return out


def test_cpu_tiny_differs_from_a3_only_where_listed():
    problems = unlisted(differences(resolved_leaves(A3), resolved_leaves(TINY)))
    assert not problems, ("cpu-tiny.yaml is the A3 path at small scale; set these as a3-128-true-weight.yaml does,"
                          " or list them in ALLOWED with the reason:\n" + "\n".join(problems))


def test_every_listed_difference_is_one():
    """A stale entry would let a later difference pass unexplained."""
    diff = differences(resolved_leaves(A3), resolved_leaves(TINY))
    assert sorted(set(ALLOWED) - set(diff)) == []


@pytest.mark.parametrize("override, key", [
    ("actor_rollout_ref.tensor_cache.enable=false", "actor_rollout_ref.tensor_cache.enable"),
    ("actor_rollout_ref.rollout.reshard.experts=gather", "actor_rollout_ref.rollout.reshard.experts"),
    ("actor_rollout_ref.actor.megatron.sequence_parallel=false", "actor_rollout_ref.actor.megatron.sequence_parallel"),
    ("actor_rollout_ref.actor.megatron.seed=7", "actor_rollout_ref.actor.megatron.seed"),  # a key A3 does not set
])
def test_an_unlisted_difference_fails_naming_the_key(override, key):
    problems = unlisted(differences(resolved_leaves(A3), resolved_leaves(TINY, (override,))))
    assert [p.split(":")[0] for p in problems] == [key]
