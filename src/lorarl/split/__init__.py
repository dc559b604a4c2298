"""trainer.placement=split: training and rollout workers on devices of their own (group.py on the
driver, workers.py the two kinds of worker); the adapter goes through Ray (lorarl.sync.split)."""
