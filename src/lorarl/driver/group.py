"""A sweep's group trained on one base: the entry the shared-base launcher calls per group.

hydra_plugins.lorarl_launcher.shared_base makes each job's folder as Hydra's basic launcher
would, then hands the group here: one GRPOTrainer over every job (lorarl.driver.trainer), run as a
command (lorarl.driver.entry: a mistake ends the sweep in one line, exit 2, as a failing job does
under the basic launcher). What comes back per job is its last mean reward, or None for a job
that ended alone (its folder's grpo.log and ended.txt say why).
"""

from __future__ import annotations

from lorarl.driver.entry import as_command
from lorarl.driver.jobs import Job
from lorarl.errors import LorarlError


def run_group(jobs: list[Job]) -> list[float | None]:
    from lorarl.driver.trainer import GRPOTrainer

    with as_command():
        trainer = GRPOTrainer(jobs)
        try:
            return trainer.fit()
        except LorarlError as err:
            # What stopped the group, in every job's own log too (the console shows it once).
            for job in trainer.jobs:
                job.note(f"error: {err}")
            raise
        finally:
            trainer.close()
