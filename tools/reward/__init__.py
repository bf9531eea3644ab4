"""Rule-based rewards for RL on verifiable math answers.

`math_score.compute_score(response, ground_truth)` is the pure function; `verl_entry.compute_score`
is the same reward under the signature verl's `custom_reward_function` calls.
"""
