"""Ray actors, one Worker per device, on one node or many.

Ray places the actors (one GPU each on CUDA; on CPU, `n_gpus_per_node` processes sharing
the cores) and carries calls to them; torch.distributed (NCCL or gloo) carries tensors
between them. A worker's exception reaches the driver as that worker's error, never a hang:
every call waits on all workers and re-raises the first failure.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from lorarl.config import RunConfig
from lorarl.errors import LorarlError, TrainingError
from lorarl.worker import Worker, worker_env


class WorkerGroup:
    def __init__(self, run: RunConfig, device: str):
        import ray

        self.world_size = run.world_size
        self.workers: list = []
        self.pg = None
        started_ray = not ray.is_initialized()
        # ray.init replaces the driver's SIGTERM handler with one that kills Ray's processes
        # and exits at once; a handler the caller installed (recipes/grpo.py turns SIGTERM into
        # an orderly shutdown through this class) is put back.
        sigterm = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
        if started_ray:
            env = {"env_vars": worker_env()}
            if os.environ.get("RAY_ADDRESS"):
                ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=env)
            else:
                ray.init(
                    num_cpus=max(os.cpu_count() or 1, self.world_size),
                    include_dashboard=False,
                    runtime_env=env,
                    logging_level="ERROR",
                    configure_logging=True,
                    log_to_driver=True,
                )
        if callable(sigterm):
            signal.signal(signal.SIGTERM, sigterm)
        self._owns_ray = started_ray
        try:
            self._start(run, device)
        except BaseException:
            # A worker that failed in setup, or a signal while waiting: leave no actors, placement
            # group or Ray processes behind.
            self.shutdown()
            raise

    def _start(self, run: RunConfig, device: str) -> None:
        import ray

        per_worker_threads = max(1, (os.cpu_count() or 1) // self.world_size) if device == "cpu" else None
        resources = {"num_gpus": 1, "num_cpus": 1} if device == "cuda" else {"num_cpus": 1}
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"GPU": 1, "CPU": 1} if device == "cuda" else {"CPU": 1}
        self.pg = placement_group([bundle] * self.world_size, strategy="PACK")
        ray.get(self.pg.ready())
        actor_cls = ray.remote(Worker)
        self.workers = [
            actor_cls.options(
                **resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=i
                ),
            ).remote(run, i, self.world_size, device, per_worker_threads)
            for i in range(self.world_size)
        ]
        addr, port = self._get([self.workers[0].node_address.remote()])[0]
        setups = self._get([w.setup.remote(addr, port) for w in self.workers])
        self.dp = [(dp_rank, dp_size) for dp_rank, dp_size, _ in setups]  # per worker
        self.sleep_plans = [plan for _, _, plan in setups]
        self.dp_size = self.dp[0][1]

    # ---- the step: three round trips --------------------------------------------------------

    def generate(self, per_replica: list[tuple]) -> list[tuple[list[list[list[int]]], float]]:
        """Worker.generate(*args) with one argument tuple per data-parallel replica; one result
        per replica."""
        return self._per_replica([w.generate.remote(*per_replica[dp]) for w, (dp, _) in zip(self.workers, self.dp)])

    def update(self, per_replica: list[tuple]) -> list[dict]:
        """Worker.update(*args) (sleep, log-probs, PPO update) per replica; one result per replica."""
        return self._per_replica([w.update.remote(*per_replica[dp]) for w, (dp, _) in zip(self.workers, self.dp)])

    def sync(self, probe: bool = True) -> list[dict]:
        """Worker.sync on every worker (wake, payloads, checks; the probe when `probe`); one
        result per worker."""
        return self._get([w.sync.remote(probe) for w in self.workers])

    # ---- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        self._get([w.save_checkpoint.remote(directory) for w in self.workers])

    def load_checkpoint(self, directory: str) -> None:
        self._get([w.load_checkpoint.remote(directory) for w in self.workers])

    def export_adapter(self, directory: str) -> None:
        self._get([w.export_adapter.remote(directory) for w in self.workers])

    def _per_replica(self, refs: list) -> list:
        """Every worker's result awaited (collectives stay in lockstep); the first worker's of
        each replica returned, in replica order."""
        first = {}
        for (dp_rank, _), result in zip(self.dp, self._get(refs)):
            first.setdefault(dp_rank, result)
        return [first[i] for i in range(self.dp_size)]

    def _get(self, refs: list) -> list[Any]:
        """Results of one call per worker (refs[i] is worker i's). The first failure ends the call:
        the workers still running are killed (peers of a dead or failed worker may wait in a
        collective forever, and Ray cannot cancel a running actor task), then it is raised as
        one line naming the worker."""
        import ray

        pending, results = list(refs), {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                results[done[0]] = ray.get(done[0])
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as err:
                culprit, err = self._root_failure(refs, done[0], err, pending)
                if pending and ray.wait(pending, num_returns=len(pending), timeout=0)[1]:
                    self._kill_workers()  # some are still running, e.g. waiting for the failed one
                raise self._one_line(culprit, err) from err
        return [results[r] for r in refs]

    # ---- failure path ------------------------------------------------------------------------

    _failed = False

    def _root_failure(self, refs: list, ref, err, pending: list):
        """(worker index, error) to report: a worker that died outright explains its peers'
        collective errors, so give the others a moment to show one."""
        import ray

        if pending and not isinstance(err, ray.exceptions.RayActorError):
            done, _ = ray.wait(pending, num_returns=len(pending), timeout=3.0)
            for other in done:
                try:
                    ray.get(other)
                except ray.exceptions.RayActorError as died:
                    return refs.index(other), died
                except Exception:  # noqa: BLE001 - a peer's own failure; the first one is reported
                    pass
        return refs.index(ref), err

    def _one_line(self, index: int, err) -> LorarlError:
        import ray

        who = f"worker {index} of {len(self.workers)}" if len(self.workers) > 1 else "the worker"
        if isinstance(err, ray.exceptions.RayActorError):
            return TrainingError(
                f"a worker process died ({who}): it was killed or crashed outside Python, e.g. out of memory; "
                "its log is under /tmp/ray/session_latest/logs"
            )
        cause = getattr(err, "cause", None) or err
        if isinstance(cause, LorarlError):
            return cause
        text = str(cause).strip()
        return TrainingError(f"{who} failed: {type(cause).__name__}: {text.splitlines()[-1] if text else ''}")

    def _kill_workers(self) -> None:
        import ray

        self._failed = True
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        if not self._failed:  # after a failure the workers were killed: nothing to shut down gracefully
            try:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
            except Exception:  # noqa: BLE001 - a dead worker must not block teardown of the rest
                pass
        self._kill_workers()
        from ray.util.placement_group import remove_placement_group

        if self.pg is not None:
            remove_placement_group(self.pg)
        if self._owns_ray:
            ray.shutdown()
        # Killed workers could not remove their tmpfs adapter folders.
        from lorarl.rollout.engine_process import remove_stale_adapter_dirs

        remove_stale_adapter_dirs()
