"""trainer.off_policy_steps=1 on the driver: the batch generated while an update runs, and how
far behind the adapter that sampled it is (docs/algorithms.md, "One step off-policy").

Step k: the prompts of step k+1 are drawn and their generation begins on the workers (Ahead),
step k's update runs beside it, the generation is collected and scored (BatchAhead), and only
then is the adapter of step k synced, so a generation never sees its adapter replaced. The
batch of step k+1 was therefore sampled by the adapter of step k-1: one version behind the one
its update starts from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lorarl.contract.messages import Rollouts
from lorarl.errors import TrainingError


def staleness(step: int, version: int, bound: int) -> int:
    """Adapter versions between `version`, the one that sampled step `step`'s batch, and the one
    its update starts from (step - 1 updates); a TrainingError outside [0, bound]."""
    behind = step - 1 - version
    if not 0 <= behind <= bound:
        raise TrainingError(
            f"the batch of step {step} was sampled by adapter version {version}, {behind} behind the update's "
            f"{step - 1}; this run allows {bound} (trainer.off_policy_steps, 0 while the run is on-policy)"
        )
    return behind


def overlap_plan(off_policy_steps: int, rollout_sleeps: bool, step: int) -> tuple[bool, str]:
    """Whether generation runs beside the update from step `step` + 1 on, and the line that says
    so. vLLM must stay awake for it. A plan that sleeps it (the estimate at start-up, or
    rollout.free_cache_engine=true) keeps the run on-policy; the plan that the first measured
    update changes to awake turns the overlap on for the steps after it."""
    setting = f"trainer.off_policy_steps={off_policy_steps}"
    if rollout_sleeps:
        return False, (
            f"{setting}: vLLM sleeps during the update (the plan above), so generation cannot run beside it; "
            "the run is on-policy while it sleeps"
        )
    return True, (
        f"{setting}: vLLM stays awake from step {step + 1}, so step {step + 2}'s batch is generated during "
        f"step {step + 1}'s update"
    )


@dataclass
class BatchAhead:
    """A step's batch generated during the previous update: its prompt groups (trainer.PromptGroup),
    generation seconds, the adapter version that sampled it, the epoch it was drawn in, and the
    loader and RNG state from before it was drawn (what a checkpoint saves: a resumed run draws
    and generates it again)."""

    groups: list
    seconds: float
    version: int
    epoch: int
    loader_state: dict
    rng: Any


@dataclass
class Ahead:
    """A generation begun on the workers (WorkerGroup.start_generate), not yet collected: the
    prompts per rollout engine, the epoch they were drawn in, the state from before drawing them."""

    shards: list[list]
    epoch: int
    loader_state: dict
    rng: Any

    def collect(self, gen: list[Rollouts], score: Callable[[list[list], list[Rollouts]], list]) -> BatchAhead:
        """The collected generation `gen` (one result per engine) scored: the next step's batch.
        Its version is the oldest any engine sampled with (they are synced together)."""
        return BatchAhead(
            groups=score(self.shards, gen),
            seconds=max(rollouts.seconds for rollouts in gen),
            version=min(rollouts.adapter_version for rollouts in gen),
            epoch=self.epoch,
            loader_state=self.loader_state,
            rng=self.rng,
        )
