"""What crosses the Ray boundary between the driver (lorarl.trainer) and the workers.

One dataclass per call, so the driver's fields and the worker's reads are checked by name, not
by position. A request carries the values the worker and its engine need (temperature, n,
lengths, seed), so they never read them from the run config behind the trainer's back.
What a step's update and sync measured comes back typed (UpdateReport, SyncReport); each turns
itself into the flat `{"group/name": value}` metrics the trackers log (`metrics()`), the names
lorarl.metrics describes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lorarl.sync.payload import SyncStats


@dataclass(frozen=True)
class GenerateRequest:
    """Sample `n` responses to each prompt on one vLLM engine (every worker of it gets the same)."""

    prompt_ids: list[list[int]]
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    # Training rollouts: the first one a worker sees sets the sync probe's sequences (lorarl.sync.session).
    for_training: bool


@dataclass
class Rollouts:
    """Per prompt, the n sampled responses and the sampler's log-prob of each of their tokens."""

    token_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    seconds: float


@dataclass(frozen=True)
class Sampling:
    """How a step's samples were drawn, as the update reads it: a mini-batch is
    actor.ppo_mini_batch_size prompts x `n` sequences, log-probs are taken at `temperature`,
    seq-mean-token-sum-norm divides by `max_response_length`, and the mini-batch shuffle is
    seeded by `seed` and the step."""

    n: int
    temperature: float
    max_response_length: int
    seed: int


@dataclass(frozen=True)
class UpdateRequest:
    """One data-parallel replica's share of a step's samples."""

    step: int
    prompt_ids: list[list[int]]  # one per sequence (a prompt repeats for each of its n samples)
    response_ids: list[list[int]]
    advantages: list[float]
    rollout_logprobs: list[list[float]] | None
    sampling: Sampling


@dataclass(frozen=True)
class Placement:
    """Where Ray placed a worker (Worker.location): its node's id and IP, its process id, and the
    GPUs it sees (empty on CPU)."""

    node_id: str
    ip: str
    pid: int
    gpus: list[str]


@dataclass(frozen=True)
class Rendezvous:
    """Where the workers' process group meets (Worker.setup): rank 0's address and a free port."""

    master_addr: str
    master_port: int


@dataclass(frozen=True)
class WorkerSetup:
    """A worker after setup: its data-parallel place, whether its rollout sleeps during the
    update (a line for the log), and how long its two start-up stages took."""

    dp_rank: int
    dp_size: int
    sleep_plan: str
    rollout_start_seconds: float  # the vLLM engine: weights, compile, KV cache, CUDA graphs
    engine_build_seconds: float  # the training engine: model, LoRA, sharding, optimizer


@dataclass(frozen=True)
class SyncRequest:
    """Bring every rollout up to date after the update of `step` (0: before training starts)."""

    step: int
    last: bool


def reduce_metrics(values: dict[str, list[float]]) -> dict[str, float]:
    """One number per metric over micro-batches (or replicas): the largest for `*_max` keys, the
    smallest for `*_min` keys, else the mean."""
    return {
        k: max(v) if k.endswith("_max") else min(v) if k.endswith("_min") else sum(v) / len(v)
        for k, v in values.items()
    }


# The keys lorarl.algorithms.ppo.ppo_update reports that UpdateReport has fields for; the rest (the
# rollout correction's rollout_corr/*, a loss's own actor/* extras) travel in `extra`.
_PPO_FIELDS = {
    "actor/pg_loss": "pg_loss",
    "actor/pg_clipfrac": "pg_clipfrac",
    "actor/ppo_kl": "ppo_kl",
    "actor/pg_clipfrac_lower": "pg_clipfrac_lower",
    "actor/entropy": "entropy",
    "actor/kl_loss": "kl_loss",
    "actor/padding_frac": "padding_frac",
    "actor/grad_norm": "grad_norm",
    "actor/micro_batches": "micro_batches",
    "actor/micro_batch_tokens_max": "micro_batch_tokens_max",
    "actor/lr": "lr",
}


@dataclass
class UpdateReport:
    """One data-parallel replica's update: the PPO update's numbers (means over micro-batches and
    mini-batches, lorarl.algorithms.ppo.ppo_update) and the worker's timings around it. None: not measured
    this step (entropy with the metric off, KL loss off, off-policy passes skipped, memory on CPU)."""

    pg_loss: float
    pg_clipfrac: float
    ppo_kl: float
    pg_clipfrac_lower: float
    padding_frac: float
    grad_norm: float
    micro_batches: float
    micro_batch_tokens_max: float  # largest padded micro-batch (what the sleep plan scales from)
    lr: float
    slept: bool  # the rollout slept during this update (its sleep plan)
    sleep_seconds: float
    update_seconds: float
    entropy: float | None = None
    kl_loss: float | None = None
    old_logp_seconds: float | None = None
    ref_logp_seconds: float | None = None
    max_allocated_gib: float | None = None
    update_peak_gib: float | None = None
    alloc_retries: float | None = None
    extra: dict[str, float] = field(default_factory=dict)  # rollout_corr/*, a loss's other actor/* keys

    @classmethod
    def of(cls, ppo_metrics: dict[str, float], **worker) -> UpdateReport:
        """From ppo_update's metrics and the worker's own fields (timings, sleeps, memory)."""
        named = {f: ppo_metrics[k] for k, f in _PPO_FIELDS.items() if k in ppo_metrics}
        extra = {k: v for k, v in ppo_metrics.items() if k not in _PPO_FIELDS}
        return cls(**named, **worker, extra=extra)

    def metrics(self) -> dict[str, float]:
        """The logged keys, in the order the run logs them."""
        out = dict(self.extra)
        out["actor/pg_loss"] = self.pg_loss
        out["actor/pg_clipfrac"] = self.pg_clipfrac
        out["actor/ppo_kl"] = self.ppo_kl
        out["actor/pg_clipfrac_lower"] = self.pg_clipfrac_lower
        _put(out, "actor/entropy", self.entropy)
        _put(out, "actor/kl_loss", self.kl_loss)
        out["actor/padding_frac"] = self.padding_frac
        out["actor/grad_norm"] = self.grad_norm
        out["actor/micro_batches"] = self.micro_batches
        out["actor/micro_batch_tokens_max"] = self.micro_batch_tokens_max
        out["actor/lr"] = self.lr
        _put(out, "memory/max_allocated_gib", self.max_allocated_gib)
        _put(out, "memory/update_peak_gib", self.update_peak_gib)
        _put(out, "memory/alloc_retries", self.alloc_retries)
        out["timing/sleep"] = self.sleep_seconds
        out["rollout/sleeps"] = float(self.slept)
        _put(out, "timing/old_logp", self.old_logp_seconds)
        _put(out, "timing/ref_logp", self.ref_logp_seconds)
        out["timing/update"] = self.update_seconds
        return out


@dataclass
class SyncReport:
    """One sync of one worker (or, merged, of all of them): what was sent (base, then adapter),
    the exact checks, the log-prob probe when it ran, the wake. None: not run this sync."""

    kind: str  # adapter, base, merged, or base+adapter (lorarl.sync.PayloadKind values)
    num_tensors: int
    bytes: int
    gather_seconds: float
    transfer_seconds: float
    load_seconds: float
    seconds: float
    num_adapters: int = 0  # adapters vLLM holds after the sync
    # The exact fingerprint checks (lorarl.sync.transport): base or merged weights, then the adapter.
    weights_match: float | None = None
    weights_checked: int | None = None
    weights_check_seconds: float | None = None
    adapter_match: float | None = None
    adapter_check_seconds: float | None = None
    # The semantic check (lorarl.sync.semantic): the delta vLLM applies per module is the trainer's.
    adapter_meaning: float | None = None
    meaning_check_seconds: float | None = None
    # The log-prob probe (lorarl.probe.ProbeReading), when it was due.
    logprob_diff_max: float | None = None
    logprob_diff_mean: float | None = None
    logprob_ref_diff_mean: float | None = None
    probe_seconds: float | None = None
    wake_seconds: float | None = None  # waking vLLM's weights and cache (only when it sleeps)
    # A changed sleep plan, taking effect at the next update, or the measured reason a sleep is
    # kept (said once): on the console, not logged.
    sleep_plan: str | None = None

    @classmethod
    def of(cls, stats: list[SyncStats], num_adapters: int) -> SyncReport:
        """One sync's payloads (base, then adapter) summed."""
        return cls(
            kind="+".join(s.kind.value for s in stats),
            num_tensors=sum(s.num_tensors for s in stats),
            bytes=sum(s.bytes for s in stats),
            gather_seconds=sum(s.gather_s for s in stats),
            transfer_seconds=sum(s.transfer_s for s in stats),
            load_seconds=sum(s.load_s for s in stats),
            seconds=sum(s.seconds for s in stats),
            num_adapters=num_adapters,
        )

    @staticmethod
    def merge(reports: list[SyncReport]) -> SyncReport:
        """The workers' reports as one: the first worker's, with the probe's worst token and the
        adapter count taken over all of them, and the first sleep plan any of them says."""
        first = reports[0]
        worst = {
            "num_adapters": max(r.num_adapters for r in reports),
            "sleep_plan": next((r.sleep_plan for r in reports if r.sleep_plan), None),
        }
        if first.logprob_diff_max is not None:
            worst["logprob_diff_max"] = max(r.logprob_diff_max for r in reports)
            worst["logprob_diff_mean"] = max(r.logprob_diff_mean for r in reports)
        return dataclasses.replace(first, **worst)

    def metrics(self) -> dict[str, float | int | str]:
        """The logged `sync/*` keys (and `timing/wake`), in the order the run logs them."""
        out: dict[str, float | int | str] = {
            "sync/kind": self.kind,
            "sync/num_tensors": self.num_tensors,
            "sync/bytes": self.bytes,
            "sync/gather_seconds": self.gather_seconds,
            "sync/transfer_seconds": self.transfer_seconds,
            "sync/load_seconds": self.load_seconds,
            "sync/seconds": self.seconds,
            "sync/num_adapters": self.num_adapters,
        }
        for name in (
            "weights_match",
            "weights_checked",
            "weights_check_seconds",
            "adapter_match",
            "adapter_check_seconds",
            "adapter_meaning",
            "meaning_check_seconds",
            "logprob_diff_max",
            "logprob_diff_mean",
            "logprob_ref_diff_mean",
            "probe_seconds",
        ):
            _put(out, f"sync/{name}", getattr(self, name))
        _put(out, "timing/wake", self.wake_seconds)
        return out


def _put(out: dict, key: str, value) -> None:
    if value is not None:
        out[key] = value
