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
from lorarl.errors import LorarlError, TrainingError, first_line
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
        self.dp = self._get([w.setup.remote(addr, port) for w in self.workers])  # (dp_rank, dp_size) per worker
        self.dp_size = self.dp[0][1]

    # ---- the step: three round trips --------------------------------------------------------

    def generate(self, per_replica: list[tuple]) -> list[tuple[list[list[list[int]]], float]]:
        """Worker.generate(*args) with one argument tuple per data-parallel replica; one result
        per replica."""
        return self._per_replica([w.generate.remote(*per_replica[dp]) for w, (dp, _) in zip(self.workers, self.dp)])

    def update(self, per_replica: list[tuple]) -> list[dict]:
        """Worker.update(*args) (sleep, log-probs, PPO update) per replica; one result per replica."""
        return self._per_replica([w.update.remote(*per_replica[dp]) for w, (dp, _) in zip(self.workers, self.dp)])

    def sync(self) -> list[dict]:
        """Worker.sync on every worker (wake, payloads, checks); one result per worker."""
        return self._get([w.sync.remote() for w in self.workers])

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
        import ray

        pending, results = list(refs), {}
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                results[done[0]] = ray.get(done[0])
            except ray.exceptions.RayTaskError as err:
                cause = err.cause if hasattr(err, "cause") else err
                for ref in pending:
                    ray.cancel(ref, force=True)
                if isinstance(cause, LorarlError):
                    raise cause from None
                raise TrainingError(
                    f"a worker failed: {type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}"
                ) from err
            except ray.exceptions.RayActorError as err:
                for ref in pending:
                    ray.cancel(ref, force=True)
                raise TrainingError(
                    f"a worker process died ({first_line(err)}): it was killed or crashed outside Python, "
                    "e.g. out of memory; its log is under /tmp/ray/session_latest/logs"
                ) from err
        return [results[r] for r in refs]

    def shutdown(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        except Exception:  # noqa: BLE001 - a dead worker must not block teardown of the rest
            pass
        for w in self.workers:
            ray.kill(w)
        from ray.util.placement_group import remove_placement_group

        if self.pg is not None:
            remove_placement_group(self.pg)
        if self._owns_ray:
            ray.shutdown()
