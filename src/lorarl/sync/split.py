"""The adapter sync across processes (trainer.placement=split): the sender runs beside the training
engine, the receiver beside vLLM, and what passes between them goes through Ray's object store.

The session's two halves (lorarl.sync.session.export_adapter, check_adapter) run apart: the
sender exports the adapter (PEFT's layout) and computes the semantic check's expected side from
the trainer's own parameters (lorarl.sync.semantic); the receiver loads the payload and runs the
transport and semantic checks against vLLM. A bundle carries both, so a payload that never
arrives still leaves the expected side to compare with, and the checks fail at the first sync
(vLLM holds no adapter, or a stale one). The first sync of a trainer process is preceded by the
self-test bundle (seeded random factors), as colocated. The probe crosses too: the trainer's
log-probs on the receiver's probe sequences travel to it and are judged there.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from lorarl.contract.messages import SyncReport, SyncRequest
from lorarl.contract.payload import PayloadKind, SyncStats, WeightPayload
from lorarl.errors import SyncError
from lorarl.sync import probe, semantic
from lorarl.sync.faults import SyncFault
from lorarl.sync.semantic import Projection
from lorarl.sync.session import check_adapter, export_adapter


@dataclass(frozen=True)
class SyncBundle:
    """One adapter for the rollout workers: the payload (host tensors; None when the send was
    dropped), the trainer's expected side of the semantic check (None: no semantic check), the
    adapter version, and the trainer's gather seconds."""

    payload: WeightPayload | None
    expected: dict[str, Projection] | None
    version: int
    gather_seconds: float
    self_test: bool = False


@dataclass(frozen=True)
class TrainerProbe:
    """The probe's trainer side for one set of sequences: adapter on, adapter off, and whether the
    trainer computes in float32 (the bound depends on it)."""

    trainer: torch.Tensor
    reference: torch.Tensor
    trainer_fp32: bool


def _to_host(payload: WeightPayload) -> WeightPayload:
    """The payload with its tensors in host memory: the receiver sees other devices than the sender."""
    tensors = {n: t.detach().cpu() for n, t in payload.tensors}
    return WeightPayload.adapter(tensors, payload.adapter_config, payload.experts)


class SyncSender:
    """The training engine's half: bundles after each update, the probe's trainer log-probs."""

    def __init__(self, spec, engine):
        self.engine = engine
        self.method = "layered" if spec.layered_summon else None
        self.check = spec.check
        self.semantic = spec.semantic
        self.fault = SyncFault(spec.fault)
        self.fault.on_engine(engine)
        self._self_tested = False
        self._synced = False  # an adapter (not the self-test's) was exported

    def bundles(self, request: SyncRequest, dtype: torch.dtype) -> list[SyncBundle]:
        """What the rollout workers load for this sync, in order (the self-test first, once per
        process, when the semantic check is on). Collective over the trainer's ranks."""
        version = request.step if request.version is None else request.version
        out = []
        if self.semantic and not self._self_tested:
            with semantic.randomized(self.engine.lora_parameters()):
                out.append(self._bundle(version, dtype, self_test=True))
            self._self_tested = True
        out.append(self._bundle(version, dtype))
        self._synced = True
        return out

    def _bundle(self, version: int, dtype: torch.dtype, self_test: bool = False) -> SyncBundle:
        payload, gather_s = export_adapter(self.engine, self.method, dtype, self.fault)
        expected = self.engine.lora_projections() if self.semantic else None
        sent = None if self.fault.drops_send(self._synced and not self_test) else _to_host(payload)
        return SyncBundle(sent, expected, version, gather_s, self_test)

    def probe_logprobs(self, sequences: list[list[int]]) -> TrainerProbe:
        """The trainer's log-probs of a receiver's probe sequences. Collective."""
        trainer, reference = probe.trainer_logprobs(self.engine, sequences)
        return TrainerProbe(trainer, reference, self.engine.compute_dtype == torch.float32)


class SyncReceiver:
    """vLLM's half: load and check each bundle, choose the probe sequences, judge the probe."""

    def __init__(self, spec, rollout, rank: int):
        self.rollout, self.rank = rollout, rank
        self.check = spec.check
        self.tolerance = spec.tolerance
        self.probe_freq = spec.probe_freq
        self.probe_seqs: list[list[int]] | None = None
        self._probe_due = False
        self.version: int | None = None  # the adapter version vLLM holds (None: none received)

    @property
    def wants_probes(self) -> bool:
        return self.check and self.probe_seqs is None

    def set_probes(self, sequences: list[list[int]]) -> None:
        """The probe's sequences, from this worker's first training rollout; the next sync probes."""
        self.probe_seqs = probe.choose_probes(sequences)
        self._probe_due = True

    def receive(self, bundles: list[SyncBundle]) -> SyncReport:
        """Load and check every bundle in order; the report is the last one's. A failed check is a
        SyncError naming this rollout worker."""
        report = None
        for bundle in bundles:
            stats = SyncStats(PayloadKind.ADAPTER, gather_s=bundle.gather_seconds)
            if bundle.payload is not None:
                stats = self.rollout.apply(bundle.payload)
                stats.gather_s = bundle.gather_seconds
                self.version = bundle.version
            try:
                checks = self._check(bundle) if self.check else {}
            except SyncError as err:
                what = "the first sync's self-test adapter" if bundle.self_test else f"adapter version {bundle.version}"
                raise SyncError(f"rollout worker {self.rank}, {what}: {err}") from err
            report = dataclasses.replace(SyncReport.of([stats], self.rollout.num_adapters()), **checks)
        assert report is not None
        return report

    def _check(self, bundle: SyncBundle) -> dict:
        """The transport check against the payload that arrived, the semantic check against the
        trainer's expected side whether or not it did."""
        if bundle.payload is None:
            expected = bundle.expected
            if expected is None:
                raise SyncError(
                    f"no adapter arrived; vLLM holds {'none' if self.version is None else f'version {self.version}'}"
                )
            t0 = time.perf_counter()
            meaning = semantic.verify_projections(expected, self.rollout)
            return {"adapter_meaning": meaning, "meaning_check_seconds": time.perf_counter() - t0}
        expected = None if bundle.expected is None else (lambda: bundle.expected)
        return check_adapter(self.rollout, bundle.payload, expected, None)

    def probe_due(self, request: SyncRequest) -> list[list[int]] | None:
        """The probe sequences when this sync probes (as the colocated session decides), else None."""
        if not self.check or self.probe_seqs is None or request.step == 0:
            return None
        due, self._probe_due = self._probe_due, False
        return self.probe_seqs if due or request.step % self.probe_freq == 0 or request.last else None

    def judge(self, trainer: TrainerProbe, report: SyncReport, seconds: float) -> SyncReport:
        """vLLM's log-probs of the probe sequences against the trainer's; a failure is a SyncError."""
        t0 = time.perf_counter()
        vllm = probe.rollout_logprobs(self.rollout, self.probe_seqs)
        reading = probe.read_probe(trainer.trainer, vllm, trainer.reference)
        bounds = probe.probe_bounds(trainer.trainer_fp32, self.rollout.dtype, self.tolerance)
        try:
            probe.judge_probe(reading, bounds)
        except SyncError as err:
            raise SyncError(f"rollout worker {self.rank}, probe: {err}") from err
        return dataclasses.replace(
            report,
            logprob_diff_max=reading.sync_max,
            logprob_diff_mean=reading.sync_mean,
            logprob_ref_diff_mean=reading.ref_mean,
            probe_seconds=seconds + time.perf_counter() - t0,
        )
