"""The PPO update both engines share, beside the loss it optimises (lorarl.algorithms.losses).

The worker calls `ppo_update` with its engine: mini-batches, micro-batches (fixed rows or a
token budget), the PPO-clip loss with its global normalisation, the rollout correction, the KL
and entropy terms, and the metrics live here once; the engine contributes its forward/backward
and optimizer step. Every function that takes an engine is collective: all ranks call it in the
same order.
"""

from __future__ import annotations

import math

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


def ppo_update(
    engine: Engine,
    batch: TrainBatch,
    step: int,
    sampling: Sampling,
    actor: ActorConfig,
    correction: Correction,
) -> PPOStats:
    """PPO-clip epochs over shuffled mini-batches, one optimizer step per mini-batch.

    `batch` is this replica's share; `batch.old_logp` None means on-policy (see is_on_policy).
    Losses are normalised over the whole mini-batch (all micro-batches, all replicas), as the
    gradient of one big batch would be: each micro-batch's sum is divided by the mini-batch's
    count / dp_size, and the gradient average over replicas does the rest. A rollout correction
    that rejects tokens rewrites `response_mask` first (correct_before_update), so the loss, its
    KL and entropy terms are divided by what survives, as in verl.
    """
    a = actor
    mini = a.ppo_mini_batch_size * sampling.n // engine.dp_size
    gen = torch.Generator().manual_seed(sampling.seed * 100003 + step)
    entropy_mode: EntropyMode = "grad" if a.entropy_coeff != 0.0 else "metric"
    norm_len = a.loss_scale_factor or sampling.max_response_length
    sums: dict[str, list[float]] = {}
    before = correct_before_update(engine, batch, correction) if correction.first else {}
    for _ in range(a.ppo_epochs):
        shuffled = batch.select(torch.randperm(len(batch), generator=gen))
        for start in range(0, len(batch), mini):
            minibatch = shuffled.select(slice(start, start + mini))
            row_sets = plan_micro_batches(engine, minibatch, a)
            denom = loss_denominator(engine, minibatch, a, norm_len)
            loss_fn = _ppo_loss(a, denom, correction, norm_len)
            micro = [minibatch.select(rows) for rows in row_sets]
            for metrics in engine.forward_backward(micro, loss_fn, entropy_mode, sampling.temperature):
                loss = metrics.pop(LOSS_KEY)
                if not math.isfinite(loss):
                    # Before the optimizer step: the weights stay as they were.
                    raise TrainingError(f"step {step}: loss is {loss} (pg {metrics[keys.ACTOR_PG_LOSS.key]}); stopping")
                for k, v in metrics.items():
                    sums.setdefault(k, []).append(v)
            sums.setdefault(keys.ACTOR_PADDING_FRAC.key, []).append(padding_frac(micro))
            sums.setdefault(keys.ACTOR_GRAD_NORM.key, []).append(engine.optimizer_step(step))
            sums.setdefault(keys.ACTOR_MICRO_BATCHES.key, []).append(len(row_sets))
            # What the update's measured memory peak is scaled from (lorarl.rollout.memory.plan_from_peak).
            sums.setdefault(keys.ACTOR_MICRO_BATCH_TOKENS_MAX.key, []).append(max(padded_tokens(m) for m in micro))
    result = reduce_metrics(sums)
    result.update(before)
    result[keys.ACTOR_LR.key] = engine.end_step()
    return PPOStats.of(result)


def loss_denominator(engine: Engine, minibatch: TrainBatch, actor: ActorConfig, norm_len: int) -> float:
    """What each micro-batch's loss sum is divided by (see losses.agg_loss): the mini-batch's
    kept tokens or sequences over all replicas / dp_size; for seq-mean-token-sum-norm the
    constant `norm_len` (actor.loss_scale_factor, default data.max_response_length) / dp_size, so
    the mini-batch's loss is its sum over sequences and tokens / the constant whatever the number
    of replicas (verl's engine also divides that by dp_size; the same at one replica)."""
    if actor.loss_agg_mode == "seq-mean-token-sum-norm":
        return float(norm_len) / engine.dp_size
    count = losses.agg_count(minibatch.response_mask, actor.loss_agg_mode)
    return max(engine.dp_all_reduce([count])[0], 1.0) / engine.dp_size


def correct_before_update(engine: Engine, batch: TrainBatch, c: Correction) -> dict[str, float]:
    """Rejection and batch-normalised weights on this replica's whole batch, from the trainer's
    log-probs of the pass before the update: rewrites batch.response_mask (so every denominator
    counts what survives) and sets batch.is_weights. Collective (the batch mean weight)."""
    if batch.old_logp is None or batch.rollout_logp is None:
        raise TrainingError("rollout correction with rejection or batch-normalised weights needs the trainer's and the sampler's log-probs before the update")  # fmt: skip
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
    batch.response_mask, batch.is_weights = mask, weights
    return out


def clip_range(actor: ActorConfig) -> tuple[float, float]:
    """The ratio's clip range below and above 1: as in verl, actor.clip_ratio on a side whose own
    key (clip_ratio_low, clip_ratio_high) is null."""
    low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    return low, actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high


def _ppo_loss(a: ActorConfig, denom: float, c: Correction, norm_len: int) -> LossFn:
    clip_low, clip_high = clip_range(a)

    def loss_fn(mb: TrainBatch, logp: torch.Tensor, entropy: torch.Tensor | None):
        mask = mb.response_mask
        # The trainer's log-probs of the sampled tokens at the sampling weights: this forward's
        # own, detached, on the on-policy path (so token TIS costs no extra pass).
        trainer = logp.detach() if mb.old_logp is None else mb.old_logp
        old = mb.rollout_logp if c.bypass else trainer
        metrics: dict[str, float] = {}
        weights = mb.is_weights
        if mb.rollout_logp is not None and not c.first:
            # Measured every step, applied when algorithm.rollout_correction.rollout_is asks.
            weights, _, corr = rcorr.correct(trainer, mb.rollout_logp, mask, c.level, c.threshold)
            metrics.update({keys.rollout_corr_key(k): v for k, v in corr.items()})
        pg_loss, pg_metrics = losses.policy_loss(
            logp,
            old,
            mb.advantages,
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
        loss = pg_loss
        metrics.update({keys.actor_key(k): v for k, v in pg_metrics.items()})
        if entropy is not None:
            if a.entropy_coeff != 0.0:
                loss = loss - a.entropy_coeff * losses.agg_loss(entropy, mask, a.loss_agg_mode, denom, norm_len)
            metrics[keys.ACTOR_ENTROPY.key] = losses.masked_mean(entropy.detach(), mask)
        if a.use_kl_loss:
            kl = losses.kl_penalty(logp, mb.ref_logp, a.kl_loss_type)
            loss = loss + a.kl_loss_coef * losses.agg_loss(kl, mask, a.loss_agg_mode, denom, norm_len)
            metrics[keys.ACTOR_KL_LOSS.key] = losses.masked_mean(kl.detach(), mask)
        metrics[LOSS_KEY] = loss.detach()
        return loss, metrics

    return loss_fn
