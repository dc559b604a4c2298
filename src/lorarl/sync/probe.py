"""The log-prob probe: trainer and vLLM log-probs on a few fixed sequences, end to end.

Its noise grows with model size and shrinks with precision (bf16 at 7B reads 0.16-0.20 max with
correct weights), so it is judged on two scales: an absolute bound per dtype on the worst token,
and, on the mean, relative to how far the adapter has moved the policy from the reference
(adapter off). It proves the numerics end to end; which module is wrong is the semantic check's
job (lorarl.sync.semantic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lorarl import metrics as keys
from lorarl.errors import SyncError

PROBE_COUNT = 4
PROBE_MIN_TOKENS = 32


@dataclass(frozen=True)
class ProbeBounds:
    """max: the worst token's |trainer - vLLM| log-prob; mean: the mean over all probe tokens."""

    max: float
    mean: float


# Measured with correct weights: fp32 on both sides 6e-5 max (CPU, tiny model); bf16 0.03 max at
# 0.5B (H200) and 0.157-0.20 at 7B (H200, r=64, CUDA graphs). The 16-bit max bound leaves 2.5x
# over 7B; its mean bound is half the worst token seen at 7B (the mean of a token-wise noise
# sits well below its max; tests/gpu/test_sync_checks_gpu.py logs both).
FP32_BOUNDS = ProbeBounds(max=1e-3, mean=2e-4)
HALF_BOUNDS = ProbeBounds(max=0.5, mean=0.1)
# Once the adapter has moved the policy, a correct sync leaves vLLM much closer to the trainer
# than the adapter-off reference is: a zeroed adapter reads ~1x, a correct one ~0.
PROBE_RATIO = 0.5


def probe_bounds(trainer_fp32: bool, rollout_dtype: str, max_override: float | None = None) -> ProbeBounds:
    bounds = FP32_BOUNDS if trainer_fp32 and rollout_dtype == "float32" else HALF_BOUNDS
    return bounds if max_override is None else ProbeBounds(max=max_override, mean=bounds.mean)


def choose_probes(sequences: list[list[int]], count: int = PROBE_COUNT, min_tokens: int = PROBE_MIN_TOKENS):
    """Up to `count` fixed sequences, preferring ones of at least `min_tokens` tokens (in the
    order given), topped up with the longest others. Every token after the first is scored."""
    long = [s for s in sequences if len(s) >= min_tokens]
    short = sorted((s for s in sequences if len(s) < min_tokens), key=len, reverse=True)
    chosen = (long + short)[:count]
    if not chosen or max(len(s) for s in chosen) < 2:
        raise SyncError("no probe sequence of 2 or more tokens; trainer.check_sync needs one")
    return [list(s) for s in chosen if len(s) >= 2]


@dataclass(frozen=True)
class ProbeReading:
    sync_max: float  # max |trainer - vLLM|
    sync_mean: float  # mean |trainer - vLLM|
    ref_mean: float  # mean |trainer - reference (adapter off)|
    tokens: int
    trainer_finite: bool = True  # False: the trainer's own log-probs hold NaN/inf (training diverged)

    def as_metrics(self) -> dict[str, float]:
        return {
            keys.SYNC_LOGPROB_DIFF_MAX.key: self.sync_max,
            keys.SYNC_LOGPROB_DIFF_MEAN.key: self.sync_mean,
            keys.SYNC_LOGPROB_REF_DIFF_MEAN.key: self.ref_mean,
        }


def read_probe(trainer: Tensor, vllm: Tensor, reference: Tensor) -> ProbeReading:
    """From per-token log-probs of the same probe tokens (1-D, any float dtype)."""
    trainer, vllm, reference = (t.detach().double().cpu().reshape(-1) for t in (trainer, vllm, reference))
    if not trainer.shape == vllm.shape == reference.shape or trainer.numel() == 0:
        raise SyncError(
            f"probe log-probs disagree in length: trainer {trainer.numel()}, vLLM {vllm.numel()}, "
            f"reference {reference.numel()}"
        )
    sync = (trainer - vllm).abs()
    return ProbeReading(
        float(sync.max()),
        float(sync.mean()),
        float((trainer - reference).abs().mean()),
        trainer.numel(),
        bool(torch.isfinite(trainer).all()),
    )


def judge_probe(
    reading: ProbeReading, bounds: ProbeBounds, ratio: float = PROBE_RATIO, rank: int | None = None
) -> None:
    """Raise SyncError when the probe says vLLM does not serve the trainer's weights.

    Fails on (a) a worst token beyond the dtype's absolute bound, or (b) a mean distance above
    the dtype's noise that is not small against the adapter's own effect (trainer vs reference).
    While the adapter has barely moved, (b) cannot tell a stale adapter from noise in 16-bit;
    the exact fingerprint covers that. A trainer whose own log-probs are NaN/inf has diverged:
    nothing to compare against here, and the next update stops the run naming the step.
    """
    if not reading.trainer_finite:
        return
    who = "" if rank is None else f"rank {rank}: "
    if not math.isfinite(reading.sync_max) or reading.sync_max > bounds.max:
        raise SyncError(
            f"{who}after the sync vLLM and the trainer disagree on the probe sequences (max |log-prob diff| "
            f"{reading.sync_max:.4f} > {bounds.max}, the bound for this precision; raise it with "
            "trainer.check_sync_tolerance if this model's noise is larger); the rollout is not using the trained weights"
        )
    if reading.sync_mean > bounds.mean and reading.sync_mean > ratio * reading.ref_mean:
        raise SyncError(
            f"{who}after the sync vLLM is as far from the trainer as the adapter-off reference is (mean |log-prob "
            f"diff| {reading.sync_mean:.4f} vs {reading.ref_mean:.4f} to the reference, allowed "
            f"{ratio} x that above {bounds.mean}); the rollout is not using the trained adapter"
        )


def measure_probe(engine, rollout, sequences: list[list[int]]) -> ProbeReading:
    """Trainer (adapter on), reference (adapter off) and vLLM log-probs of every probe token
    after the first. `engine` is a training engine (log_probs with reference=), `rollout` a
    VLLMRollout."""
    trainer, reference = trainer_logprobs(engine, sequences)
    return read_probe(trainer, rollout_logprobs(rollout, sequences), reference)


def trainer_logprobs(engine, sequences: list[list[int]]) -> tuple[Tensor, Tensor]:
    """The probe's trainer side: (adapter on, adapter off) log-probs of every probe token after
    the first, flat, on the host. Collective over the engine's ranks."""
    from lorarl.contract.engine import build_batch

    batch = build_batch([s[:1] for s in sequences], [s[1:] for s in sequences], 0)
    mask = batch.response_mask.bool()
    trainer = engine.log_probs(batch, temperature=1.0).float().cpu()[mask]
    reference = engine.log_probs(batch, reference=True, temperature=1.0).float().cpu()[mask]
    return trainer, reference


def rollout_logprobs(rollout, sequences: list[list[int]]) -> Tensor:
    """The probe's vLLM side: the same tokens' log-probs from the engine serving the adapter."""
    return torch.tensor([x for row in rollout.prompt_logprobs_many(sequences, 1) for x in row], dtype=torch.float32)
