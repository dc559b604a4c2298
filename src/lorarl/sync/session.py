"""One worker's weight sync: export -> apply -> check -> probe, and when the probe runs.

The session reads exactly one state to choose what to send: whether the rollout holds the base
weights (`rollout.base_loaded`). The payload kind follows from it, the payload carries that
kind, and the rollout dispatches on the payload; no second flag exists that could disagree.
After every adapter sync the transport check (lorarl.sync.transport: vLLM holds the bytes sent) and
the semantic check (lorarl.sync.semantic: they apply the trainer's deltas); after every merged
sync the weights' transport check and the merged semantic check (lorarl.sync.semantic_merged:
vLLM serves W_base + the trainer's delta); the first sync of a process preceded by a self-test
on random factors; the log-prob probe on the first
sync after the probe sequences are set (each process's first training rollout, so a resumed
run probes at once), every trainer.check_sync_probe_freq steps and on the last.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lorarl.contract.engine import Engine
from lorarl.contract.messages import SyncReport, SyncRequest
from lorarl.contract.payload import PayloadKind, SyncStats
from lorarl.errors import SyncError
from lorarl.sync import probe, semantic, transport
from lorarl.sync.faults import SyncFault
from lorarl.sync.semantic_merged import MergedCheck

if TYPE_CHECKING:
    from lorarl.contract.specs import SyncSpec


class SyncSession:
    def __init__(self, spec: SyncSpec, engine: Engine, rollout, rank: int):
        self.engine, self.rollout, self.rank = engine, rollout, rank
        self.merge = spec.merge
        self.method = "layered" if spec.layered_summon else None  # None: the engine's default gather
        self.check = spec.check
        self.tolerance = spec.tolerance
        self.probe_freq = spec.probe_freq
        self.probe_seqs: list[list[int]] | None = None  # fixed probe sequences, set once per process
        self._probe_due = False
        # Checks on and this engine computes the semantic check's expected side (lorarl.engines.BACKENDS).
        self.semantic = spec.semantic
        self.fault = SyncFault(spec.fault)
        self.fault.on_engine(engine)
        # Whether the export has been checked once with non-zero factors (lorarl.sync.semantic).
        self._self_tested = False
        self._merged_check = MergedCheck()  # caches the base's projections

    @property
    def wants_probes(self) -> bool:
        return self.check and self.probe_seqs is None

    def set_probes(self, sequences: list[list[int]]) -> None:
        """The probe's sequences (the worker passes its first training rollout's prompts, each
        with its first sample), kept for every later sync; the next sync probes. Per vLLM engine:
        every worker of one engine gets the same rollout, so they send it the same requests
        (their all-reduces would mix two different sequences)."""
        self.probe_seqs = probe.choose_probes(sequences)
        self._probe_due = True

    def sync(self, request: SyncRequest) -> SyncReport:
        """Export, apply and check every payload the rollout needs (the weights; no generation,
        so the rollout's KV cache may still sleep). Collective over all workers. A failed
        check raises SyncError."""
        stats: list[SyncStats] = []
        checks: dict = {}
        if self.merge or not self.rollout.base_loaded:
            if getattr(self.rollout, "base_shared", False):  # lorarl.engines.shared_base: never sent
                raise SyncError("the base is shared with vLLM and must stay loaded there, but the rollout lost it")
            if self.merge and self.semantic and not self._self_tested:
                self._self_test()
            payload, gather_s = self._export_base()
            stats.append(self._apply(payload, gather_s))
            if self.check:
                checks.update(self._check_base())
        if not self.merge:
            if self.semantic and not self._self_tested:
                self._self_test()
            payload, gather_s = self._export_adapter()
            stats.append(self._apply(payload, gather_s))
            if self.check:
                checks.update(self._check_adapter(payload))
        return dataclasses.replace(SyncReport.of(stats, self.rollout.num_adapters()), **checks)

    def _export_base(self):
        payload, gather_s = self.engine.export(PayloadKind.BASE)
        return (self.fault.corrupt_merged(payload, self.engine) if self.merge else payload), gather_s

    def _check_base(self) -> dict:
        """Transport (vLLM holds the weights sent), then, merged, meaning (they are W_base + delta)."""
        t0 = time.perf_counter()
        checks = dict(zip(("weights_match", "weights_checked"), transport.verify_weights(self.rollout, self.rank)))
        t1 = time.perf_counter()
        checks["weights_check_seconds"] = t1 - t0
        if self.merge and self.semantic:
            checks["adapter_meaning"] = self._merged_check.verify(self.engine, self.rollout, self.rank)
            checks["meaning_check_seconds"] = time.perf_counter() - t1
        return checks

    def _export_adapter(self):
        return export_adapter(self.engine, self.method, self.rollout.torch_dtype, self.fault)

    def _check_adapter(self, payload) -> dict:
        return check_adapter(self.rollout, payload, self.engine.lora_projections if self.semantic else None, self.rank)

    def _self_test(self) -> None:
        """Once per process, before the first adapter or merged sync: the whole export -> load -> checks on
        seeded random factors, then the trained ones back. A fresh adapter's B is zero, so every
        delta is zero and a wrong layout would pass the semantic check until training moved it."""
        # Merged, the delta must stand out of the served dtype's rounding of W_base + delta
        # (lorarl.sync.semantic_merged): larger factors, a delta of the weights' own size at rank 8.
        with semantic.randomized(self.engine.lora_parameters(), std=0.05 if self.merge else 0.02):
            if self.merge:
                self.rollout.apply(self._export_base()[0])
                self._check_base()
            else:
                payload, _ = self._export_adapter()
                self.rollout.apply(payload)
                self._check_adapter(payload)
        self._self_tested = True

    def probe_if_due(self, request: SyncRequest, report: SyncReport) -> None:
        """After `sync`, with the rollout fully awake (the probe generates, so it needs the KV
        cache): the log-prob probe when it is due, its reading added to `report`. Collective."""
        if not self._probe_now(request):
            return
        t0 = time.perf_counter()
        reading = self.probe()
        report.logprob_diff_max = reading.sync_max
        report.logprob_diff_mean = reading.sync_mean
        report.logprob_ref_diff_mean = reading.ref_mean
        report.probe_seconds = time.perf_counter() - t0

    def _probe_now(self, request: SyncRequest) -> bool:
        if not self.check or self.probe_seqs is None or request.step == 0:
            return False
        due, self._probe_due = self._probe_due, False
        return due or request.step % self.probe_freq == 0 or request.last

    def _apply(self, payload, gather_s: float) -> SyncStats:
        stats = self.rollout.apply(payload)
        stats.gather_s = gather_s
        return stats

    @property
    def probe_bounds(self) -> probe.ProbeBounds:
        trainer_fp32 = self.engine.compute_dtype == torch.float32
        return probe.probe_bounds(trainer_fp32, self.rollout.dtype, self.tolerance)

    def probe(self) -> probe.ProbeReading:
        """Trainer vs vLLM log-probs on the probe sequences, judged; a failure is a SyncError."""
        reading = probe.measure_probe(self.engine, self.rollout, self.probe_seqs)
        probe.judge_probe(reading, self.probe_bounds, rank=self.rank)
        return reading


# The two halves of an adapter sync, apart so that split placement (lorarl.sync.split) runs each in
# the process that holds its side: the export where the training engine is, the checks where vLLM is.


def export_adapter(engine: Engine, method: str | None, dtype: torch.dtype, fault: SyncFault):
    """(the adapter payload, gather seconds), with the test fault applied. Collective."""
    # In the rollout's dtype: vLLM casts to it anyway, and half the bytes cross over.
    payload, gather_s = engine.export(PayloadKind.ADAPTER, method=method, dtype=dtype)
    return fault.corrupt(payload, engine), gather_s


def check_adapter(rollout, payload, expected: Callable[[], dict] | None, rank: int | None) -> dict:
    """Transport (vLLM holds the bytes sent), then meaning (those bytes apply the trainer's deltas,
    `expected()` being the trainer's projections; None: no semantic check)."""
    t0 = time.perf_counter()
    checks = {"adapter_match": transport.verify_adapter(rollout, payload, rank)}
    t1 = time.perf_counter()
    checks["adapter_check_seconds"] = t1 - t0
    if expected is not None:
        checks["adapter_meaning"] = semantic.verify_projections(expected(), rollout, rank)
        checks["meaning_check_seconds"] = time.perf_counter() - t1
    return checks
