"""`hydra/launcher=shared_base`: a sweep's jobs trained as adapters of one base, each in its own job folder.

Hydra hands a launcher the whole batch of a sweep's jobs. This one composes each job's config as
Hydra's basic launcher does, groups the jobs that can share a base (lorarl.driver.groups: the
same model, data, shapes and engines; different LoRA shape, optimizer, loss, sampling, seed), says
where each job went and why in one line before anything starts, and runs each group as one
multi-adapter run (lorarl.driver.group). A job that cannot share (another backend, merged sync,
...) runs on its own through Hydra's `run_job`, exactly as the basic launcher runs it.

Every job keeps the folder the basic launcher would give it: Hydra's own `run_job` makes it and
writes `.hydra/` (config.yaml, hydra.yaml, overrides.yaml) for a grouped job too, with a task that
only hands back the job's folder; the group's run then writes each job's metrics.jsonl, grpo.log,
final_adapter/, checkpoints and plots there. So the sweep summary and anything that reads a run
folder see what they always see.

Hydra finds launchers only under the top-level `hydra_plugins` namespace, and imports every module
there at each start: nothing heavy is imported at module level.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict, read_write

log = logging.getLogger(__name__)


class SharedBaseLauncher(Launcher):
    def __init__(self, max_adapters: int = 8) -> None:
        """`max_adapters`: the most jobs one group trains together (vLLM's LoRA slots, the
        trainer's adapters); more jobs of one kind make further groups."""
        if max_adapters < 1:
            raise ValueError(f"hydra.launcher.max_adapters={max_adapters} must be >= 1")
        self.max_adapters = max_adapters
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from lorarl.driver.groups import plan_groups

        setup_globals()
        assert self.config is not None and self.hydra_context is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        configs = [self._job_config(initial_job_idx + k, o) for k, o in enumerate(job_overrides)]
        labels = _varied([filter_overrides(o) for o in job_overrides])
        runs = [self._run_config(c) for c in configs]
        plan = plan_groups(runs, labels, self.max_adapters)
        log.info(f"Launching {len(configs)} jobs in {len(plan.groups)} group(s) on shared bases")
        for line in plan.lines:
            log.info(f"\t{line}")
        returns: dict[int, JobReturn] = {}
        for group in plan.groups:
            if group.alone is not None or len(group.jobs) == 1:
                for i in group.jobs:
                    returns[i] = self._run_alone(configs[i])
            else:
                returns.update(self._run_group(group.jobs, configs, runs))
        return [returns[i] for i in range(len(configs))]

    def _job_config(self, idx: int, overrides: Sequence[str]) -> DictConfig:
        """A job's whole config, as Hydra's basic launcher composes it."""
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config):
            config.hydra.job.id = idx
            config.hydra.job.num = idx
        return config

    @staticmethod
    def _run_config(config: DictConfig):
        """The job's validated RunConfig (None: it does not compose; running it alone reports why)."""
        from lorarl.config.compose import to_run_config
        from lorarl.errors import LorarlError

        HydraConfig.instance().set_config(config)  # ${hydra:...} in the job's keys resolve against it
        task = config.copy()
        with read_write(task), open_dict(task):
            del task["hydra"]
        try:
            return to_run_config(task)
        except (LorarlError, ValueError, KeyError) as err:
            log.info(f"\tjob {config.hydra.job.num}: {err}")
            return None

    def _run_alone(self, config: DictConfig) -> JobReturn:
        ret = run_job(
            hydra_context=self.hydra_context,
            task_function=self.task_function,
            config=config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return ret

    def _run_group(self, jobs: list[int], configs: list[DictConfig], runs: list) -> dict[int, JobReturn]:
        """Each job's folder made by Hydra's run_job (a task that returns the folder), then one
        multi-adapter run over all of them; each JobReturn carries its own job's result."""
        from lorarl.driver.group import run_group
        from lorarl.driver.jobs import Job

        returns: dict[int, JobReturn] = {}
        for i in jobs:
            returns[i] = run_job(
                hydra_context=self.hydra_context,
                task_function=lambda _cfg: HydraConfig.get().runtime.output_dir,
                config=configs[i],
                job_dir_key="hydra.sweep.dir",
                job_subdir_key="hydra.sweep.subdir",
                configure_logging=False,
            )
        group = [Job(runs[i], Path(returns[i].return_value), f"job {configs[i].hydra.job.num}") for i in jobs]
        for i, result in zip(jobs, run_group(group), strict=True):
            ret = returns[i]
            ret.status = JobStatus.FAILED if isinstance(result, Exception) else JobStatus.COMPLETED
            ret.return_value = result
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return returns


def _varied(overrides: list[list[str]]) -> list[str]:
    """Each job's overrides that not every job of the sweep shares: what tells the jobs apart."""
    common = set.intersection(*(set(o) for o in overrides)) if overrides else set()
    return [" ".join(o for o in job if o not in common) or "the sweep's common settings" for job in overrides]
