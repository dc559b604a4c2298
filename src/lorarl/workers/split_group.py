"""trainer.placement=split on the driver: training workers and rollout workers as separate Ray
actors on devices of their own (lorarl.workers.split_workers), behind WorkerGroup's interface.

The trainer's n_gpus_per_node ranks form one process group (FSDP over them); each of the
rollout.n_workers rollout workers is a process group of its own holding one vLLM engine. A
generation begun with start_generate runs on the rollout workers while the update runs on the
training workers: two sets of processes, no thread shared. The sync sends one set of bundles
(lorarl.sync.split) through Ray's object store to every rollout worker, which loads and checks
them; a due probe takes the trainer's log-probs of each rollout worker's sequences to it.
"""

from __future__ import annotations

import time

from lorarl.config.run import RunConfig
from lorarl.contract.messages import GenerateRequest, Rollouts, SyncReport, SyncRequest
from lorarl.workers.group import Actor, Layout, WorkerGroup, describe_placement
from lorarl.workers.split_workers import AWAKE_PLAN, RolloutWorker, TrainerWorker


class SplitWorkerGroup(WorkerGroup):
    def layout(self, run: RunConfig, device: str) -> Layout:
        """The training workers (one process group, FSDP over them), then the rollout workers (a
        process group each, holding one vLLM engine), all in one bundle on one node
        (lorarl.config.validate.check_placement)."""
        n_train, n_rollout = run.world_size, run.rollout.n_workers or 1
        actors = n_train + n_rollout
        trainers = [Actor(TrainerWorker, {"rank": i, "world_size": n_train}, bundle=0, meets=0) for i in range(n_train)]
        rollouts = [
            Actor(RolloutWorker, {"index": i, "log_rank": n_train + i}, bundle=0, meets=n_train + i)
            for i in range(n_rollout)
        ]
        refusal = (
            f"trainer.placement=split needs {n_train} training (trainer.n_gpus_per_node) + {n_rollout} rollout "
            f"(rollout.n_workers) {'GPUs' if device == 'cuda' else 'CPUs'} on one node, and no node of the Ray "
            "cluster has them; lower those, or set trainer.placement=colocated"
        )
        bundle = {"GPU": actors, "CPU": actors} if device == "cuda" else {"CPU": actors}
        return Layout([bundle], trainers + rollouts, refusal)

    def _adopt(self, run: RunConfig, setups: list) -> None:
        """The training workers' data-parallel places; the dtype the rollout workers' vLLM holds
        LoRA in (the trainer exports in it); one engine per rollout worker, never asleep."""
        n_train = run.world_size
        self.trainers, self.rollouts = self.workers[:n_train], self.workers[n_train:]
        self.dp = [(s.dp_rank, s.dp_size) for s in setups[:n_train]]
        self.dp_size = self.dp[0][1]
        self.rollout_dtype = setups[n_train].dtype
        self.sleep_plans = [AWAKE_PLAN]
        self.rollout_sleeps = False
        self.rollout_replica = list(range(len(self.rollouts)))
        self.rollout_size = len(self.rollouts)
        self._in_flight: list | None = None

    def describe(self) -> str:
        n_train = len(self.trainers)

        def where(ranks: range) -> str:
            gpus = [g for i in ranks for g in self.placement[i].gpus]
            return f"GPU {','.join(gpus)}" if gpus else "CPU"

        return (
            f"split placement: training engine on {n_train} worker{'s' if n_train > 1 else ''} "
            f"({where(range(n_train))}), vLLM on {len(self.rollouts)} rollout worker{'s' if len(self.rollouts) > 1 else ''} "
            f"({where(range(n_train, len(self.workers)))}); " + describe_placement(self.placement)
        )

    # ---- the step: generation and the update as WorkerGroup's, on the rollouts and trainers ----

    def start_generate(self, per_engine: list[GenerateRequest]) -> None:
        """The generation begun on the rollout workers; the update that follows runs on the training
        workers beside it."""
        self._in_flight = [w.generate.remote(r) for w, r in zip(self.rollouts, per_engine)]

    def collect_generate(self) -> list[Rollouts]:
        refs, self._in_flight = self._in_flight, None
        if refs is None:
            raise RuntimeError("collect_generate: no generation in flight (start_generate first)")
        return self._get(refs, "generation")

    def sync(self, request: SyncRequest) -> list[SyncReport]:
        """Export on the training workers, one object in Ray's store, loaded and checked on every
        rollout worker; the probe, when due, from the trainer's log-probs to each rollout worker."""
        import ray

        bundles = self._get([w.sync_export.remote(request, self.rollout_dtype) for w in self.trainers], "sync")[0]
        sent = ray.put(bundles)
        received = self._get([w.sync_receive.remote(sent, request) for w in self.rollouts], "sync")
        reports = []
        for worker, (report, sequences) in zip(self.rollouts, received):
            if sequences is not None:
                t0 = time.perf_counter()
                trainer = self._get([w.probe_logprobs.remote(sequences) for w in self.trainers], "sync probe")[0]
                report = self._get([worker.probe_judge.remote(trainer, report, time.perf_counter() - t0)], "probe")[0]
            reports.append(report)
        return [SyncReport.merge(reports)]  # one adapter
