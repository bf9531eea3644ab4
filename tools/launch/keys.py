"""Where a recipe config (a verl config) keeps the blocks the launcher reads: dotted key prefixes, defined once.

verl's own series restates A and R in verl/trainer/ppo/batch_sizes.py: the fork cannot import the superproject.
"""

A = "actor_rollout_ref.actor."  # the actor's verl settings
AM = A + "megatron."  # the actor's Megatron layout and the MindSpeed features our series adds
RM = "actor_rollout_ref.ref.megatron."  # the ref's Megatron layout
R = "actor_rollout_ref.rollout."  # verl's rollout (vLLM) settings
RR = "recipe.rollout."  # the rollout layout our series adds (DP, instances, EP)
