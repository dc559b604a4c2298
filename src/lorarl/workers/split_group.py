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

from lorarl import metrics as keys
from lorarl.config.run import RunConfig
from lorarl.contract.messages import GenerateRequest, Rollouts, SyncReport, SyncRequest, UpdateReport, UpdateRequest
from lorarl.contract.specs import WorkerSpec
from lorarl.errors import ConfigError
from lorarl.workers.group import WorkerGroup, _bundle_cpus, describe_placement
from lorarl.workers.split_workers import AWAKE_PLAN, RolloutWorker, TrainerWorker
from lorarl.workers.worker import worker_env


class SplitWorkerGroup(WorkerGroup):
    @staticmethod
    def actors_of(run: RunConfig) -> int:
        return run.world_size + (run.rollout.n_workers or 1)

    def _start(self, run: RunConfig, spec: WorkerSpec, device: str) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        n_train, n_rollout = run.world_size, run.rollout.n_workers or 1
        actors = n_train + n_rollout
        t0 = time.perf_counter()
        # One node (lorarl.config.validate.check_placement): every actor in one bundle.
        bundle = {"GPU": actors, "CPU": actors} if device == "cuda" else {"CPU": actors}
        self.pg = placement_group([bundle], strategy="STRICT_PACK")
        try:
            self._wait_for_placement(1, actors, bundle)
        except ConfigError:
            raise ConfigError(
                f"trainer.placement=split needs {n_train} training (trainer.n_gpus_per_node) + {n_rollout} rollout "
                f"(rollout.n_workers) {'GPUs' if device == 'cuda' else 'CPUs'} on one node, and no node of the Ray "
                "cluster has them; lower those, or set trainer.placement=colocated"
            ) from None
        threads = max(1, int(_bundle_cpus(self.pg)[0]) // actors) if device == "cpu" else None

        def options(cls):
            return ray.remote(cls).options(
                **({"num_gpus": 1, "num_cpus": 1} if device == "cuda" else {"num_cpus": 1}),
                runtime_env={"env_vars": worker_env()},
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg),
            )

        run_dir = str(self.run_dir) if self.run_dir is not None else None
        common = {"device": device, "threads": threads, "run_dir": run_dir}
        self.trainers = [
            options(TrainerWorker).remote(spec, rank=i, world_size=n_train, **common) for i in range(n_train)
        ]
        self.rollouts = [
            options(RolloutWorker).remote(spec, index=i, log_rank=n_train + i, **common) for i in range(n_rollout)
        ]
        self.workers = self.trainers + self.rollouts  # what a failure kills and shutdown stops
        self.placement = self._get([w.location.remote() for w in self.workers])
        meet = self._get([w.rendezvous.remote() for w in [self.trainers[0], *self.rollouts]])
        t1 = time.perf_counter()
        setups = self._get(
            [w.setup.remote(meet[0]) for w in self.trainers]
            + [w.setup.remote(m) for w, m in zip(self.rollouts, meet[1:])],
            "set-up",
        )
        trained, rolled = setups[:n_train], setups[n_train:]
        self.dp = [(s.dp_rank, s.dp_size) for s in trained]
        self.dp_size = self.dp[0][1]
        self.rollout_dtype = rolled[0].dtype
        self.sleep_plans = [AWAKE_PLAN]
        self.rollout_sleeps = False
        self.startup.update(
            {
                keys.INIT_TIMING_WORKERS_START.key: t1 - t0,
                keys.INIT_TIMING_ROLLOUT_START.key: max(s.rollout_start_seconds for s in rolled),
                keys.INIT_TIMING_ENGINE_BUILD.key: max(s.engine_build_seconds for s in trained),
                keys.INIT_TIMING_WORKER_SETUP.key: time.perf_counter() - t1,
            }
        )
        self.rollout_replica = list(range(n_rollout))
        self.rollout_size = n_rollout
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

    # ---- the step ---------------------------------------------------------------------------

    def generate(self, per_engine: list[GenerateRequest]) -> list[Rollouts]:
        return self._get([w.generate.remote(r) for w, r in zip(self.rollouts, per_engine)], "generation")

    def start_generate(self, per_engine: list[GenerateRequest]) -> None:
        """The generation begun on the rollout workers; the update that follows runs on the training
        workers beside it."""
        self._in_flight = [w.generate.remote(r) for w, r in zip(self.rollouts, per_engine)]

    def collect_generate(self) -> list[Rollouts]:
        refs, self._in_flight = self._in_flight, None
        if refs is None:
            raise RuntimeError("collect_generate: no generation in flight (start_generate first)")
        return self._get(refs, "generation")

    def update(self, per_replica: list[UpdateRequest]) -> list[UpdateReport]:
        refs = [w.update.remote(per_replica[dp]) for w, (dp, _) in zip(self.trainers, self.dp)]
        return self._first_of([dp_rank for dp_rank, _ in self.dp], refs, "update")

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

    # ---- checkpoints: the training workers hold all the state --------------------------------

    def save_checkpoint(self, directories: list[str]) -> None:
        self._get([w.save_checkpoint.remote(directories) for w in self.trainers], "checkpoint save")

    def load_checkpoint(self, directories: list[str]) -> None:
        self._get([w.load_checkpoint.remote(directories) for w in self.trainers], "checkpoint load")

    def export_adapter(self, directories: list[str]) -> None:
        self._get([w.export_adapter.remote(directories) for w in self.trainers], "adapter export")
