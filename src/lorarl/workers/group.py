"""Ray actors, one Worker per device, on one node or many.

Ray places the actors (one GPU each on CUDA; on CPU, `n_gpus_per_node` processes sharing
the cores) and carries calls to them; torch.distributed (NCCL or gloo) carries tensors
between them. A worker's exception reaches the driver as that worker's error, never a hang:
every call waits on all workers and re-raises the first failure.

One start-up serves every placement: a group says what it places (`layout`: the bundles, the
actors, where each process group meets) and what their setups mean (`_adopt`); split placement
(lorarl.workers.split_group) is another layout behind the same calls, which go to the workers
that hold a training engine (`trainers`) or vLLM (`rollouts`).
"""

from __future__ import annotations

import collections
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorarl import metrics as keys
from lorarl.config.run import RunConfig
from lorarl.contract.messages import (
    GenerateRequest,
    Placement,
    Rollouts,
    SyncReport,
    SyncRequest,
    UpdateReport,
    UpdateRequest,
    WorkerSetup,
)
from lorarl.contract.specs import WorkerSpec
from lorarl.errors import ConfigError, LorarlError, TrainingError
from lorarl.workers.stall_report import STACKS_GLOB
from lorarl.workers.worker import Worker, worker_env

# How long a placement that the cluster's alive nodes cannot hold is waited for on a cluster
# this driver joined (nodes of a job may register after the driver starts).
PLACEMENT_GRACE_S = 120.0


def _bundle_cpus(pg) -> dict[int, float]:
    """Per bundle of a ready placement group, the CPUs its node declares to Ray."""
    import ray
    from ray.util.placement_group import placement_group_table

    cpus = {node["NodeID"]: node["Resources"].get("CPU", 1.0) for node in ray.nodes()}
    where = placement_group_table(pg)["bundles_to_node_id"]
    return {int(i): cpus.get(node_id, 1.0) for i, node_id in where.items()}


def _nodes_that_fit(bundle: dict) -> int:
    """Alive nodes whose total resources could hold `bundle` (whatever runs on them now)."""
    import ray

    return sum(
        all(node["Resources"].get(k, 0.0) >= v for k, v in bundle.items()) for node in ray.nodes() if node["Alive"]
    )


def describe_placement(placement: list[Placement]) -> str:
    """One line: which ranks run on which node (ip and the start of Ray's node id)."""
    nodes: dict[str, list[int]] = {}
    for rank, where in enumerate(placement):
        nodes.setdefault(where.node_id, []).append(rank)
    ip = {where.node_id: where.ip for where in placement}
    parts = [
        f"{ip[n]} (node {n[:8]}): rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}" for n, r in nodes.items()
    ]
    return (
        f"{len(placement)} worker{'s' if len(placement) > 1 else ''} on {len(nodes)} node{'s' if len(nodes) > 1 else ''}: "
        + "; ".join(parts)
    )


def failure_line(err, who: str, trace_file: Path | None) -> LorarlError:
    """A worker's failure as one line. A LorarlError is the user's to fix and says so itself; any
    other exception is a fault whose full remote traceback goes to `trace_file`, named in the line."""
    import ray

    if isinstance(err, ray.exceptions.RayActorError):
        return TrainingError(
            f"a worker process died ({who}): it was killed or crashed outside Python, e.g. out of memory; "
            "its log is under /tmp/ray/session_latest/logs"
        )
    cause = getattr(err, "cause", None) or err
    if isinstance(cause, LorarlError):
        return cause
    text = str(cause).strip()
    line = f"{who} failed: {type(cause).__name__}: {text.splitlines()[-1] if text else ''}"
    if trace_file is not None:
        try:
            # RayTaskError's text holds the worker's traceback (and Ray's terminal colours).
            trace_file.write_text(re.sub(r"\x1b\[[0-9;]*m", "", str(err)))
            line += f" (traceback: {trace_file})"
        except OSError:
            pass
    return TrainingError(line)


@dataclass(frozen=True)
class Actor:
    """One Ray actor a group places: its class, its own keyword arguments (beside the spec, the
    device, its threads and the run folder every actor gets), the bundle it sits in, and the
    actor (by index) at whose rendezvous its process group meets."""

    cls: type
    kwargs: dict
    bundle: int
    meets: int


@dataclass(frozen=True)
class Layout:
    """What a group places: one resource bundle per node (several: spread over nodes; one: packed
    on one node), its actors in rank order, and the ConfigError's line when no node of the
    cluster can hold a bundle (`{fitting}`: nodes that could, `{need}`: what a bundle needs)."""

    bundles: list[dict]
    actors: list[Actor]
    refusal: str


class WorkerGroup:
    def __init__(
        self,
        run: RunConfig,
        spec: WorkerSpec,
        device: str,
        run_dir: Path | None = None,
        say: Callable[[str], None] = print,
    ):
        """`run` for the placement (trainer.nnodes, n_gpus_per_node, rollout's tensor parallel
        size); `spec` is what each worker is given (lorarl.driver.prepare). `run_dir`: where a worker's traceback goes when it fails with an unexpected error, and
        each worker's Python stacks when a call runs past trainer.stall_report_s
        (lorarl.workers.stall_report); `say` shows the driver's line about the latter."""
        import ray

        self.run_dir = run_dir
        self.trace_file = run_dir / "worker_traceback.txt" if run_dir is not None else None
        self.stall_s = run.trainer.stall_report_s
        self.say = say
        self.world_size = run.world_size
        self.workers: list = []
        self.pg = None
        layout = self.layout(run, device)
        t0 = time.perf_counter()
        started_ray = not ray.is_initialized()
        # ray.init replaces the driver's SIGTERM handler with one that kills Ray's processes
        # and exits at once; a handler the caller installed (recipes/grpo.py turns SIGTERM into
        # an orderly shutdown through this class) is put back.
        sigterm = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
        if started_ray:
            if os.environ.get("RAY_ADDRESS"):
                # An existing cluster (ray start, KubeRay): connect only; shutdown disconnects
                # this driver and leaves the cluster running.
                ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=True)
            else:
                # "local": always a private instance. Without it ray.init joins whatever cluster
                # /tmp/ray/ray_current_cluster names (the last `ray start` on this machine), and
                # then fails on num_cpus; joining a cluster is asked for with RAY_ADDRESS.
                ray.init(
                    address="local",
                    num_cpus=max(os.cpu_count() or 1, len(layout.actors)),
                    include_dashboard=False,
                    logging_level="ERROR",
                    configure_logging=True,
                    log_to_driver=True,
                )
        if callable(sigterm):
            signal.signal(signal.SIGTERM, sigterm)
        self._owns_ray = started_ray
        self._owns_local_ray = started_ray and not os.environ.get("RAY_ADDRESS")
        self.placement: list[Placement] = []
        # Where the start-up time went, logged once at step 0.
        self.startup: dict[str, float] = {keys.INIT_TIMING_RAY_INIT.key: time.perf_counter() - t0}
        try:
            self._adopt(run, self._start(layout, spec, device))
        except BaseException:
            # A worker that failed in setup, or a signal while waiting: leave no actors, placement
            # group or Ray processes behind.
            self.shutdown()
            raise

    def describe(self) -> str:
        """One line for the log: where the workers run."""
        return describe_placement(self.placement)

    # ---- start-up: one for every placement; `layout` and `_adopt` say what differs -----------

    def layout(self, run: RunConfig, device: str) -> Layout:
        """Colocated: one Worker per device, one process group. One bundle per node holding all of
        that node's workers, and STRICT_SPREAD over nodes: exactly n_gpus_per_node workers on each
        of nnodes distinct nodes. One bundle per device with PACK or SPREAD would let Ray put 3
        workers on one node and 1 on another, and ranks of one node would not be consecutive
        (NCCL's intra-node rings and tensor-parallel groups want them consecutive)."""
        t = run.trainer
        per_node = t.n_gpus_per_node
        bundle = {"GPU": per_node, "CPU": per_node} if device == "cuda" else {"CPU": per_node}
        workers = [
            Actor(Worker, {"rank": i, "world_size": run.world_size}, bundle=i // per_node, meets=0)
            for i in range(run.world_size)
        ]
        refusal = (
            f"trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node={per_node}: the Ray cluster has {{fitting}} alive "
            f"node(s) with {{need}} each, {t.nnodes} are needed; lower trainer.nnodes / trainer.n_gpus_per_node or add nodes"
        )
        return Layout([bundle] * t.nnodes, workers, refusal)

    def _start(self, layout: Layout, spec: WorkerSpec, device: str) -> list:
        """Place the layout's actors, start their processes, meet, set up; each actor's setup."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        t0 = time.perf_counter()
        self.pg = placement_group(
            layout.bundles, strategy="STRICT_SPREAD" if len(layout.bundles) > 1 else "STRICT_PACK"
        )
        self._wait_for_placement(layout)
        # On CPU the actors of a bundle share its node's cores: torch threads per actor from the
        # CPUs that node declares (nodes of a cluster may differ from the driver's).
        cpus = _bundle_cpus(self.pg) if device == "cpu" else {}
        sharing = collections.Counter(a.bundle for a in layout.actors)
        resources = {"num_gpus": 1, "num_cpus": 1} if device == "cuda" else {"num_cpus": 1}
        remote = {a.cls: ray.remote(a.cls) for a in layout.actors}
        run_dir = str(self.run_dir) if self.run_dir is not None else None
        self.workers = [
            remote[a.cls]
            .options(
                **resources,
                # Per actor, so it holds also when the caller connected to Ray (a Hydra launcher
                # task, a notebook) and no job-level runtime_env was set.
                runtime_env={"env_vars": worker_env()},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=a.bundle
                ),
            )
            .remote(
                spec,
                **a.kwargs,
                device=device,
                threads=max(1, int(cpus[a.bundle]) // sharing[a.bundle]) if cpus else None,
                run_dir=run_dir,
            )
            for a in layout.actors
        ]
        self.placement = self._get([w.location.remote() for w in self.workers])
        # Each process group meets where its first actor's node offers a port.
        leaders = sorted({a.meets for a in layout.actors})
        meet = dict(zip(leaders, self._get([self.workers[i].rendezvous.remote() for i in leaders])))
        t1 = time.perf_counter()
        setups = self._get([w.setup.remote(meet[a.meets]) for w, a in zip(self.workers, layout.actors)], "set-up")
        # The slowest worker's stages: the others wait for it at the first collective.
        self.startup.update(
            {
                keys.INIT_TIMING_WORKERS_START.key: t1 - t0,
                keys.INIT_TIMING_ROLLOUT_START.key: max(s.rollout_start_seconds for s in setups),
                keys.INIT_TIMING_ENGINE_BUILD.key: max(s.engine_build_seconds for s in setups),
                keys.INIT_TIMING_WORKER_SETUP.key: time.perf_counter() - t1,
            }
        )
        return setups

    def _adopt(self, run: RunConfig, setups: list[WorkerSetup]) -> None:
        """What the workers' setups say: their data-parallel places, their sleep plans, and which
        vLLM engine each holds a shard of. Colocated, every worker holds both a training engine
        (the trainers: updates, checkpoints) and vLLM (the rollouts: generation)."""
        self.trainers = self.rollouts = self.workers
        self.dp = [(s.dp_rank, s.dp_size) for s in setups]  # per trainer
        self.dp_size = self.dp[0][1]
        self.sleep_plans = [s.sleep_plan for s in setups]
        self.rollout_sleeps = any(s.rollout_sleeps for s in setups)
        # Rollout replicas are vLLM engines: T consecutive workers share one with tensor
        # parallelism T, get the same prompts and seed, and return the same samples.
        tp = run.rollout.tensor_model_parallel_size
        self.rollout_replica = [i // tp for i in range(self.world_size)]
        self.rollout_size = self.world_size // tp

    def _wait_for_placement(self, layout: Layout) -> None:
        """Wait until Ray reserved the bundles. A cluster that is busy is waited for; one whose
        alive nodes could never hold them fails in one line (after PLACEMENT_GRACE_S on a cluster
        this driver joined, where nodes may still be starting, e.g. the workers of an sbatch job)."""
        import ray

        bundle = layout.bundles[0]
        deadline = time.monotonic() + (0 if self._owns_local_ray else PLACEMENT_GRACE_S)
        while not ray.wait([self.pg.ready()], timeout=5)[0]:
            fitting = _nodes_that_fit(bundle)
            if fitting >= len(layout.bundles):
                deadline = time.monotonic() + PLACEMENT_GRACE_S  # feasible: busy, keep waiting
            elif time.monotonic() >= deadline:
                need = ", ".join(f"{v} {k}" for k, v in bundle.items())
                raise ConfigError(layout.refusal.format(fitting=fitting, need=need))

    # ---- the step: three round trips --------------------------------------------------------

    def generate(self, per_engine: list[GenerateRequest]) -> list[Rollouts]:
        """One request per rollout engine (rollout_size of them); one result per engine, from its
        first worker."""
        refs = [w.generate.remote(per_engine[e]) for w, e in zip(self.rollouts, self.rollout_replica)]
        return self._first_of(self.rollout_replica, refs, "generation")

    def start_generate(self, per_engine: list[GenerateRequest]) -> None:
        """`generate` begun on every worker in a thread of its own; returns once all began, so
        the next call (the update) runs beside it. collect_generate returns the results."""
        self._get([w.generate_start.remote(per_engine[e]) for w, e in zip(self.rollouts, self.rollout_replica)])

    def collect_generate(self) -> list[Rollouts]:
        """The generation start_generate began: one result per engine, from its first worker."""
        refs = [w.generate_collect.remote() for w in self.rollouts]
        return self._first_of(self.rollout_replica, refs, "generation")

    def update(self, per_replica: list[UpdateRequest]) -> list[UpdateReport]:
        """Sleep, log-probs, PPO update: one request and one report per data-parallel replica."""
        refs = [w.update.remote(per_replica[dp]) for w, (dp, _) in zip(self.trainers, self.dp)]
        return self._first_of([dp_rank for dp_rank, _ in self.dp], refs, "update")

    def sync(self, request: SyncRequest) -> list[SyncReport]:
        """Every worker's sync (wake, payloads, checks, the probe when due), as one report per adapter."""
        per_worker = self._get([w.sync.remote(request) for w in self.workers], "sync")
        return [SyncReport.merge(list(reports)) for reports in zip(*per_worker, strict=True)]

    # ---- checkpoints: the trainers hold all the state ---------------------------------------

    def save_checkpoint(self, directories: list[str]) -> None:
        """Each adapter's state into its folder (one per adapter the run trains)."""
        self._get([w.save_checkpoint.remote(directories) for w in self.trainers], "checkpoint save")

    def load_checkpoint(self, directories: list[str]) -> None:
        self._get([w.load_checkpoint.remote(directories) for w in self.trainers], "checkpoint load")

    def export_adapter(self, directories: list[str]) -> None:
        self._get([w.export_adapter.remote(directories) for w in self.trainers], "adapter export")

    def _first_of(self, groups: list[int], refs: list, what: str) -> list:
        """Every worker's result awaited (collectives stay in lockstep); the first worker's of
        each group (rollout engine, data-parallel replica) returned, in group order."""
        first = {}
        for group, result in zip(groups, self._get(refs, what)):
            first.setdefault(group, result)
        return [first[i] for i in range(len(first))]

    def _get(self, refs: list, what: str | None = None) -> list[Any]:
        """Results of one call per worker (refs[i] is worker i's). The first failure ends the call:
        the workers still running are killed (peers of a dead or failed worker may wait in a
        collective forever, and Ray cannot cancel a running actor task), then it is raised as
        one line naming the worker."""
        import ray

        pending, results = list(refs), {}
        t0, reported = time.perf_counter(), False
        while pending:
            wait = (
                None if reported or not (self.stall_s and what) else max(0.0, self.stall_s - (time.perf_counter() - t0))
            )
            done, pending = ray.wait(pending, num_returns=1, timeout=wait)
            if not done:
                reported = True
                self._report_stall(what)
                continue
            try:
                results[done[0]] = ray.get(done[0])
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as err:
                culprit, err = self._root_failure(refs, done[0], err, pending)
                if pending and ray.wait(pending, num_returns=len(pending), timeout=0)[1]:
                    self._kill_workers()  # some are still running, e.g. waiting for the failed one
                raise self._one_line(culprit, err) from err
        return [results[r] for r in refs]

    def _report_stall(self, what: str) -> None:
        """Once per call that outlasts trainer.stall_report_s: the workers wrote their stacks at
        that moment (Worker.watch) and go on; so does this wait."""
        where = f"{self.run_dir}/{STACKS_GLOB}" if self.run_dir is not None else "not written (no run folder)"
        self.say(
            f"the workers' {what} is still running after trainer.stall_report_s={self.stall_s:g} s; "
            f"their Python stacks at that moment: {where}"
        )

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
        who = f"worker {index} of {len(self.workers)}" if len(self.workers) > 1 else "the worker"
        return failure_line(err, who, self.trace_file)

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
        from lorarl.rollout.vllm.engine_process import remove_stale_adapter_dirs

        remove_stale_adapter_dirs()
