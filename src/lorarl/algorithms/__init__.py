"""The RL algorithm: what a step computes from the rollouts, independent of the training engine.

advantages          group-normalised GRPO advantages and DAPO's overlong reward shaping (driver side)
losses              token log-probs and entropy, KL estimators, loss aggregation, PPO-clip and GSPO losses
rollout_correction  importance weights and rejection on the sampler/trainer mismatch
ppo                 the one PPO update both engines run: mini-batches, micro-batches, the loss, metrics

The batch it computes on and the Engine it drives are lorarl.contract.engine's.
"""
