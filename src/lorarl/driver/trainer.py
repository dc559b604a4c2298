"""The GRPO step loop, run on the driver.

    generate (vLLM on every worker, n samples per prompt, adapter attached)
    -> reward -> GRPO advantages
    -> old and reference log-probs, PPO update (workers, FSDP collectives)
    -> sync weights into vLLM -> log

With trainer.off_policy_steps=1 the next step's batch is generated while the update runs, by
the adapter before it (docs/algorithms.md, "One step off-policy"): update || generate -> sync.
With trainer.placement=split the generation runs on rollout workers of their own and the update on
the training workers (lorarl.workers.split_group), behind the same calls.

Prompts are split contiguously over workers, so the n samples of a prompt, and therefore
its GRPO group, stay on one worker.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lorarl import metrics as keys
from lorarl.algorithms import advantages
from lorarl.config.compose import to_run_config
from lorarl.config.run import RunConfig, steps_for
from lorarl.contract.messages import (
    GenerateRequest,
    Rollouts,
    Sampling,
    SyncReport,
    SyncRequest,
    UpdateRequest,
    reduce_metrics,
)
from lorarl.driver.off_policy import Ahead, BatchAhead, overlap_plan, staleness
from lorarl.errors import LorarlError
from lorarl.files.checkpoint import read_trainer_state, write_trainer_state
from lorarl.telemetry.tracking import Tracker, console, redact

# Validation samples engine i with seed VALIDATION_SEED + i at every step: the same draws each
# time, so validation numbers of two steps differ only by the weights.
VALIDATION_SEED = 12345


def sampling_seed(seed: int, step: int, shard: int, round_index: int = 0) -> int:
    """The rollout seed of one data-parallel shard at one step (and generation round, for
    dynamic sampling): distinct across all of them (seed + step + shard collided: shard 1 of
    step s drew what shard 0 drew at step s + 1)."""
    import numpy as np

    entropy = [seed, step, shard] + ([round_index] if round_index else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def sampling_of(run: RunConfig) -> Sampling:
    """How every training rollout of the run is drawn, as the update needs to know it."""
    return Sampling(
        n=run.rollout.n,
        temperature=run.rollout.temperature,
        max_response_length=run.data.max_response_length,
        seed=run.trainer.seed,
    )


def run(cfg: DictConfig) -> float | None:
    """Entry point behind `python -m recipes.grpo`: returns the final mean reward."""
    from hydra.core.hydra_config import HydraConfig

    run_cfg = to_run_config(cfg)
    out_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path.cwd()
    trainer = GRPOTrainer(run_cfg, out_dir)
    try:
        return trainer.fit()
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
    def __init__(self, run: RunConfig, out_dir: Path):
        from lorarl.driver.prepare import prepare

        self.run = run
        self.out_dir = Path(out_dir)
        self.workers = None
        self.tracker = None
        # Every check the driver can make, before Ray starts (lorarl.driver.prepare); bad input fails here.
        prepared = prepare(run, self.out_dir)
        self.device = prepared.device
        self.worker_spec = prepared.worker_spec
        self.tokenizer = prepared.tokenizer
        self.loader, self.val_items, self.dropped_prompts = (
            prepared.loader,
            prepared.val_items,
            prepared.dropped_prompts,
        )
        self.total_steps = steps_for(run, self.loader.steps_per_epoch)
        self.step = 0
        self.sampling = sampling_of(run)
        self.ckpt, self.resume_from = prepared.checkpoints, prepared.resume_from
        self.prepare_seconds = prepared.seconds
        # trainer.off_policy_steps=1: the batch generated during the last update, and whether the
        # workers can overlap the two (decided in fit, from their sleep plans).
        self.ahead: BatchAhead | None = None
        self.overlap = False
        self.sampled_version = 0

    # ---- loop ----------------------------------------------------------------------------

    def fit(self) -> float | None:
        from tqdm.auto import tqdm

        from lorarl.workers.group import WorkerGroup
        from lorarl.workers.split_group import SplitWorkerGroup

        tc = self.run.trainer
        say = console(tqdm.write)
        self.tracker = Tracker(
            tc.logger, self.out_dir, tc.project_name, tc.experiment_name, self.run.to_dict(), write=say
        )
        if self.dropped_prompts:
            say(f"data: dropped {self.dropped_prompts} prompts longer than data.max_prompt_length")
        group = SplitWorkerGroup if tc.placement == "split" else WorkerGroup
        self.workers = group(self.run, self.worker_spec, self.device, run_dir=self.out_dir, say=say)
        # Where each rank runs, in the run log and the metrics (a multi-node run can be checked).
        say(f"workers: {self.workers.describe()}")
        node_ids = [where.node_id for where in self.workers.placement]
        placement = {keys.INIT_NUM_NODES.key: len(set(node_ids)), keys.INIT_WORKER_NODE_IDS.key: ",".join(node_ids)}
        for plan in dict.fromkeys([str(self.worker_spec.base_plan), *self.workers.sleep_plans]):
            say(plan)
        sync = self.worker_spec.sync
        if sync.check and not sync.semantic:
            say(
                f"sync checks: the {self.run.backend.strategy} engine has no semantic check yet for "
                f"{'merged' if sync.merge else 'adapter'} sync (sync/adapter_meaning); the transport fingerprint and the "
                "probe check each sync"
            )
        if tc.off_policy_steps:
            self.overlap, line = overlap_plan(tc.off_policy_steps, self.workers.rollout_sleeps, self.step)
            if not self.overlap:
                say(line)
        resumed = self.resume_from is not None
        if resumed:
            self.load_checkpoint(self.resume_from)
            # The steps after the checkpoint run again: their rows from the stopped process go.
            self.tracker.drop_after(self.step)
            say(f"resumed from {self.resume_from} at step {self.step}")
            if self.overlap:
                say(
                    f"off-policy resume: the batch that was in flight at the checkpoint is generated again, by the "
                    f"checkpoint's adapter (same prompts and seeds; rollout/staleness 0 at step {self.step + 1})"
                )
        # The first sync puts the trainer's weights into vLLM (the base too, if vLLM started from dummy weights).
        first_sync = self.workers.sync(SyncRequest(step=0, last=False, version=self.step))
        startup = {keys.INIT_TIMING_PREPARE.key: self.prepare_seconds, **self.workers.startup}
        startup_row = {**placement, **startup, **{keys.init_key(k): v for k, v in first_sync.metrics().items()}}
        # Every row carries the step it belongs to: a resumed process's start-up goes into the row of
        # the first step it trains, so metrics.jsonl has the steps an uninterrupted run has.
        pending = startup_row if 0 < self.step < self.total_steps else {}
        if not pending:
            self.log(startup_row, step=self.step)
        for line in startup_lines(first_sync, startup):
            say(line)
        if tc.val_before_train and self.val_items and not resumed:
            self.log(self.validate(), step=0)
        last_reward = None
        bar = tqdm(
            total=self.total_steps, initial=self.step, desc="grpo", disable=not tc.progress_bar, dynamic_ncols=True
        )
        while self.step < self.total_steps:
            self.step += 1
            try:
                metrics, sync = self.train_step()
                if (
                    tc.test_freq > 0
                    and self.val_items
                    and (self.step % tc.test_freq == 0 or self.step == self.total_steps)
                ):
                    metrics.update(self.validate())
                if tc.save_freq > 0 and (self.step % tc.save_freq == 0 or self.step == self.total_steps):
                    metrics[keys.TIMING_SAVE.key] = self.save_checkpoint()
            except LorarlError as err:
                raise type(err)(self._stopped_at(err)) from err
            if sync.sleep_plan:
                say(f"step {self.step}: from the next step the {sync.sleep_plan}")
                if tc.off_policy_steps and not self.overlap and sync.rollout_sleeps is False:
                    self.overlap, line = overlap_plan(tc.off_policy_steps, False, self.step)
                    say(line)
            self.log({**pending, **metrics}, step=self.step)
            pending = {}
            last_reward = metrics[keys.REWARD_MEAN.key]
            bar.update(1)
            bar.set_postfix(reward=f"{last_reward:.3f}", sync=sync.kind)
        bar.close()
        final = self.out_dir / "final_adapter"
        self.workers.export_adapter(str(final))
        say(f"final adapter: {final}")
        if "jsonl" in tc.logger:
            from lorarl.telemetry.plot import plot

            self.tracker.finish()
            plots = plot(self.out_dir)
            say(f"plots: {', '.join(p.name for p in plots)} in {self.out_dir}")
        return last_reward

    def log(self, row: dict, step: int) -> None:
        """One row of metrics. Every key is one of lorarl.metrics' list (a KeyError names one that is not)."""
        self.tracker.log({keys.checked(k): v for k, v in row.items()}, step=step)

    def _stopped_at(self, err: LorarlError) -> str:
        """The error with the step it stopped at and the checkpoint a relaunch would resume from."""
        msg = str(err)
        if not msg.startswith(f"step {self.step}:"):
            msg = f"step {self.step}: {msg}"
        latest = self.ckpt.latest()
        if latest is None:
            return f"{msg}; no checkpoint was saved (trainer.save_freq={self.run.trainer.save_freq})"
        return f"{msg}; last complete checkpoint: {latest} (relaunch with the same hydra.run.dir to resume from it)"

    # ---- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self) -> float:
        t0 = time.perf_counter()
        tmp = self.ckpt.begin(self.step)
        try:
            self.workers.save_checkpoint(str(tmp))
            config_yaml = OmegaConf.to_yaml(redact(self.run.to_dict()))
            # A batch generated ahead is not saved: the loader is saved as it was before drawing
            # it, and a resumed run draws and generates it again (fit says so).
            ahead = self.ahead
            loader_state = ahead.loader_state if ahead else self.loader.state_dict()
            write_trainer_state(tmp, self.step, loader_state, ahead.rng if ahead else random.getstate(), config_yaml)
            self.ckpt.commit(tmp, self.step)
        except BaseException:
            self.ckpt.abort(tmp)
            raise
        return time.perf_counter() - t0

    def load_checkpoint(self, path: Path) -> None:
        step, loader_state, python_rng = read_trainer_state(path)
        self.workers.load_checkpoint(str(path))
        self.step = step
        self.loader.load_state_dict(loader_state)
        random.setstate(python_rng)

    def train_step(self) -> tuple[dict, SyncReport]:
        """One GRPO step: three calls to the workers (generate; update; sync). Returns the step's
        metrics and the merged sync report (its kind and a changed sleep plan go to the console).
        Off-policy, the batch is the one generated during the last update, and the next one is
        generated during this update (start_generate; collected before the sync)."""
        t_step = time.perf_counter()
        if self.ahead is None:
            groups, gen_rounds, t_gen = self.rollout_groups()
            version, epoch = self.sampled_version, self.loader.epoch
        else:
            ahead, self.ahead = self.ahead, None
            groups, gen_rounds, t_gen, version, epoch = ahead.groups, 1, ahead.seconds, ahead.version, ahead.epoch
        next_ahead = self.start_ahead() if self.overlap and self.step < self.total_steps else None
        t0 = time.perf_counter()
        train = self.workers.update(self.update_requests(groups))
        t_update = time.perf_counter() - t0
        t_gen_wait = None
        if next_ahead is not None:
            t0 = time.perf_counter()
            self.ahead = next_ahead.collect(self.workers.collect_generate(), self.score_groups)
            t_gen_wait = time.perf_counter() - t0
        t0 = time.perf_counter()
        sync = self.workers.sync(SyncRequest(self.step, last=self.step == self.total_steps))
        t_sync = time.perf_counter() - t0

        rewards = torch.tensor([x for g in groups for x in g.rewards], dtype=torch.float32)
        lengths = [len(s) for g in groups for s in g.samples]
        replicas = [report.metrics() for report in train]
        metrics = {
            keys.REWARD_MEAN.key: float(rewards.mean()),
            keys.REWARD_STD.key: float(rewards.std()) if len(rewards) > 1 else 0.0,
            keys.RESPONSE_LENGTH_MEAN.key: sum(lengths) / len(lengths),
            keys.RESPONSE_LENGTH_MAX.key: max(lengths),
            **reduce_metrics({k: [replica[k] for replica in replicas] for k in replicas[0]}),
            **sync.metrics(),
        }
        fg = self.run.algorithm.filter_groups
        if fg.enable:
            metrics[keys.DATA_GEN_ROUNDS.key] = gen_rounds
            metrics[keys.DATA_GROUPS_WITH_SIGNAL.key] = sum(g.has_signal(fg.metric) for g in groups) / len(groups)
        if self.run.algorithm.overlong_buffer.enable:
            penalties = [p for g in groups for p in g.overlong]
            metrics[keys.REWARD_OVERLONG_REWARD.key] = sum(penalties) / len(penalties)
            metrics[keys.REWARD_OVERLONG.key] = sum(p < 0 for p in penalties) / len(penalties)
        metrics[keys.TIMING_GEN.key] = t_gen
        metrics[keys.TIMING_TRAIN.key] = t_update
        metrics[keys.TIMING_SYNC.key] = t_sync
        metrics[keys.TIMING_STEP.key] = time.perf_counter() - t_step
        if t_gen_wait is not None:
            metrics[keys.TIMING_GEN_WAIT.key] = t_gen_wait
        metrics[keys.DATA_EPOCH.key] = epoch
        if self.run.trainer.off_policy_steps:
            bound = self.run.trainer.off_policy_steps if self.overlap else 0
            metrics[keys.ROLLOUT_STALENESS.key] = staleness(self.step, version, bound)
        return metrics, sync

    def start_ahead(self) -> Ahead:
        """Draw the next step's prompts and begin their generation on the workers (returns at once)."""
        state = (self.loader.state_dict(), random.getstate())
        prompts = self.loader.next_batch()
        shards, requests = self.generation_requests(prompts, self.step + 1)
        self.workers.start_generate(requests)
        return Ahead(shards, self.loader.epoch, *state)

    def update_requests(self, groups: list[PromptGroup]) -> list[UpdateRequest]:
        """Group-normalised advantages; prompt groups split contiguously over data-parallel replicas."""
        requests = []
        for shard in _split(groups, self.workers.dp_size):
            scores = [x for g in shard for x in g.rewards]
            index = [k for k, g in enumerate(shard) for _ in g.samples]
            adv = advantages.grpo_advantages(
                torch.tensor(scores), torch.tensor(index), norm_by_std=self.run.algorithm.norm_adv_by_std_in_grpo
            )
            requests.append(
                UpdateRequest(
                    step=self.step,
                    prompt_ids=[g.item.prompt_ids for g in shard for _ in g.samples],
                    response_ids=[s for g in shard for s in g.samples],
                    advantages=adv.tolist(),
                    rollout_logprobs=[lp for g in shard for lp in g.logprobs],
                    sampling=self.sampling,
                )
            )
        return requests

    def rollout_groups(self) -> tuple[list[PromptGroup], int, float]:
        """data.train_batch_size prompt groups, sampled and scored: (groups, generation rounds,
        generation seconds). With algorithm.filter_groups, groups whose `metric` is equal for
        every sample carry no signal and are replaced by groups of further prompts (DAPO's
        dynamic sampling; data.gen_batch_size prompts a round), for at most max_num_gen_batches
        rounds (0: until the batch is full, as verl); a batch still short is filled with them
        (verl stops the run with an error there)."""
        fg = self.run.algorithm.filter_groups
        size = self.run.data.train_batch_size
        kept: list[PromptGroup] = []
        flat: list[PromptGroup] = []
        seconds, rounds = 0.0, 0
        while True:
            rounds += 1
            groups, gen_s = self.sample_groups(self.loader.next_batch(), round_index=rounds - 1)
            seconds += gen_s
            if not fg.enable:
                return groups, rounds, seconds
            kept += [g for g in groups if g.has_signal(fg.metric)]
            flat += [g for g in groups if not g.has_signal(fg.metric)]
            if len(kept) >= size or 0 < fg.max_num_gen_batches <= rounds:
                break
        return (kept + flat)[:size], rounds, seconds

    def sample_groups(self, prompts: list, round_index: int = 0) -> tuple[list[PromptGroup], float]:
        """rollout.n samples of each prompt from vLLM (prompts split over its engines), scored."""
        shards, requests = self.generation_requests(prompts, self.step, round_index)
        gen = self.workers.generate(requests)
        self.sampled_version = min(rollouts.adapter_version for rollouts in gen)
        return self.score_groups(shards, gen), max(rollouts.seconds for rollouts in gen)

    def generation_requests(
        self, prompts: list, step: int, round_index: int = 0
    ) -> tuple[list[list], list[GenerateRequest]]:
        """The prompts split over the rollout engines, and each engine's request for `step`."""
        r, d = self.run.rollout, self.run.data
        shards = _split(prompts, self.workers.rollout_size)
        seed = self.run.trainer.seed
        requests = [
            GenerateRequest(
                prompt_ids=[p.prompt_ids for p in shard],
                n=r.n,
                temperature=r.temperature,
                top_p=r.top_p,
                max_tokens=d.max_response_length,
                seed=sampling_seed(seed, step, i, round_index),
                for_training=True,
            )
            for i, shard in enumerate(shards)
        ]
        return shards, requests

    def score_groups(self, shards: list[list], gen: list[Rollouts]) -> list[PromptGroup]:
        """Each prompt's samples scored, with DAPO's overlong penalty when on."""
        d, alg = self.run.data, self.run.algorithm
        ob = alg.overlong_buffer
        buffer = (ob.len or max(1, d.max_response_length // 5)) if ob.enable else 0
        groups = []
        for shard, rollouts in zip(shards, gen):
            for item, samples, lps in zip(shard, rollouts.token_ids, rollouts.logprobs):
                scores = [self.score(item, s) for s in samples]
                overlong = [
                    advantages.overlong_penalty(len(s), d.max_response_length, buffer, ob.penalty_factor)
                    if buffer
                    else 0.0
                    for s in samples
                ]
                rewards = [x + p for x, p in zip(scores, overlong)]
                groups.append(PromptGroup(item, samples, lps, rewards, scores, overlong))
        return groups

    def score(self, item, response_ids: list[int]) -> float:
        from lorarl.rewards import RESPONSE_IDS, get_reward_fn

        text = self.tokenizer.decode(response_ids, skip_special_tokens=True)
        fn = get_reward_fn(item.data_source, self.run.data.reward_fn, self.run.reward)
        return float(fn(text, item.ground_truth, {**item.extra_info, RESPONSE_IDS: list(response_ids)}))

    def validate(self) -> dict:
        """Generate on data.val_files with rollout.val_kwargs; lorarl.driver.evaluation turns the texts into metrics."""
        from lorarl.driver.evaluation import validation_metrics

        vk, d = self.run.rollout.val_kwargs, self.run.data
        temperature = vk.temperature if vk.do_sample else 0.0
        shards = _split(self.val_items, self.workers.rollout_size)
        t0 = time.perf_counter()
        gen = self.workers.generate(
            [
                GenerateRequest(
                    prompt_ids=[p.prompt_ids for p in shard],
                    n=vk.n,
                    temperature=temperature,
                    top_p=vk.top_p,
                    max_tokens=d.max_response_length,
                    seed=VALIDATION_SEED + i,
                    for_training=False,
                )
                for i, shard in enumerate(shards)
            ],
        )
        items, texts, token_ids = [], [], []
        for shard, rollouts in zip(shards, gen):
            for item, samples in zip(shard, rollouts.token_ids):
                items.append(item)
                texts.append([self.tokenizer.decode(s, skip_special_tokens=True) for s in samples])
                token_ids.append([list(s) for s in samples])
        out = validation_metrics(items, texts, self.run.reward, d.reward_fn, token_ids)
        out[keys.TIMING_VAL.key] = time.perf_counter() - t0
        return out

    def close(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
        if self.tracker is not None:
            self.tracker.finish()
            self.tracker = None


@dataclass
class PromptGroup:
    """One prompt's rollout.n samples (its GRPO group): token ids, the sampler's log-probs, rewards
    (the reward function's scores plus the overlong penalties)."""

    item: Any
    samples: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[float]
    scores: list[float] | None = None  # the reward function's values; None: the rewards
    overlong: list[float] | None = None  # DAPO's overlong penalty per sample (0 when off)

    def has_signal(self, metric: str = "seq_final_reward") -> bool:
        """Whether the samples differ in `metric` (algorithm.filter_groups.metric, verl's names):
        acc / score read the reward function's values, seq_reward / seq_final_reward the rewards
        (no KL is ever in the reward here, so the two agree, as do acc and score)."""
        values = self.scores if metric in ("acc", "score") and self.scores is not None else self.rewards
        return max(values) != min(values)


def _split(items: list, parts: int) -> list[list]:
    size = len(items) // parts
    extra = len(items) % parts
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out
