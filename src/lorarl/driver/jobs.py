"""One job of a training run as the driver keeps it: its config and folder, its prompts, its log
and metrics, its checkpoints, and whether it has ended.

A run trains one adapter, one job. A sweep's group (hydra/launcher=shared_base) trains one adapter
per job over one base, in lockstep; each job still reads its own prompts in its own order (its
seed), writes only into its own folder (metrics.jsonl, grpo.log, checkpoints, final_adapter/,
plots), and can end alone (a non-finite loss) while the others go on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorarl import metrics as keys
from lorarl.config.run import RunConfig
from lorarl.contract.messages import Sampling
from lorarl.telemetry.sweep import ENDED_FILE
from lorarl.telemetry.tracking import Tracker


@dataclass(frozen=True)
class Job:
    """What a job is given: its validated config, its folder, and how messages name it."""

    run: RunConfig
    out_dir: Path
    label: str = "the adapter"


def sampling_of(run: RunConfig) -> Sampling:
    """How every training rollout of the run is drawn, as the update needs to know it."""
    return Sampling(
        n=run.rollout.n,
        temperature=run.rollout.temperature,
        max_response_length=run.data.max_response_length,
        seed=run.trainer.seed,
    )


class AdapterRun:
    """The driver's side of one job: its checked inputs (lorarl.driver.prepare), its sampling, its
    tracker and console, its checkpoint folder, and why it ended (None: still training)."""

    def __init__(self, index: int, job: Job, prepared: Any, say):
        self.index, self.run, self.out_dir, self.label = index, job.run, Path(job.out_dir), job.label
        self.loader, self.val_items, self.dropped_prompts = (
            prepared.loader,
            prepared.val_items,
            prepared.dropped_prompts,
        )
        self.ckpt, self.resume_from = prepared.checkpoints, prepared.resume_from
        self.prepare_seconds = prepared.seconds
        self.sampling = sampling_of(job.run)
        self.say = say
        self.tracker: Tracker | None = None
        self.ended: str | None = None
        self.last_reward: float | None = None

    def start_tracking(self, several: bool) -> None:
        """Its metrics.jsonl (and wandb/tensorboard runs); `several`: other jobs track beside it."""
        tc = self.run.trainer
        self.tracker = Tracker(
            tc.logger, self.out_dir, tc.project_name, tc.experiment_name, self.run.to_dict(), write=self.say,
            concurrent=several,
        )  # fmt: skip

    def log(self, row: dict, step: int) -> None:
        """One row of metrics. Every key is one of lorarl.metrics' list (a KeyError names one that is not)."""
        self.tracker.log({keys.checked(k): v for k, v in row.items()}, step=step)

    def end(self, why: str) -> None:
        """This job stops here, alone: its log says why; its metrics and checkpoints stay as they are."""
        self.ended = why
        self.say(f"error: {why}")
        (self.out_dir / ENDED_FILE).write_text(why + "\n")

    def note(self, line: str) -> None:
        """A line for this job's grpo.log only (what the console already shows once for all)."""
        from lorarl.telemetry.tracking import job_log

        job_log(self.out_dir).info(line)

    def finish(self) -> None:
        if self.tracker is not None:
            self.tracker.finish()
            self.tracker = None
