"""One worker per device: a training engine and a vLLM rollout, colocated.

The worker places itself (process group, the rollout, then the engine) and answers the driver's
three calls per step (lorarl.contract.messages): generate, update, sync. Each concern has its own module:
whether the rollout sleeps during the update (lorarl.rollout.sleep), the weight sync and its
checks (lorarl.sync.session), the PPO update (lorarl.algorithms.ppo), the checkpoint files
(lorarl.files.checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import random
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lorarl.algorithms.ppo import AdapterPlan, Correction, needs_old_logp, ppo_update
from lorarl.contract.engine import AdapterView, Engine, build_batch
from lorarl.contract.messages import (
    GenerateRequest,
    Placement,
    Rendezvous,
    Rollouts,
    SyncReport,
    SyncRequest,
    UpdateReport,
    UpdateRequest,
    WorkerSetup,
)
from lorarl.contract.specs import EngineSpec, WorkerSpec
from lorarl.errors import LorarlError
from lorarl.files.checkpoint import load_engine_state, save_engine_state
from lorarl.files.peft_io import save_peft_adapter
from lorarl.rollout.sleep import RolloutSleep
from lorarl.rollout.vllm.base_views import engine_base_views
from lorarl.sync.session import SyncSession
from lorarl.workers.stall_report import stacks_after, stacks_file


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Worker:
    def __init__(
        self,
        spec: WorkerSpec,
        *,
        rank: int,
        world_size: int,
        device: str,
        threads: int | None = None,
        run_dir: str | None = None,
    ):
        """`spec`: all of the run's configuration this worker reads (lorarl.driver.prepare builds it)."""
        self.spec = spec
        self.rank = rank
        self.stacks_path = stacks_file(Path(run_dir), rank) if run_dir is not None else None
        self.world_size = world_size
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        if threads:
            torch.set_num_threads(threads)
        self.engine: Engine | None = None
        self.rollout = None
        self.sleep: RolloutSleep | None = None
        self.sync_sessions: list[SyncSession] = []
        self.adapter_version = 0  # updates the adapter vLLM holds has had (SyncRequest.version)
        self._in_flight: InFlight | None = None  # a generation running beside the update (generate_start)
        self._update_stream = None  # CUDA, off-policy: the stream every update runs on (update)

    def watch(self) -> contextlib.AbstractContextManager:
        """The stall watch around a call of the driver's that does work (setup, the step's calls,
        the checkpoints'): past trainer.stall_report_s this worker's Python stacks go to its stacks
        file (lorarl.workers.stall_report), and the call goes on."""
        return stacks_after(self.stacks_path, self.spec.stall_report_s)

    # Ray calls these on every worker before anything else.
    def location(self) -> Placement:
        """Where Ray placed this worker: node id and IP, process id, and its GPUs (empty on CPU)."""
        import ray

        ctx = ray.get_runtime_context()
        return Placement(
            node_id=ctx.get_node_id(),
            ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            gpus=[str(g) for g in ctx.get_accelerator_ids().get("GPU", [])],
        )

    def rendezvous(self) -> Rendezvous:
        """Where the process group can meet on this worker's node (rank 0's): its IP and a free TCP port."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return Rendezvous(master_addr=ray.util.get_node_ip_address(), master_port=port)

    def setup(self, rendezvous: Rendezvous) -> WorkerSetup:
        """Process group, rollout, then engine."""
        with self.watch():
            from lorarl.rollout.vllm.engine import VLLMRollout

            spec = self.spec
            self._join_group(rendezvous)
            # vLLM first: on a GPU it sizes its KV cache from the memory still free.
            t0 = time.perf_counter()
            self.rollout = VLLMRollout(
                # The ranks of one engine sample in lockstep: its arguments, seed included, are theirs.
                spec.rollout.engine_args[self.rollout_rank],
                adapter_transport=spec.rollout.adapter_transport,
                fingerprint_base=spec.rollout.fingerprint_base,
                share_weights=spec.base_plan.shared,
            )
            t1 = time.perf_counter()
            # Shared base: the trainer's frozen weights are views of the engine's (lorarl.engines.shared_base).
            base = engine_base_views(self.rollout) if spec.base_plan.shared else None
            self.engine = make_engine(spec.engine, self.device, base=base)
            t2 = time.perf_counter()
            self.sleep = RolloutSleep(spec.sleep, self.device, self.rollout)
            # One sync session per adapter, each over its adapter and LoRA slot: a run's one, or each
            # job's of a sweep group, synced, checked and probed as that job alone would be.
            adapters = spec.engine.adapters
            self.sync_sessions = [
                SyncSession(
                    dataclasses.replace(spec.sync, fault=adapter.sync_fault),
                    AdapterView(self.engine, i),
                    self.rollout if len(adapters) == 1 else self.rollout.slot(i),
                    self.rank,
                )
                for i, adapter in enumerate(adapters)
            ]
            self.correction = Correction.of(spec.rollout_correction, self.device.type, spec.off_policy_steps > 0)
            return WorkerSetup(
                dp_rank=self.dp_rank,
                dp_size=self.dp_size,
                sleep_plan=str(self.sleep.plan),
                rollout_sleeps=self.sleep.sleeps,
                rollout_start_seconds=t1 - t0,
                engine_build_seconds=t2 - t1,
            )

    def _join_group(self, rendezvous: Rendezvous) -> None:
        """This worker's process group (rank, world size), bound to its device; RNGs seeded by rank."""
        master_addr, master_port = rendezvous.master_addr, rendezvous.master_port
        spec = self.spec
        tp = spec.rollout.tensor_parallel_size
        if tp > 1:
            # Consecutive ranks share one vLLM engine, each holding its tensor-parallel shard
            # (vLLM's external_launcher: one engine per process, the ranks found in the
            # torchrun variables and the process group made below). Each process sees its own
            # device only (Ray sets CUDA_VISIBLE_DEVICES per worker), so its local rank is 0 on
            # GPU; on CPU the rank within the node picks the cores vLLM binds its threads to.
            local = 0 if self.device.type == "cuda" else self.rank % spec.rollout.n_gpus_per_node
            os.environ.update(
                RANK=str(self.rank),
                LOCAL_RANK=str(local),
                WORLD_SIZE=str(self.world_size),
                MASTER_ADDR=master_addr,
                MASTER_PORT=str(master_port),
            )

        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
        # On CUDA the group is bound to this worker's device, so NCCL connects now and every
        # group made later (Megatron's, vLLM's) is split from it at once. Left lazy, a group's
        # first collective connects it mid-update, when PyTorch's cache may hold all the memory
        # vLLM left, and NCCL's own allocation can fail ("Failed to CUDA calloc async").
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
            device_id=self.device if cuda else None,
        )
        seed_everything(spec.seed + self.rank)

    @property
    def rollout_rank(self) -> int:
        """Which vLLM engine this worker holds a shard of; the workers of one engine get the same prompts."""
        return self.rank // self.spec.rollout.tensor_parallel_size

    @property
    def dp_rank(self) -> int:
        """Workers with the same dp_rank hold one model replica (tensor/pipeline parallel) and get the same data."""
        return self.engine.dp_rank

    @property
    def dp_size(self) -> int:
        return self.engine.dp_size

    # ---- the step: generate, update, sync --------------------------------------------------

    def generate(self, request: GenerateRequest) -> Rollouts:
        with self.watch():
            version = self.adapter_version
            out = self.rollout.sample(
                request.prompt_ids,
                n=request.n,
                temperature=request.temperature,
                top_p=request.top_p,
                max_tokens=request.max_tokens,
                seed=request.seed,
                slots=request.adapters,
                temperatures=request.temperatures,
                top_ps=request.top_ps,
            )
            if request.for_training:
                # Each adapter's probe sequences: its first training prompts, each with its first sample.
                adapters = request.adapters or [0] * len(request.prompt_ids)
                for i, session in enumerate(self.sync_sessions):
                    if session.wants_probes and i in adapters:
                        rows = [k for k, a in enumerate(adapters) if a == i]
                        session.set_probes([request.prompt_ids[k] + out.token_ids[k][0] for k in rows])
            out.adapter_version = version
            return out

    def generate_start(self, request: GenerateRequest) -> None:
        """Begin `generate` in a thread of this process and return at once, so the update call that
        follows runs beside it (trainer.off_policy_steps=1); generate_collect returns its result.
        vLLM must stay awake for that: while the sleep plan sleeps it, the generation runs here,
        before the update, and the overlap is lost but not the order."""
        if self._in_flight is not None:
            raise RuntimeError("generate_start: a generation is already in flight (generate_collect first)")
        self._in_flight = InFlight(lambda: self.generate(request))
        if self.sleep.sleeps:
            self._in_flight.wait()

    def generate_collect(self) -> Rollouts:
        """The result of the generation generate_start began (its error, raised here)."""
        if self._in_flight is None:
            raise RuntimeError("generate_collect: no generation in flight (generate_start first)")
        in_flight, self._in_flight = self._in_flight, None
        return in_flight.result()

    def update(self, request: UpdateRequest) -> UpdateReport:
        """Sleep the rollout, then the PPO update on this replica's samples. Collective.

        Old log-probs get their own pass only when the update is off-policy (several epochs or
        mini-batches); reference log-probs only when the KL loss uses them.
        """
        with self.watch():
            timing = {"sleep_seconds": self.sleep.sleep(), "slept": self.sleep.sleeps}
            a = self.spec.engine.actor  # the batch shape every adapter shares
            plans = [
                AdapterPlan(adapter.actor, sampling, self.correction)
                for adapter, sampling in zip(self.spec.engine.adapters, request.samplings, strict=True)
            ]
            temperature = plans[0].sampling.temperature if len(plans) == 1 else [p.sampling.temperature for p in plans]
            with self._update_stream_if_beside_vllm():
                if self.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(self.device)
                    before = torch.cuda.memory_allocated(self.device)
                    retries = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
                batch = build_batch(
                    request.prompt_ids,
                    request.response_ids,
                    self.engine.pad_token_id,
                    request.advantages,
                    self.engine.left_pad_prompts,
                    request.rollout_logprobs,
                    request.adapters,
                )
                if needs_old_logp(a, self.spec.train_batch_size, self.correction, self.spec.off_policy_steps > 0):
                    t0 = time.perf_counter()
                    batch.old_logp = self.engine.log_probs(batch, temperature=temperature)
                    timing["old_logp_seconds"] = time.perf_counter() - t0
                if any(p.actor.use_kl_loss for p in plans):
                    t0 = time.perf_counter()
                    batch.ref_logp = self.engine.log_probs(batch, temperature=temperature, reference=True)
                    timing["ref_logp_seconds"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                stats = ppo_update(self.engine, batch, request.step, plans)
                timing["update_seconds"] = time.perf_counter() - t0
                report = UpdateReport(ppo=stats, **timing)
                if self.device.type == "cuda":
                    highest = torch.cuda.max_memory_allocated(self.device)
                    tokens = max(s.micro_batch_tokens_max for s in stats if s is not None)
                    self.sleep.record_update(highest - before, int(tokens))
                    report.max_allocated_gib = highest / 2**30
                    report.update_peak_gib = (highest - before) / 2**30
                    retried = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0) - retries
                    report.alloc_retries = float(retried)
            return report

    @contextlib.contextmanager
    def _update_stream_if_beside_vllm(self) -> Iterator[None]:
        """Off-policy on CUDA, vLLM may be generating in another thread on the default stream. The
        update then gets a stream of its own so its kernels run beside vLLM's instead of queueing
        behind them, and it is the same stream for every update of the run: the caching allocator
        reuses a freed block only on the stream that allocated it, so neither side can be handed
        memory the other's queued kernels still use. vLLM stays on the default stream it started
        on: run on a side stream of its own (its start-up buffers on the default one), it faulted
        the GPU within three 7B steps, and ran clean with CUDA_LAUNCH_BLOCKING=1."""
        if self.device.type != "cuda" or not self.spec.off_policy_steps:
            yield
            return
        if self._update_stream is None:
            self._update_stream = torch.cuda.Stream(self.device)
        self._update_stream.wait_stream(torch.cuda.current_stream(self.device))  # the sync's writes
        with torch.cuda.stream(self._update_stream):
            yield
        self._update_stream.synchronize()  # the sync and the next step read what it wrote

    def sync(self, request: SyncRequest) -> list[SyncReport]:
        """Wake the rollout's weights, sync and check every adapter, wake its cache, probe; one
        report per adapter. Collective.

        The cache wakes after the payloads are applied (their gathers have its memory) and
        before the probe, which generates. A generation still in flight (generate_start) ends
        first: the adapter it samples with is never replaced under it. The first adapter's sync
        brings the base too when vLLM lacks it."""
        with self.watch():
            if self._in_flight is not None:
                self._in_flight.wait()
            t_wake = self.sleep.wake(["weights"])
            reports = [self._each_adapter(i, lambda s: s.sync(request)) for i in range(len(self.sync_sessions))]
            t_wake += self.sleep.wake(["kv_cache"])
            for i, report in enumerate(reports):
                self._each_adapter(i, lambda s, r=report: s.probe_if_due(request, r))
            first = reports[0]
            if self.sleep.sleeps:
                first.wake_seconds = t_wake
            # Awake again here, so a changed plan takes effect at the next update's sleep.
            first.sleep_plan = self.sleep.replan()
            if first.sleep_plan:
                first.rollout_sleeps = self.sleep.sleeps
            self.adapter_version = request.step if request.version is None else request.version
            return reports

    def _each_adapter(self, index: int, call):
        """`call(session)` for adapter `index`; where several adapters train, a failure names the
        adapter's job (a fault in one stops the group at once, named)."""
        try:
            return call(self.sync_sessions[index])
        except LorarlError as err:
            if len(self.sync_sessions) == 1:
                raise
            raise type(err)(f"{self.spec.engine.adapters[index].label}: {err}") from err

    # ---- checkpoints (the format: lorarl.files.checkpoint) ----------------------------------------

    def save_checkpoint(self, directories: Sequence[str]) -> None:
        """Each adapter's state into its own folder (a run's one; a group's, one per job)."""
        with self.watch():
            for i, directory in enumerate(directories):
                save_engine_state(AdapterView(self.engine, i), directory, self.rank)
            dist.barrier()

    def load_checkpoint(self, directories: Sequence[str]) -> None:
        with self.watch():
            for i, directory in enumerate(directories):
                load_engine_state(AdapterView(self.engine, i), directory, self.rank)

    def export_adapter(self, directories: Sequence[str]) -> None:
        """Each trained adapter as a standard PEFT folder (rank 0 writes; collective); with expert
        LoRA also its per-expert copy for vLLM in `<directory>/vllm`."""
        with self.watch():
            for i, directory in enumerate(directories):
                self._export_adapter(AdapterView(self.engine, i), directory)
            dist.barrier()

    def _export_adapter(self, engine: AdapterView, directory: str) -> None:
        lora = engine.lora_state()
        if self.rank == 0:
            config = engine.adapter_config()
            save_peft_adapter(directory, lora, config)
            experts = getattr(self.engine, "expert_wrappers", None)
            if experts:
                # PEFT reads expert LoRA as stacks, vLLM per expert: the vLLM copy goes beside it.
                from lorarl.sync.experts import VLLM_ADAPTER_SUBDIR, to_vllm_layout, vllm_adapter_config

                save_peft_adapter(
                    Path(directory) / VLLM_ADAPTER_SUBDIR, to_vllm_layout(lora, experts), vllm_adapter_config(config)
                )

    # ---- lifecycle -----------------------------------------------------------------------

    def shutdown(self) -> None:
        if self.rollout is not None:
            self.rollout.shutdown()
            self.rollout = None
        self.engine = None
        if dist.is_initialized():
            from lorarl.rollout.vllm import engine_process

            engine_process.release_distributed()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


class InFlight:
    """One call running in a daemon thread of the worker; `result()` joins it and returns its
    value or raises its exception."""

    def __init__(self, call):
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(call,), name="lorarl-generate", daemon=True)
        self._thread.start()

    def _run(self, call) -> None:
        try:
            self._value = call()
        except BaseException as err:  # noqa: BLE001 - handed to the caller of result()
            self._error = err

    def wait(self) -> None:
        self._thread.join()

    def result(self):
        self.wait()
        if self._error is not None:
            raise self._error
        return self._value


def make_engine(spec: EngineSpec, device: torch.device, base: dict | None = None) -> Engine:
    """The training engine the spec names (lorarl.engines.BACKENDS), built from its spec (model,
    actor and backend groups, the seed), over the shared base's views when it has them
    (lorarl.engines.shared_base); a step's values come in the call (lorarl.algorithms.ppo
    passes the request's Sampling)."""
    return spec.engine_class()(spec, device, **({} if base is None else {"base": base}))


# Communication settings the launching shell chose (e.g. NCCL_NVLS_ENABLE=0 where NVLink
# multicast must stay off) reach every worker, also on a Ray cluster whose nodes were started
# with another environment.
FORWARDED_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_SYMM_MEM_", "NVSHMEM_")


def worker_env() -> dict[str, str]:
    """Environment every worker process needs before vLLM is imported."""
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    return env | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore"),
    }
