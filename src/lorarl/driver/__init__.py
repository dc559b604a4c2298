"""The run on the driver: the step loop and everything decided before the workers start.

trainer     GRPOTrainer: generate -> reward -> advantages -> update -> sync -> log, checkpoints, validation
prepare     every start-up check the driver can make, then the WorkerSpec each worker is given
preflight   the model's and the installed vLLM's checks, from config.json and vLLM's registry
off_policy  trainer.off_policy_steps=1: the batch generated during the update, its staleness
evaluation  validation metrics from decoded responses: reward and accuracy per data source
"""
