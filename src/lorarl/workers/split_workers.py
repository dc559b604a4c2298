"""The two kinds of worker of trainer.placement=split, each on a device of its own.

TrainerWorker holds the training engine and no vLLM: it updates, exports the adapter with the
semantic check's expected side (lorarl.sync.split.SyncSender) and computes the probe's trainer
log-probs. RolloutWorker holds one vLLM engine and no training model: it generates, loads each
adapter it is sent and checks it (SyncReceiver), and judges the probe. Both are Workers in
everything else (placement, process group, checkpoints, shutdown); neither reads the run config.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from lorarl.algorithms.ppo import Correction
from lorarl.contract.messages import Rendezvous, RolloutSetup, SyncReport, SyncRequest, WorkerSetup
from lorarl.contract.specs import WorkerSpec
from lorarl.sync.split import SyncBundle, SyncReceiver, SyncSender, TrainerProbe
from lorarl.workers.stall_report import stacks_file
from lorarl.workers.worker import Worker, make_engine

AWAKE_PLAN = "rollout: vLLM has devices of its own and stays awake (trainer.placement=split)"


class AwakeRollout:
    """The sleep a training worker without vLLM has: none (the update's calls are no-ops)."""

    sleeps = False
    plan = AWAKE_PLAN

    def sleep(self) -> float:
        return 0.0

    def record_update(self, peak_bytes: int, tokens: int) -> None:
        pass


class TrainerWorker(Worker):
    """One rank of the training engine; no vLLM in this process."""

    def setup(self, rendezvous: Rendezvous) -> WorkerSetup:
        """Process group, then the engine (its own copy of the base: vLLM is elsewhere)."""
        with self.watch():
            self._join_group(rendezvous)
            t0 = time.perf_counter()
            self.engine = make_engine(self.spec.engine, self.device)
            self.sleep = AwakeRollout()
            self.sender = SyncSender(self.spec.sync, self.engine)
            self.correction = Correction.of(
                self.spec.rollout_correction, self.device.type, self.spec.off_policy_steps > 0
            )
            return WorkerSetup(
                dp_rank=self.dp_rank,
                dp_size=self.dp_size,
                sleep_plan=AWAKE_PLAN,
                rollout_sleeps=False,
                rollout_start_seconds=0.0,
                engine_build_seconds=time.perf_counter() - t0,
            )

    def sync_export(self, request: SyncRequest, dtype: torch.dtype) -> list[SyncBundle] | None:
        """The bundles for the rollout workers after the update of `request.step`, in vLLM's LoRA
        `dtype`. Collective; rank 0 returns them (every rank holds the same), the others None."""
        with self.watch():
            bundles = self.sender.bundles(request, dtype)
            return bundles if self.rank == 0 else None

    def probe_logprobs(self, sequences: list[list[int]]) -> TrainerProbe | None:
        """The trainer's log-probs of a rollout worker's probe sequences. Collective; rank 0's result."""
        with self.watch():
            result = self.sender.probe_logprobs(sequences)
            return result if self.rank == 0 else None


class RolloutWorker(Worker):
    """One vLLM engine in a process group of its own; no training model in this process."""

    def __init__(self, spec: WorkerSpec, *, index: int, log_rank: int, device: str, threads=None, run_dir=None):
        """`index`: which rollout engine (its arguments, its share of the prompts); `log_rank`: the
        number its stall report file carries (after the training ranks)."""
        super().__init__(spec, rank=0, world_size=1, device=device, threads=threads, run_dir=run_dir)
        self.index = index
        self.stacks_path = stacks_file(Path(run_dir), log_rank) if run_dir is not None else None

    @property
    def rollout_rank(self) -> int:
        return self.index

    def setup(self, rendezvous: Rendezvous) -> RolloutSetup:
        with self.watch():
            from lorarl.rollout.vllm.engine import VLLMRollout

            self._join_group(rendezvous)
            spec = self.spec
            t0 = time.perf_counter()
            self.rollout = VLLMRollout(
                spec.rollout.engine_args[self.index],
                adapter_transport=spec.rollout.adapter_transport,
                fingerprint_base=spec.rollout.fingerprint_base,
            )
            self.receiver = SyncReceiver(spec.sync, self.rollout, self.index)
            # The one adapter's session as generate() sees it: it sets the probe sequences there
            # (duck-typed: wants_probes, set_probes).
            self.sync_sessions = [self.receiver]
            return RolloutSetup(self.rollout.torch_dtype, AWAKE_PLAN, time.perf_counter() - t0)

    def sync_receive(self, bundles: list[SyncBundle], request: SyncRequest) -> tuple[SyncReport, list | None]:
        """Load and check the trainer's bundles; (the report, the probe sequences when the probe is due)."""
        with self.watch():
            report = self.receiver.receive(bundles)
            if self.receiver.version is not None:
                self.adapter_version = self.receiver.version
            return report, self.receiver.probe_due(request)

    def probe_judge(self, trainer: TrainerProbe, report: SyncReport, seconds: float) -> SyncReport:
        """The probe judged here, against the trainer's log-probs; the report with its reading."""
        with self.watch():
            return self.receiver.judge(trainer, report, seconds)
