"""The PPO update both engines share, beside the loss it optimises (lorarl.algorithms.losses).

The worker calls `ppo_update` with its engine: mini-batches, micro-batches (fixed rows or a
token budget), the PPO-clip loss with its global normalisation, the rollout correction, the KL
and entropy terms, and the metrics live here once; the engine contributes its forward/backward
and optimizer step. Every function that takes an engine is collective: all ranks call it in the
same order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lorarl import metrics as keys
from lorarl.algorithms import losses
from lorarl.algorithms import rollout_correction as rcorr
from lorarl.config.algorithm import RolloutCorrectionConfig
from lorarl.config.schema import ActorConfig
from lorarl.contract.engine import (
    LOSS_KEY,
    Engine,
    EntropyMode,
    LossFn,
    TrainBatch,
    padded_tokens,
    padding_frac,
    plan_micro_batches,
)
from lorarl.contract.messages import PPOStats, Sampling, reduce_metrics
from lorarl.errors import TrainingError


def is_on_policy(actor: ActorConfig, train_batch_size: int) -> bool:
    """One PPO epoch over one mini-batch: the update's first forward sees exactly the weights
    that sampled, so the old log-probs are that forward's own values, detached (ratio 1 with
    the same gradient), and the separate old-log-prob pass is skipped."""
    return actor.ppo_epochs == 1 and actor.ppo_mini_batch_size == train_batch_size


class Correction:
    """algorithm.rollout_correction resolved for this run: the weight level (auto decided by the
    device), the rejection criteria, and whether they must be computed before the update."""

    def __init__(self, level: str | None, threshold: float, rules: tuple, normalize: bool, bypass: bool):
        self.level, self.threshold, self.rules, self.bypass = level, threshold, rules, bypass
        self.normalize = normalize and level is not None
        self.first = rcorr.needs_trainer_logp_first(rules, self.normalize)

    @classmethod
    def of(cls, rc: RolloutCorrectionConfig, device: str, off_policy: bool = False) -> Correction:
        """`off_policy`: the batch may be sampled by an older adapter (trainer.off_policy_steps > 0)."""
        level = rcorr.resolve_is_level(rc.rollout_is, device, rc.bypass_mode, off_policy)
        rules = rcorr.parse_rejection(rc.rollout_rs, rc.rollout_rs_threshold)
        return cls(level, rc.rollout_is_threshold, rules, rc.rollout_is_batch_normalize, rc.bypass_mode)


def needs_old_logp(
    actor: ActorConfig, train_batch_size: int, correction: Correction, stale_rollout: bool = False
) -> bool:
    """Whether the update needs the trainer's log-probs from a pass of their own: off-policy
    (several epochs or mini-batches, or `stale_rollout`: the batch was sampled by an older
    adapter, so pi_old, the current adapter's log-probs, is neither vLLM's nor the update's
    first forward's; unless bypass mode makes the sampler's log-probs pi_old), or when the
    rollout correction must be known before the loss is normalised (rejection, batch-normalised
    weights)."""
    on_policy = is_on_policy(actor, train_batch_size) and not stale_rollout
    return correction.first or not (on_policy or correction.bypass)


def ppo_update(engine: Engine, batch: TrainBatch, step: int, plans: Sequence[AdapterPlan]) -> list[PPOStats | None]:
    """PPO-clip epochs over shuffled mini-batches, one optimizer step per mini-batch, for every
    adapter the batch trains (`batch.adapter`, the plan's index per row; None: one adapter).

    `batch` is this replica's share; `batch.old_logp` None means on-policy (see is_on_policy).
    Losses are normalised over the whole mini-batch (all micro-batches, all replicas), as the
    gradient of one big batch would be: each micro-batch's sum is divided by the mini-batch's
    count / dp_size, and the gradient average over replicas does the rest. A rollout correction
    that rejects tokens rewrites `response_mask` first (correct_before_update), so the loss, its
    KL and entropy terms are divided by what survives, as in verl.

    Several adapters (a sweep's group, lorarl.engines.adapter_routing): each adapter's rows are
    shuffled by its own seed and cut into its own mini-batches, and mini-batch k of the update is
    every adapter's k-th, side by side; each adapter's loss is divided by its own counts, its
    gradient clipped and stepped by its own optimizer. Their parameters are disjoint and rows never
    interact, so each adapter's update is the one it would get alone. An adapter whose loss or
    gradient is not finite is left as it was and reported (`PPOStats.ended`); alone, that stops
    the run (TrainingError), as it always has. An adapter with no rows in the batch (its job has
    ended) is left alone, its stats None.
    """
    a = plans[0].actor  # the batch shape is shared by every adapter of a run
    mini = a.ppo_mini_batch_size * plans[0].sampling.n // engine.dp_size
    gens = [torch.Generator().manual_seed(p.sampling.seed * 100003 + step) for p in plans]
    entropy_mode: EntropyMode = "grad" if any(p.actor.entropy_coeff != 0.0 for p in plans) else "metric"
    temperature = _temperatures(plans)
    rows_of = adapter_rows(batch, len(plans))
    idle = [i for i, rows in enumerate(rows_of) if len(rows) == 0]  # a group's job that has ended
    sums: list[dict[str, list[float]]] = [{} for _ in plans]
    ended: list[str | None] = [None] * len(plans)
    correction = plans[0].correction  # algorithm.rollout_correction is one per run
    before = correct_before_update(engine, batch, correction, rows_of) if correction.first else [{} for _ in plans]
    for _ in range(a.ppo_epochs):
        order = [rows[torch.randperm(len(rows), generator=gen)] for rows, gen in zip(rows_of, gens, strict=True)]
        for start in range(0, max(len(o) for o in order), mini):
            minibatch = batch.select(torch.cat([o[start : start + mini] for o in order]))
            by_adapter = _adapter_key(minibatch)
            row_sets = [sorted(rows, key=by_adapter) for rows in plan_micro_batches(engine, minibatch, a)]
            loss_fn = _ppo_loss(plans, loss_denominators(engine, minibatch, plans))
            micro = [minibatch.select(rows) for rows in row_sets]
            for metrics in engine.forward_backward(micro, loss_fn, entropy_mode, temperature):
                for (i, k), v in metrics.items():
                    if k != LOSS_KEY:
                        sums[i].setdefault(k, []).append(v)
                    elif not math.isfinite(v) and ended[i] is None:
                        ended[i] = f"step {step}: loss is {v} (pg {metrics[i, keys.ACTOR_PG_LOSS.key]}); stopping"
            if len(plans) == 1 and ended[0] is not None:
                raise TrainingError(ended[0])  # before the optimizer step: the weights stay as they were
            norms = engine.optimizer_step(step, skip=[i for i, why in enumerate(ended) if why is not None] + idle)
            for i, norm in enumerate(norms):
                if i in idle:
                    continue
                if not math.isfinite(norm) and ended[i] is None:
                    ended[i] = f"step {step}: grad norm is {norm}; stopping before the update is applied"
                if len(plans) == 1 and ended[0] is not None:
                    raise TrainingError(ended[0])
                stats = sums[i]
                stats.setdefault(keys.ACTOR_PADDING_FRAC.key, []).append(padding_frac(micro))
                stats.setdefault(keys.ACTOR_GRAD_NORM.key, []).append(norm)
                stats.setdefault(keys.ACTOR_MICRO_BATCHES.key, []).append(len(row_sets))
                # What the update's measured memory peak is scaled from (lorarl.rollout.memory.plan_from_peak).
                stats.setdefault(keys.ACTOR_MICRO_BATCH_TOKENS_MAX.key, []).append(max(padded_tokens(m) for m in micro))
    out: list[PPOStats | None] = []
    for i, (stats, lr) in enumerate(zip(sums, engine.end_step(), strict=True)):
        if i in idle:
            out.append(None)
            continue
        result = reduce_metrics(stats)
        result.update(before[i])
        result[keys.ACTOR_LR.key] = lr
        out.append(PPOStats.of(result, ended=ended[i]))
    return out


@dataclass(frozen=True)
class AdapterPlan:
    """What the update of one adapter reads: its loss settings, how its samples were drawn (the
    temperature its log-probs are taken at, the seed of its mini-batch shuffle) and the run's
    rollout correction."""

    actor: ActorConfig
    sampling: Sampling
    correction: Correction

    @property
    def norm_len(self) -> int:
        """seq-mean-token-sum-norm's constant: actor.loss_scale_factor, default the response length."""
        return self.actor.loss_scale_factor or self.sampling.max_response_length


def adapter_rows(batch: TrainBatch, adapters: int) -> list[torch.Tensor]:
    """Each adapter's row indices in `batch`, in order (all rows when the batch names none)."""
    if batch.adapter is None:
        return [torch.arange(len(batch))] + [torch.zeros(0, dtype=torch.long)] * (adapters - 1)
    return [(batch.adapter == i).nonzero().flatten() for i in range(adapters)]


def _adapter_key(batch: TrainBatch):
    """Sort key of a row: its adapter, so a micro-batch's rows of one adapter are one segment."""
    if batch.adapter is None:
        return lambda row: 0
    of = batch.adapter.tolist()
    return lambda row: of[row]


def _temperatures(plans: Sequence[AdapterPlan]) -> float | tuple[float, ...]:
    """The temperature log-probs are taken at: one value, or one per adapter where they differ."""
    values = tuple(p.sampling.temperature for p in plans)
    return values[0] if len(set(values)) == 1 else values


def loss_denominators(engine: Engine, minibatch: TrainBatch, plans: Sequence[AdapterPlan]) -> list[float]:
    """What each adapter's micro-batch loss sums are divided by (see losses.agg_loss): its kept
    tokens or sequences in the mini-batch over all replicas / dp_size; for seq-mean-token-sum-norm
    the constant `norm_len` / dp_size, so the mini-batch's loss is its sum over sequences and tokens
    / the constant whatever the number of replicas (verl's engine also divides that by dp_size; the
    same at one replica). One all-reduce for every adapter that counts."""
    rows = adapter_rows(minibatch, len(plans))
    counted = [i for i, p in enumerate(plans) if p.actor.loss_agg_mode != "seq-mean-token-sum-norm"]
    counts = [
        losses.agg_count(minibatch.response_mask[rows[i]] if len(plans) > 1 else minibatch.response_mask,
                         plans[i].actor.loss_agg_mode)
        for i in counted
    ]  # fmt: skip
    totals = dict(zip(counted, engine.dp_all_reduce(counts) if counted else [], strict=True))
    return [
        max(totals[i], 1.0) / engine.dp_size if i in totals else float(p.norm_len) / engine.dp_size
        for i, p in enumerate(plans)
    ]


def correct_before_update(
    engine: Engine, batch: TrainBatch, c: Correction, rows_of: list[torch.Tensor]
) -> list[dict[str, float]]:
    """Rejection and batch-normalised weights on this replica's whole batch, from the trainer's
    log-probs of the pass before the update: rewrites batch.response_mask (so every denominator
    counts what survives) and sets batch.is_weights; per adapter over its own rows (its batch mean,
    its metrics). Collective (each adapter's batch mean weight)."""
    if batch.old_logp is None or batch.rollout_logp is None:
        raise TrainingError("rollout correction with rejection or batch-normalised weights needs the trainer's and the sampler's log-probs before the update")  # fmt: skip
    if len(rows_of) == 1:
        batch.response_mask, batch.is_weights, metrics = _correct(engine, batch, c)
        return [metrics]
    mask, weights, out = batch.response_mask.clone(), None, []
    for rows in rows_of:
        part_mask, part_weights, metrics = _correct(engine, batch.select(rows), c)
        mask[rows] = part_mask
        if part_weights is not None:
            weights = torch.ones_like(batch.old_logp) if weights is None else weights
            weights[rows] = part_weights
        out.append(metrics)
    batch.response_mask, batch.is_weights = mask, weights
    return out


def _correct(engine: Engine, batch: TrainBatch, c: Correction) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """(the mask to train on, the weights or None, the logged measures) of one adapter's rows."""
    weights, mask, metrics = rcorr.correct(
        batch.old_logp, batch.rollout_logp, batch.response_mask, c.level, c.threshold, c.rules
    )
    out = {keys.rollout_corr_key(k): float(v) for k, v in metrics.items()}
    if weights is not None and c.normalize:
        total, count = engine.dp_all_reduce(list(rcorr.batch_mean_weight(weights, batch.response_mask, c.level)))
        mean = total / max(count, 1.0)
        if mean > 1e-8:
            weights = weights / mean
        out[keys.ROLLOUT_CORR_ROLLOUT_IS_BATCH_NORM_FACTOR.key] = mean if mean > 1e-8 else 1.0
    return mask, weights, out


def clip_range(actor: ActorConfig) -> tuple[float, float]:
    """The ratio's clip range below and above 1: as in verl, actor.clip_ratio on a side whose own
    key (clip_ratio_low, clip_ratio_high) is null."""
    low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    return low, actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high


def _ppo_loss(plans: Sequence[AdapterPlan], denoms: list[float]) -> LossFn:
    """The micro-batch's PPO-clip loss: each adapter's on its own rows (one contiguous segment per
    adapter, TrainBatch.segments) with its own settings and normaliser, summed; metrics keyed
    (adapter, key). Rows of other adapters never enter an adapter's loss, so its gradient is its
    own loss's."""

    def loss_fn(mb: TrainBatch, logp: torch.Tensor, entropy: torch.Tensor | None):
        total, metrics = None, {}
        segments = mb.segments()
        for i, rows in segments:
            part, lp, ent = mb, logp, entropy
            if len(segments) > 1:
                part, lp, ent = mb.select(rows), logp[rows], None if entropy is None else entropy[rows]
            a, c, denom, norm_len = plans[i].actor, plans[i].correction, denoms[i], plans[i].norm_len
            mask = part.response_mask
            # The trainer's log-probs of the sampled tokens at the sampling weights: this forward's
            # own, detached, on the on-policy path (so token TIS costs no extra pass).
            trainer = lp.detach() if part.old_logp is None else part.old_logp
            old = part.rollout_logp if c.bypass else trainer
            weights = part.is_weights
            if part.rollout_logp is not None and not c.first:
                # Measured every step, applied when algorithm.rollout_correction.rollout_is asks.
                weights, _, corr = rcorr.correct(trainer, part.rollout_logp, mask, c.level, c.threshold)
                metrics.update({(i, keys.rollout_corr_key(k)): v for k, v in corr.items()})
            clip_low, clip_high = clip_range(a)
            loss, pg_metrics = losses.policy_loss(
                lp,
                old,
                part.advantages,
                mask,
                clip_ratio_low=clip_low,
                clip_ratio_high=clip_high,
                clip_ratio_c=a.clip_ratio_c,
                loss_agg_mode=a.loss_agg_mode,
                denom=denom,
                norm_len=norm_len,
                mode=a.policy_loss,
                weights=None if c.bypass else weights,
            )
            metrics.update({(i, keys.actor_key(k)): v for k, v in pg_metrics.items()})
            if ent is not None:
                if a.entropy_coeff != 0.0:
                    loss = loss - a.entropy_coeff * losses.agg_loss(ent, mask, a.loss_agg_mode, denom, norm_len)
                metrics[i, keys.ACTOR_ENTROPY.key] = losses.masked_mean(ent.detach(), mask)
            if a.use_kl_loss:
                kl = losses.kl_penalty(lp, part.ref_logp, a.kl_loss_type)
                loss = loss + a.kl_loss_coef * losses.agg_loss(kl, mask, a.loss_agg_mode, denom, norm_len)
                metrics[i, keys.ACTOR_KL_LOSS.key] = losses.masked_mean(kl.detach(), mask)
            metrics[i, LOSS_KEY] = loss.detach()
            total = loss if total is None else total + loss
        return total, metrics

    return loss_fn
