"""Ray actors that hold the devices, and the driver-side groups that place and call them.

worker         one device: a training engine and a vLLM rollout, colocated; generate, update, sync
group          WorkerGroup: Ray, placement, start-up, the typed calls, the first failure reported
split_workers  trainer.placement=split: TrainerWorker (engine only) and RolloutWorker (vLLM only)
split_group    trainer.placement=split on the driver: both kinds of worker behind WorkerGroup's calls
stall_report   a worker call that runs too long writes its Python stacks, and goes on
"""
