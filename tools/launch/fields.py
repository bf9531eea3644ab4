"""Each field of the typed run config (config.Recipe) and the config key it is read from, written out in full.

The one map: layout.from_config reads every key through it, and preflight, inputs, resume and timing name the key
of a field through it in their checks and errors. A field path is the attribute path on the typed config (Layout's
fields: `train.pp` is Layout.train.pp).
"""

from __future__ import annotations

KEY: dict[str, str] = {
    # the cluster
    "nodes": "launch.nodes",
    "devices_per_node": "launch.devices_per_node",
    "accelerator": "launch.accelerator",
    # the actor's Megatron layout and memory features
    "train.tp": "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
    "train.pp": "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
    "train.ep": "actor_rollout_ref.actor.megatron.expert_model_parallel_size",
    "train.etp": "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size",
    "train.extend_ep": "actor_rollout_ref.actor.megatron.moe_tp_extend_ep",
    "train.layer_list": "actor_rollout_ref.actor.megatron.num_layer_list",
    "train.vpp": "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size",
    "train.distributed_optimizer": "actor_rollout_ref.actor.megatron.use_distributed_optimizer",
    "sequence_parallel": "actor_rollout_ref.actor.megatron.sequence_parallel",
    "swap_optimizer": "actor_rollout_ref.actor.megatron.swap_optimizer",
    "optimizer_offload": "actor_rollout_ref.actor.megatron.optimizer_offload",
    "param_offload": "actor_rollout_ref.actor.megatron.param_offload",
    "grad_offload": "actor_rollout_ref.actor.megatron.grad_offload",
    "transformer_config": "actor_rollout_ref.actor.megatron.override_transformer_config",
    "recompute_granularity": "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity",
    "recompute_method": "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method",
    "recompute_num_layers": "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers",
    # the ref's Megatron layout
    "ref.tp": "actor_rollout_ref.ref.megatron.tensor_model_parallel_size",
    "ref.pp": "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size",
    "ref.ep": "actor_rollout_ref.ref.megatron.expert_model_parallel_size",
    "ref.etp": "actor_rollout_ref.ref.megatron.expert_tensor_parallel_size",
    "ref.extend_ep": "actor_rollout_ref.ref.megatron.moe_tp_extend_ep",
    "ref.layer_list": "actor_rollout_ref.ref.megatron.num_layer_list",
    "ref_param_offload": "actor_rollout_ref.ref.megatron.param_offload",
    # the rollout (vLLM) and its layout (recipe.rollout)
    "rollout_name": "actor_rollout_ref.rollout.name",
    "rollout_tp": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "rollout_dp": "recipe.rollout.data_parallel_size",
    "rollout_instances": "recipe.rollout.instances",
    "rollout_ep": "recipe.rollout.expert_parallel_size",
    "gpu_memory_utilization": "actor_rollout_ref.rollout.gpu_memory_utilization",
    "max_num_seqs": "actor_rollout_ref.rollout.max_num_seqs",
    "max_num_batched_tokens": "actor_rollout_ref.rollout.max_num_batched_tokens",
    "chunked_prefill": "actor_rollout_ref.rollout.enable_chunked_prefill",
    "max_model_len": "actor_rollout_ref.rollout.max_model_len",
    # the batch
    "train_batch": "data.train_batch_size",
    "n": "actor_rollout_ref.rollout.n",
    "mini_batch": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "micro_batch": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "ref_micro_batch": "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "rollout_logprob_micro_batch": "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "prompt_len": "data.max_prompt_length",
    "response_len": "data.max_response_length",
    "ppo_epochs": "actor_rollout_ref.actor.ppo_epochs",
    "recompute_old_log_prob": "actor_rollout_ref.actor.recompute_old_log_prob",
    "adv_estimator": "algorithm.adv_estimator",
    "use_kl_loss": "actor_rollout_ref.actor.use_kl_loss",
    "use_kl_in_reward": "algorithm.use_kl_in_reward",
    "trainer_nnodes": "trainer.nnodes",
    "trainer_devices": "trainer.n_gpus_per_node",
    # checkpoints
    "checkpoints.save_freq": "trainer.save_freq",
    "checkpoints.keep": "trainer.max_actor_ckpt_to_keep",
    "checkpoints.dir": "recipe.checkpoints.dir",
    "checkpoints.contents": "actor_rollout_ref.actor.checkpoint.save_contents",
    # what the step time depends on besides the layout (config.Recipe.rollout)
    "rollout.tensor_cache": "actor_rollout_ref.tensor_cache.enable",
    "rollout.reshard_experts": "actor_rollout_ref.rollout.reshard.experts",
    "rollout.lifecycle": "actor_rollout_ref.rollout.lifecycle",
    "rollout.calculate_log_probs": "actor_rollout_ref.rollout.calculate_log_probs",
    "rollout.ignore_eos": "actor_rollout_ref.rollout.ignore_eos",
    "rollout.rebalance": "actor_rollout_ref.rollout.rebalance.enable",
    # what the run reads from disk (config.Recipe.inputs)
    "inputs.model_path": "actor_rollout_ref.model.path",
    "inputs.train_files": "data.train_files",
    "inputs.val_files": "data.val_files",
    "inputs.weights_load": "recipe.weights.load",
    "inputs.mcore_checkpoint": "recipe.weights.mcore_checkpoint",
    "inputs.actor_dist": "actor_rollout_ref.actor.megatron.use_dist_checkpointing",
    "inputs.ref_dist": "actor_rollout_ref.ref.megatron.use_dist_checkpointing",
    "inputs.actor_dist_path": "actor_rollout_ref.actor.megatron.dist_checkpointing_path",
    "inputs.ref_dist_path": "actor_rollout_ref.ref.megatron.dist_checkpointing_path",
}
