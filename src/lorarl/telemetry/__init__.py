"""Where a run's metrics go and how they are read back (the keys: lorarl.metrics).

tracking  console, metrics.jsonl, wandb, tensorboard
plot      PNG curves of a run or of every job of a sweep
sweep     the Hydra callback that sums up a multirun: summary.md, summary.csv, plots
"""
