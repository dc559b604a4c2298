"""What the parts agree on, below all of them: the types that cross between driver, workers,
training engines, the PPO update, the weight sync and the rollout.

engine    the batch a training engine computes on, and the Engine protocol it implements
payload   the weights an engine exports and the rollout loads (WeightPayload, its kind)
messages  what crosses Ray between the driver and the workers, per call
specs     what a worker is given at start (WorkerSpec), built once on the driver
"""
