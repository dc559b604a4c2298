"""The run on the driver: the step loop and everything decided before the workers start.

trainer     GRPOTrainer: generate -> reward -> advantages -> update -> sync -> log, checkpoints, validation
jobs        one job of a run (a sweep group has several): its folder, prompts, log, metrics, checkpoints
rollouts    a step's prompts as vLLM requests, and what comes back as scored GRPO groups
group       a sweep's group trained on one base (hydra/launcher=shared_base); groups: which jobs share one
prepare     every start-up check the driver can make, then the WorkerSpec each worker is given
preflight   the model's and the installed vLLM's checks, from config.json and vLLM's registry
off_policy  trainer.off_policy_steps=1: the batch generated during the update, its staleness
evaluation  validation metrics from decoded responses: reward and accuracy per data source
entry       how a training command ends for the user: one line and exit 2, or an orderly shutdown
"""
