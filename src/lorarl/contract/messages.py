"""What crosses the Ray boundary between the driver (lorarl.driver.trainer) and the workers.

One dataclass per call, so the driver's fields and the worker's reads are checked by name, not
by position. A request carries the values the worker and its engine need (temperature, n,
lengths, seed), so they never read them from the run config behind the trainer's back.
What a step's update and sync measured comes back typed (UpdateReport, SyncReport); each turns
itself into the flat `{"group/name": value}` metrics the trackers log (`metrics()`), with the keys
taken from lorarl.metrics' list.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lorarl import metrics as keys

if TYPE_CHECKING:
    from lorarl.contract.payload import SyncStats


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
    # Where a sweep group's adapters sample together: per prompt, its adapter (the vLLM LoRA slot)
    # and that adapter's temperature and top_p. None: every prompt the run's one adapter's.
    adapters: list[int] | None = None
    temperatures: list[float] | None = None
    top_ps: list[float] | None = None


@dataclass
class Rollouts:
    """Per prompt, the n sampled responses and the sampler's log-prob of each of their tokens,
    and the adapter version that sampled them (the updates it had had: SyncRequest.version of the
    last sync before the generation began)."""

    token_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    seconds: float
    adapter_version: int = 0


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
    """One data-parallel replica's share of a step's samples. Where a sweep's group trains several
    adapters over one base, `adapters` says which each sequence trains and `samplings` holds one
    per adapter; a run's one adapter has `samplings[0]` and no `adapters`."""

    step: int
    prompt_ids: list[list[int]]  # one per sequence (a prompt repeats for each of its n samples)
    response_ids: list[list[int]]
    advantages: list[float]
    rollout_logprobs: list[list[float]] | None
    samplings: tuple[Sampling, ...]
    adapters: list[int] | None = None


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
    rollout_sleeps: bool  # the plan sleeps vLLM during the update: generation cannot overlap it
    rollout_start_seconds: float  # the vLLM engine: weights, compile, KV cache, CUDA graphs
    engine_build_seconds: float  # the training engine: model, LoRA, sharding, optimizer


@dataclass(frozen=True)
class RolloutSetup:
    """A rollout worker of split placement after setup: the dtype its vLLM holds LoRA in (the
    trainer exports in it), a line on its sleep for the log, how long its engine took to start."""

    dtype: object  # torch.dtype
    sleep_plan: str
    rollout_start_seconds: float
    engine_build_seconds: float = 0.0  # it builds no training engine (beside WorkerSetup's, for the start-up's)


@dataclass(frozen=True)
class SyncRequest:
    """Bring every rollout up to date after the update of `step` (0: before training starts).
    `version`: the updates the synced adapter has had, which the rollouts it samples carry
    (None: `step`; a resumed run's first sync, at step 0, sends its checkpoint's step)."""

    step: int
    last: bool
    version: int | None = None


def reduce_metrics(values: dict[str, list[float]]) -> dict[str, float]:
    """One number per metric over micro-batches (or replicas): the largest for `*_max` keys, the
    smallest for `*_min` keys, else the mean."""
    return {
        k: max(v) if k.endswith("_max") else min(v) if k.endswith("_min") else sum(v) / len(v)
        for k, v in values.items()
    }


@dataclass
class PPOStats:
    """What the PPO update measured on one replica (lorarl.algorithms.ppo.ppo_update): means over
    micro-batches and mini-batches, the largest for `*_max`. None: not measured (entropy with the
    metric off, KL loss off)."""

    pg_loss: float
    pg_clipfrac: float
    ppo_kl: float
    pg_clipfrac_lower: float
    padding_frac: float
    grad_norm: float
    micro_batches: float
    micro_batch_tokens_max: float  # largest padded micro-batch (what the sleep plan scales from)
    lr: float
    entropy: float | None = None
    kl_loss: float | None = None
    extra: dict[str, float] = field(default_factory=dict)  # rollout_corr/*, a loss's other actor/* keys
    # Why this adapter's update stopped (a non-finite loss or gradient: its weights were left as
    # they were); one of several adapters then ends alone (lorarl.algorithms.ppo.ppo_update).
    ended: str | None = None

    @classmethod
    def of(cls, measured: dict[str, float], ended: str | None = None) -> PPOStats:
        """From the update's values by logged key: the keys with a field here go to it, the rest to `extra`."""
        named = {name: measured[m.key] for name, m in _PPO_KEYS if m.key in measured}
        keys = {m.key for _, m in _PPO_KEYS}
        return cls(**named, extra={k: v for k, v in measured.items() if k not in keys}, ended=ended)

    def metrics(self) -> dict[str, float]:
        """The logged keys, in the order the run logs them: the extras first, as the loss reports them."""
        out = dict(self.extra)
        for name, m in _PPO_KEYS:
            _put(out, m.key, getattr(self, name))
        return out


# PPOStats' fields and the keys they are logged as, in the run's order.
_PPO_KEYS = (
    ("pg_loss", keys.ACTOR_PG_LOSS),
    ("pg_clipfrac", keys.ACTOR_PG_CLIPFRAC),
    ("ppo_kl", keys.ACTOR_PPO_KL),
    ("pg_clipfrac_lower", keys.ACTOR_PG_CLIPFRAC_LOWER),
    ("entropy", keys.ACTOR_ENTROPY),
    ("kl_loss", keys.ACTOR_KL_LOSS),
    ("padding_frac", keys.ACTOR_PADDING_FRAC),
    ("grad_norm", keys.ACTOR_GRAD_NORM),
    ("micro_batches", keys.ACTOR_MICRO_BATCHES),
    ("micro_batch_tokens_max", keys.ACTOR_MICRO_BATCH_TOKENS_MAX),
    ("lr", keys.ACTOR_LR),
)


@dataclass
class UpdateReport:
    """One data-parallel replica's update: the PPO update's numbers and the worker's timings
    around it. None: not measured this step (off-policy passes skipped, memory on CPU)."""

    ppo: list[PPOStats | None]  # one per adapter (a run's one, or each of a sweep group's; None: it had no rows)
    slept: bool  # the rollout slept during this update (its sleep plan)
    sleep_seconds: float
    update_seconds: float
    old_logp_seconds: float | None = None
    ref_logp_seconds: float | None = None
    max_allocated_gib: float | None = None
    update_peak_gib: float | None = None
    alloc_retries: float | None = None

    def metrics(self, adapter: int = 0) -> dict[str, float]:
        """The logged keys of one adapter's update and the replica's measures, in the order the run logs them."""
        out = self.ppo[adapter].metrics()
        _put(out, keys.MEMORY_MAX_ALLOCATED_GIB.key, self.max_allocated_gib)
        _put(out, keys.MEMORY_UPDATE_PEAK_GIB.key, self.update_peak_gib)
        _put(out, keys.MEMORY_ALLOC_RETRIES.key, self.alloc_retries)
        out[keys.TIMING_SLEEP.key] = self.sleep_seconds
        out[keys.ROLLOUT_SLEEPS.key] = float(self.slept)
        _put(out, keys.TIMING_OLD_LOGP.key, self.old_logp_seconds)
        _put(out, keys.TIMING_REF_LOGP.key, self.ref_logp_seconds)
        out[keys.TIMING_UPDATE.key] = self.update_seconds
        return out


@dataclass
class SyncReport:
    """One sync of one worker (or, merged, of all of them): what was sent (base, then adapter),
    the exact checks, the log-prob probe when it ran, the wake. None: not run this sync."""

    kind: str  # adapter, base, merged, or base+adapter (lorarl.contract.payload.PayloadKind values)
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
    # The log-prob probe (lorarl.sync.probe.ProbeReading), when it was due.
    logprob_diff_max: float | None = None
    logprob_diff_mean: float | None = None
    logprob_ref_diff_mean: float | None = None
    probe_seconds: float | None = None
    wake_seconds: float | None = None  # waking vLLM's weights and cache (only when it sleeps)
    # A changed sleep plan, taking effect at the next update, or the measured reason a sleep is
    # kept (said once): on the console, not logged.
    sleep_plan: str | None = None
    rollout_sleeps: bool | None = None  # with a changed plan: whether vLLM now sleeps during the update

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
            "rollout_sleeps": next((r.rollout_sleeps for r in reports if r.sleep_plan), None),
        }
        if first.logprob_diff_max is not None:
            worst["logprob_diff_max"] = max(r.logprob_diff_max for r in reports)
            worst["logprob_diff_mean"] = max(r.logprob_diff_mean for r in reports)
        return dataclasses.replace(first, **worst)

    def metrics(self) -> dict[str, float | int | str]:
        """The logged `sync/*` keys (and `timing/wake`), in the order the run logs them."""
        out: dict[str, float | int | str] = {}
        for name, m in _SYNC_KEYS:
            _put(out, m.key, getattr(self, name))
        return out


# SyncReport's fields and the keys they are logged as, in the run's order (None values are not logged).
_SYNC_KEYS = (
    ("kind", keys.SYNC_KIND),
    ("num_tensors", keys.SYNC_NUM_TENSORS),
    ("bytes", keys.SYNC_BYTES),
    ("gather_seconds", keys.SYNC_GATHER_SECONDS),
    ("transfer_seconds", keys.SYNC_TRANSFER_SECONDS),
    ("load_seconds", keys.SYNC_LOAD_SECONDS),
    ("seconds", keys.SYNC_SECONDS),
    ("num_adapters", keys.SYNC_NUM_ADAPTERS),
    ("weights_match", keys.SYNC_WEIGHTS_MATCH),
    ("weights_checked", keys.SYNC_WEIGHTS_CHECKED),
    ("weights_check_seconds", keys.SYNC_WEIGHTS_CHECK_SECONDS),
    ("adapter_match", keys.SYNC_ADAPTER_MATCH),
    ("adapter_check_seconds", keys.SYNC_ADAPTER_CHECK_SECONDS),
    ("adapter_meaning", keys.SYNC_ADAPTER_MEANING),
    ("meaning_check_seconds", keys.SYNC_MEANING_CHECK_SECONDS),
    ("logprob_diff_max", keys.SYNC_LOGPROB_DIFF_MAX),
    ("logprob_diff_mean", keys.SYNC_LOGPROB_DIFF_MEAN),
    ("logprob_ref_diff_mean", keys.SYNC_LOGPROB_REF_DIFF_MEAN),
    ("probe_seconds", keys.SYNC_PROBE_SECONDS),
    ("wake_seconds", keys.TIMING_WAKE),
)


def _put(out: dict, key: str, value) -> None:
    if value is not None:
        out[key] = value
