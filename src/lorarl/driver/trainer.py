"""The GRPO step loop, run on the driver.

    generate (vLLM on every worker, n samples per prompt, adapter attached)
    -> reward -> GRPO advantages
    -> old and reference log-probs, PPO update (workers, FSDP collectives)
    -> sync weights into vLLM -> log

With trainer.off_policy_steps=1 the next step's batch is generated while the update runs, by
the adapter before it (docs/algorithms.md, "One step off-policy"): update || generate -> sync.
With trainer.placement=split the generation runs on rollout workers of their own and the update on
the training workers (lorarl.workers.split_group), behind the same calls.

A run is one job with one adapter. A sweep's group (hydra/launcher=shared_base) is several jobs
trained in lockstep as adapters of one base: each step is still three calls, each carrying every
job's share (one generation, one update, one sync), and each job's prompts, rewards, advantages,
metrics and files stay its own (lorarl.driver.jobs). A job whose update fails (a non-finite loss)
ends alone; the others go on.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from lorarl import metrics as keys
from lorarl.algorithms import advantages
from lorarl.config.compose import to_run_config
from lorarl.config.run import steps_for
from lorarl.contract.messages import SyncReport, SyncRequest, UpdateRequest, reduce_metrics
from lorarl.driver.jobs import AdapterRun, Job
from lorarl.driver.off_policy import Ahead, BatchAhead, overlap_plan, staleness
from lorarl.driver.rollouts import Draw, PromptGroup, per_job, requests_for, sampling_seed, score_groups, split
from lorarl.errors import LorarlError
from lorarl.files.checkpoint import read_trainer_state, write_trainer_state
from lorarl.telemetry.sweep import ENDED_FILE
from lorarl.telemetry.tracking import console, job_console, redact

# Validation samples engine i with seed VALIDATION_SEED + i at every step: the same draws each
# time, so validation numbers of two steps differ only by the weights.
VALIDATION_SEED = 12345


def run(cfg: DictConfig) -> float | None:
    """Entry point behind `python -m recipes.grpo`: returns the final mean reward."""
    from hydra.core.hydra_config import HydraConfig

    run_cfg = to_run_config(cfg)
    out_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path.cwd()
    trainer = GRPOTrainer([Job(run_cfg, out_dir)])
    try:
        return trainer.fit()[0]
    finally:
        trainer.close()


def startup_lines(first_sync: SyncReport, startup: dict[str, float]) -> list[str]:
    """The console's two lines about the first sync and where the start-up time went."""
    return [
        f"first sync: {first_sync.kind}, {first_sync.num_tensors} tensors, "
        f"{first_sync.bytes / 2**20:.2f} MiB, {first_sync.seconds:.3f} s",
        f"start-up: checks {startup[keys.INIT_TIMING_PREPARE.key]:.1f} s, Ray {startup[keys.INIT_TIMING_RAY_INIT.key]:.1f} s, "
        f"workers placed {startup[keys.INIT_TIMING_WORKERS_START.key]:.1f} s, "
        f"vLLM engine {startup[keys.INIT_TIMING_ROLLOUT_START.key]:.1f} s, "
        f"training engine {startup[keys.INIT_TIMING_ENGINE_BUILD.key]:.1f} s",
    ]


class GRPOTrainer:
    def __init__(self, jobs: list[Job]):
        """`jobs`: a run's one job, or a sweep group's jobs (the same base, data and shapes:
        lorarl.driver.groups), each trained as an adapter of its own."""
        from tqdm.auto import tqdm

        from lorarl.driver.prepare import group_worker_spec, prepare

        self.workers = None
        several = len(jobs) > 1
        self.jobs: list[AdapterRun] = []
        for i, job in enumerate(jobs):
            say = job_console(job.out_dir, job.label, tqdm.write) if several else console(tqdm.write)
            # Every check the driver can make, before Ray starts (lorarl.driver.prepare); bad input fails here.
            prepared = prepare(job.run, Path(job.out_dir))
            self.jobs.append(AdapterRun(i, job, prepared, say))
        self.run = jobs[0].run  # what every job of a group shares: model, data, shapes, engines
        self.device, self.tokenizer = prepared.device, prepared.tokenizer
        self.worker_spec = group_worker_spec([j.run for j in self.jobs], [j.label for j in self.jobs], self.device) if several else prepared.worker_spec  # fmt: skip
        self.total_steps = steps_for(self.run, self.jobs[0].loader.steps_per_epoch)
        self.step = 0
        # trainer.off_policy_steps=1 (one job): the batch generated during the last update, and
        # whether the workers can overlap the two (decided in fit, from their sleep plans).
        self.ahead: BatchAhead | None = None
        self.overlap = False
        self.sampled_version = 0

    @property
    def active(self) -> list[AdapterRun]:
        return [j for j in self.jobs if j.ended is None]

    def say_all(self, line: str) -> None:
        """A line about every job: on the console once, in each job's log."""
        if len(self.jobs) == 1:
            return self.jobs[0].say(line)
        from tqdm.auto import tqdm

        tqdm.write(f"[all jobs] {line}")
        for job in self.jobs:
            job.note(line)

    # ---- loop ----------------------------------------------------------------------------

    def fit(self) -> list[float | None]:
        """Train every job to the end; each job's last mean reward (None: it ended alone)."""
        from tqdm.auto import tqdm

        from lorarl.workers.group import WorkerGroup
        from lorarl.workers.split_group import SplitWorkerGroup

        tc = self.run.trainer
        for job in self.jobs:
            job.start_tracking(several=len(self.jobs) > 1)
            if job.dropped_prompts:
                job.say(f"data: dropped {job.dropped_prompts} prompts longer than data.max_prompt_length")
        group = SplitWorkerGroup if tc.placement == "split" else WorkerGroup
        first = self.jobs[0]
        self.workers = group(self.run, self.worker_spec, self.device, run_dir=first.out_dir, say=self.say_all)
        # Where each rank runs, in the run log and the metrics (a multi-node run can be checked).
        self.say_all(f"workers: {self.workers.describe()}")
        node_ids = [where.node_id for where in self.workers.placement]
        placement = {keys.INIT_NUM_NODES.key: len(set(node_ids)), keys.INIT_WORKER_NODE_IDS.key: ",".join(node_ids)}
        for plan in dict.fromkeys([str(self.worker_spec.base_plan), *self.workers.sleep_plans]):
            self.say_all(plan)
        sync = self.worker_spec.sync
        if sync.check and not sync.semantic:
            self.say_all(
                f"sync checks: the {self.run.backend.strategy} engine has no semantic check yet for "
                f"{'merged' if sync.merge else 'adapter'} sync (sync/adapter_meaning); the transport fingerprint and the "
                "probe check each sync"
            )
        if tc.off_policy_steps:
            self.overlap, line = overlap_plan(tc.off_policy_steps, self.workers.rollout_sleeps, self.step)
            if not self.overlap:
                first.say(line)
        resumed = self.resume()
        # The first sync puts the trainer's weights into vLLM (the base too, if vLLM started from dummy weights).
        first_syncs = self.workers.sync(SyncRequest(step=0, last=False, version=self.step))
        pending = {}
        for job, first_sync in zip(self.jobs, first_syncs, strict=True):
            startup = {keys.INIT_TIMING_PREPARE.key: job.prepare_seconds, **self.workers.startup}
            row = {**placement, **startup, **{keys.init_key(k): v for k, v in first_sync.metrics().items()}}
            # Every row carries the step it belongs to: a resumed process's start-up goes into the row of
            # the first step it trains, so metrics.jsonl has the steps an uninterrupted run has.
            pending[job.index] = row if 0 < self.step < self.total_steps else {}
            if not pending[job.index]:
                job.log(row, step=self.step)
            for line in startup_lines(first_sync, startup):
                job.say(line)
        if tc.val_before_train and first.val_items and not resumed:
            for job, row in self.validate().items():
                job.log(row, step=0)
        bar = tqdm(
            total=self.total_steps, initial=self.step, desc="grpo", disable=not tc.progress_bar, dynamic_ncols=True
        )
        while self.step < self.total_steps and self.active:
            self.step += 1
            self.run_step(pending, bar)
            pending = {}
        bar.close()
        self.finish()
        return [job.last_reward if job.ended is None else None for job in self.jobs]

    def run_step(self, pending: dict[int, dict], bar) -> None:
        """One step of every active job, its validation and checkpoint when due, logged per job."""
        tc = self.run.trainer
        try:
            rows, syncs = self.train_step()
            if (
                tc.test_freq > 0
                and self.jobs[0].val_items
                and (self.step % tc.test_freq == 0 or self.step == self.total_steps)
            ):
                for job, row in self.validate().items():
                    rows[job].update(row)
            if tc.save_freq > 0 and (self.step % tc.save_freq == 0 or self.step == self.total_steps):
                seconds = self.save_checkpoint()
                for row in rows.values():
                    row[keys.TIMING_SAVE.key] = seconds
        except LorarlError as err:
            raise type(err)(self._stopped_at(err)) from err
        sync = syncs[0]
        if sync.sleep_plan:
            self.say_all(f"step {self.step}: from the next step the {sync.sleep_plan}")
            if tc.off_policy_steps and not self.overlap and sync.rollout_sleeps is False:
                self.overlap, line = overlap_plan(tc.off_policy_steps, False, self.step)
                self.jobs[0].say(line)
        for job, row in rows.items():
            job.log({**pending.get(job.index, {}), **row}, step=self.step)
            job.last_reward = row[keys.REWARD_MEAN.key]
        bar.update(1)
        shown = next((job for job in self.jobs if job in rows), None)  # a job that trained this step
        bar.set_postfix(reward=f"{shown.last_reward:.3f}" if shown else "-", sync=sync.kind)

    def finish(self) -> None:
        """Each job that ran to the end: its final adapter, and its plots."""
        done = self.active
        finals = [str(job.out_dir / "final_adapter") for job in self.jobs]
        self.workers.export_adapter(finals)
        for job in done:
            job.say(f"final adapter: {job.out_dir / 'final_adapter'}")
        for job in self.jobs:
            if "jsonl" in job.run.trainer.logger:
                from lorarl.telemetry.plot import plot

                job.finish()
                plots = plot(job.out_dir)
                job.say(f"plots: {', '.join(p.name for p in plots)} in {job.out_dir}")

    def _stopped_at(self, err: LorarlError) -> str:
        """The error with the step it stopped at and the checkpoint a relaunch would resume from."""
        msg = str(err)
        if not msg.startswith(f"step {self.step}:"):
            msg = f"step {self.step}: {msg}"
        latest = self.jobs[0].ckpt.latest()
        if latest is None:
            return f"{msg}; no checkpoint was saved (trainer.save_freq={self.run.trainer.save_freq})"
        return f"{msg}; last complete checkpoint: {latest} (relaunch with the same hydra.run.dir to resume from it)"

    # ---- checkpoints ---------------------------------------------------------------------

    def resume(self) -> bool:
        """Load the checkpoint each job resumes from; a group's jobs from their newest common step."""
        from lorarl.files.checkpoint import common_resume

        found = common_resume([(job.ckpt, job.resume_from) for job in self.jobs])
        if found is None:
            return False
        self.load_checkpoint(found)
        for job, path in zip(self.jobs, found, strict=True):
            # The steps after the checkpoint run again: their rows from the stopped process go.
            job.tracker.drop_after(self.step)
            job.say(f"resumed from {path} at step {self.step}")
            if (job.out_dir / ENDED_FILE).is_file():
                job.ended = (job.out_dir / ENDED_FILE).read_text().strip()
                job.say(f"ended before: {job.ended}")
        if self.overlap:
            self.jobs[0].say(
                f"off-policy resume: the batch that was in flight at the checkpoint is generated again, by the "
                f"checkpoint's adapter (same prompts and seeds; rollout/staleness 0 at step {self.step + 1})"
            )
        return True

    def save_checkpoint(self) -> float:
        """Every job's checkpoint at this step in its own folder, committed together: all jobs'
        folders are whole before any old checkpoint is pruned, so a kill leaves a common step."""
        t0 = time.perf_counter()
        tmps = [job.ckpt.begin(self.step) for job in self.jobs]
        try:
            self.workers.save_checkpoint([str(tmp) for tmp in tmps])
            # A batch generated ahead is not saved: the loader is saved as it was before drawing
            # it, and a resumed run draws and generates it again (fit says so).
            ahead = self.ahead
            for job, tmp in zip(self.jobs, tmps, strict=True):
                config_yaml = OmegaConf.to_yaml(redact(job.run.to_dict()))
                loader_state = ahead.loader_state if ahead else job.loader.state_dict()
                write_trainer_state(
                    tmp, self.step, loader_state, ahead.rng if ahead else random.getstate(), config_yaml
                )
            for job, tmp in zip(self.jobs, tmps, strict=True):
                job.ckpt.commit(tmp, self.step, prune=False)
        except BaseException:
            for job, tmp in zip(self.jobs, tmps, strict=True):
                job.ckpt.abort(tmp)
            raise
        for job in self.jobs:
            job.ckpt.prune()
        return time.perf_counter() - t0

    def load_checkpoint(self, paths: list[Path]) -> None:
        self.workers.load_checkpoint([str(p) for p in paths])
        for job, path in zip(self.jobs, paths, strict=True):
            step, loader_state, python_rng = read_trainer_state(path)
            job.loader.load_state_dict(loader_state)
        self.step = step
        random.setstate(python_rng)

    # ---- the step --------------------------------------------------------------------------

    def train_step(self) -> tuple[dict[AdapterRun, dict], list[SyncReport]]:
        """One GRPO step: three calls to the workers (generate; update; sync). Returns each active
        job's metrics and the sync reports (their first's kind and a changed sleep plan go to the
        console). Off-policy, the batch is the one generated during the last update, and the next
        one is generated during this update (start_generate; collected before the sync)."""
        t_step = time.perf_counter()
        if self.ahead is None:
            groups, gen_rounds, t_gen = self.rollout_groups()
            version, epochs = self.sampled_version, {job: job.loader.epoch for job in self.active}
        else:
            ahead, self.ahead = self.ahead, None
            groups, gen_rounds, t_gen = {self.jobs[0]: ahead.groups}, 1, ahead.seconds
            version, epochs = ahead.version, {self.jobs[0]: ahead.epoch}
        next_ahead = self.start_ahead() if self.overlap and self.step < self.total_steps else None
        t0 = time.perf_counter()
        train = self.workers.update(self.update_requests(groups))
        t_update = time.perf_counter() - t0
        t_gen_wait = None
        if next_ahead is not None:
            t0 = time.perf_counter()
            self.ahead = next_ahead.collect(self.workers.collect_generate(), self._score_shares)
            t_gen_wait = time.perf_counter() - t0
        t0 = time.perf_counter()
        syncs = self.workers.sync(SyncRequest(self.step, last=self.step == self.total_steps))
        t_sync = time.perf_counter() - t0
        timings = {keys.TIMING_GEN.key: t_gen, keys.TIMING_TRAIN.key: t_update, keys.TIMING_SYNC.key: t_sync}
        rows = {}
        for job, job_groups in groups.items():
            ended = next((r.ppo[job.index].ended for r in train if r.ppo[job.index].ended), None)
            if ended is not None and len(self.jobs) > 1:
                job.end(ended)  # its weights were left as they were; the others go on
                continue
            rows[job] = self.job_metrics(job, job_groups, train, syncs[job.index], gen_rounds)
            rows[job].update(timings)
            rows[job][keys.TIMING_STEP.key] = time.perf_counter() - t_step
            if t_gen_wait is not None:
                rows[job][keys.TIMING_GEN_WAIT.key] = t_gen_wait
            rows[job][keys.DATA_EPOCH.key] = epochs[job]
            if self.run.trainer.off_policy_steps:
                bound = self.run.trainer.off_policy_steps if self.overlap else 0
                rows[job][keys.ROLLOUT_STALENESS.key] = staleness(self.step, version, bound)
        return rows, syncs

    def job_metrics(self, job: AdapterRun, groups: list[PromptGroup], train, sync: SyncReport, rounds: int) -> dict:
        """One job's row of the step: its rewards, lengths, its update (over replicas) and sync."""
        rewards = torch.tensor([x for g in groups for x in g.rewards], dtype=torch.float32)
        lengths = [len(s) for g in groups for s in g.samples]
        replicas = [report.metrics(job.index) for report in train]
        metrics = {
            keys.REWARD_MEAN.key: float(rewards.mean()),
            keys.REWARD_STD.key: float(rewards.std()) if len(rewards) > 1 else 0.0,
            keys.RESPONSE_LENGTH_MEAN.key: sum(lengths) / len(lengths),
            keys.RESPONSE_LENGTH_MAX.key: max(lengths),
            **reduce_metrics({k: [replica[k] for replica in replicas] for k in replicas[0]}),
            **sync.metrics(),
        }
        fg, ob = job.run.algorithm.filter_groups, job.run.algorithm.overlong_buffer
        if fg.enable:
            metrics[keys.DATA_GEN_ROUNDS.key] = rounds
            metrics[keys.DATA_GROUPS_WITH_SIGNAL.key] = sum(g.has_signal(fg.metric) for g in groups) / len(groups)
        if ob.enable:
            penalties = [p for g in groups for p in g.overlong]
            metrics[keys.REWARD_OVERLONG_REWARD.key] = sum(penalties) / len(penalties)
            metrics[keys.REWARD_OVERLONG.key] = sum(p < 0 for p in penalties) / len(penalties)
        return metrics

    def start_ahead(self) -> Ahead:
        """Draw the next step's prompts and begin their generation on the workers (returns at once)."""
        job = self.jobs[0]
        state = (job.loader.state_dict(), random.getstate())
        shares, requests = self.generation_requests({job: job.loader.next_batch()}, self.step + 1)
        self.workers.start_generate(requests)
        return Ahead(shares, job.loader.epoch, *state)

    def update_requests(self, groups: dict[AdapterRun, list[PromptGroup]]) -> list[UpdateRequest]:
        """Group-normalised advantages, per job; each job's prompt groups split contiguously over
        data-parallel replicas, a replica's request holding every job's share."""
        dp, several = self.workers.dp_size, len(self.jobs) > 1
        requests = []
        for d in range(dp):
            prompt_ids, response_ids, adv, logps, adapters = [], [], [], [], []
            for job, job_groups in groups.items():
                shard = split(job_groups, dp)[d]
                scores = [x for g in shard for x in g.rewards]
                index = [k for k, g in enumerate(shard) for _ in g.samples]
                norm = job.run.algorithm.norm_adv_by_std_in_grpo
                adv += advantages.grpo_advantages(torch.tensor(scores), torch.tensor(index), norm_by_std=norm).tolist()
                prompt_ids += [g.item.prompt_ids for g in shard for _ in g.samples]
                response_ids += [s for g in shard for s in g.samples]
                logps += [lp for g in shard for lp in g.logprobs]
                adapters += [job.index] * len(index)
            requests.append(
                UpdateRequest(
                    step=self.step,
                    prompt_ids=prompt_ids,
                    response_ids=response_ids,
                    advantages=adv,
                    rollout_logprobs=logps,
                    samplings=tuple(job.sampling for job in self.jobs),
                    adapters=adapters if several else None,
                )
            )
        return requests

    def rollout_groups(self) -> tuple[dict[AdapterRun, list[PromptGroup]], int, float]:
        """Each active job's data.train_batch_size prompt groups, sampled and scored: (groups per job,
        generation rounds, generation seconds). With algorithm.filter_groups (one job), groups whose
        `metric` is equal for every sample carry no signal and are replaced by groups of further
        prompts (DAPO's dynamic sampling; data.gen_batch_size prompts a round), for at most
        max_num_gen_batches rounds (0: until the batch is full, as verl); a batch still short is
        filled with them (verl stops the run with an error there)."""
        fg = self.run.algorithm.filter_groups
        if not fg.enable:
            groups, seconds = self.sample_groups({job: job.loader.next_batch() for job in self.active})
            return groups, 1, seconds
        job, size = self.jobs[0], self.run.data.train_batch_size
        kept: list[PromptGroup] = []
        flat: list[PromptGroup] = []
        seconds, rounds = 0.0, 0
        while True:
            rounds += 1
            groups, gen_s = self.sample_groups({job: job.loader.next_batch()}, round_index=rounds - 1)
            seconds += gen_s
            kept += [g for g in groups[job] if g.has_signal(fg.metric)]
            flat += [g for g in groups[job] if not g.has_signal(fg.metric)]
            if len(kept) >= size or 0 < fg.max_num_gen_batches <= rounds:
                break
        return {job: (kept + flat)[:size]}, rounds, seconds

    def sample_groups(self, prompts: dict[AdapterRun, list], round_index: int = 0):
        """rollout.n samples of each job's prompts from vLLM (one call, prompts split over its
        engines), scored: (groups per job, generation seconds)."""
        shares, requests = self.generation_requests(prompts, self.step, round_index)
        gen = self.workers.generate(requests)
        self.sampled_version = min(rollouts.adapter_version for rollouts in gen)
        came = per_job(shares, gen)
        groups = {job: score_groups(job.run, came.get(job, []), self.scorer(job)) for job in prompts}
        return groups, max(rollouts.seconds for rollouts in gen)

    def generation_requests(self, prompts: dict[AdapterRun, list], step: int, round_index: int = 0):
        """Each engine's share of every job's prompts and its request for `step` (lorarl.driver.rollouts)."""
        r, seed = self.run.rollout, self.run.trainer.seed
        draws = {job: Draw(job.index, r.n, job.run.rollout.temperature, job.run.rollout.top_p) for job in prompts}
        return requests_for(
            prompts,
            draws,
            self.workers.rollout_size,
            self.run.data.max_response_length,
            lambda engine: sampling_seed(seed, step, engine, round_index),
            for_training=True,
        )

    def _score_shares(self, shares, gen) -> list[PromptGroup]:
        """The off-policy batch (one job) scored, as Ahead.collect asks."""
        job = self.jobs[0]
        return score_groups(job.run, per_job(shares, gen).get(job, []), self.scorer(job))

    def scorer(self, job: AdapterRun):
        """`score(item, response_ids)`: the job's reward for one response."""
        from lorarl.rewards import RESPONSE_IDS, get_reward_fn

        d = job.run.data

        def score(item, response_ids: list[int]) -> float:
            text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
            fn = get_reward_fn(item.data_source, d.reward_fn, job.run.reward, d.reward_kwargs)
            return float(fn(text, item.ground_truth, {**item.extra_info, RESPONSE_IDS: list(response_ids)}))

        return score

    def validate(self) -> dict[AdapterRun, dict]:
        """Every active job's generation on data.val_files with rollout.val_kwargs (one call);
        lorarl.driver.evaluation turns each job's texts into its metrics."""
        from lorarl.driver.evaluation import validation_metrics

        vk, d = self.run.rollout.val_kwargs, self.run.data
        temperature = vk.temperature if vk.do_sample else 0.0
        jobs = self.active
        t0 = time.perf_counter()
        shares, requests = requests_for(
            {job: job.val_items for job in jobs},
            {job: Draw(job.index, vk.n, temperature, vk.top_p) for job in jobs},
            self.workers.rollout_size,
            d.max_response_length,
            lambda engine: VALIDATION_SEED + engine,
            for_training=False,
        )
        came = per_job(shares, self.workers.generate(requests))
        seconds = time.perf_counter() - t0
        out = {}
        for job in jobs:
            rows = came.get(job, [])
            texts = [[self.tokenizer.decode(s, skip_special_tokens=True) for s in samples] for _, samples, _ in rows]
            token_ids = [[list(s) for s in samples] for _, samples, _ in rows]
            jd = job.run.data
            items = [item for item, _, _ in rows]
            out[job] = validation_metrics(items, texts, job.run.reward, jd.reward_fn, token_ids, jd.reward_kwargs)
            out[job][keys.TIMING_VAL.key] = seconds
        return out

    def close(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        for job in self.jobs:
            job.finish()
