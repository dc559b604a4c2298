"""The PPO update both engines share, beside the loss it optimises (lorarl.algorithms).

The worker calls `ppo_update` with its engine: mini-batches, micro-batches (fixed rows or a
token budget), the PPO-clip loss with its global normalisation, the KL and entropy terms, and
the metrics live here once; the engine contributes its forward/backward and optimizer step.
Every function that takes an engine is collective: all ranks call it in the same order.
"""

from __future__ import annotations

import math

import torch

from lorarl import algorithms
from lorarl.batch import TrainBatch, padded_tokens, padding_frac, plan_micro_batches
from lorarl.engines.base import LOSS_KEY, Engine, EntropyMode, LossFn, reduce_metrics
from lorarl.errors import TrainingError
from lorarl.messages import Sampling
from lorarl.schema import ActorConfig, RolloutCorrectionConfig


def is_on_policy(actor: ActorConfig, train_batch_size: int) -> bool:
    """One PPO epoch over one mini-batch: the update's first forward sees exactly the weights
    that sampled, so the old log-probs are that forward's own values, detached (ratio 1 with
    the same gradient), and the separate old-log-prob pass is skipped."""
    return actor.ppo_epochs == 1 and actor.ppo_mini_batch_size == train_batch_size


def ppo_update(
    engine: Engine,
    batch: TrainBatch,
    step: int,
    sampling: Sampling,
    actor: ActorConfig,
    correction: RolloutCorrectionConfig,
) -> dict[str, float]:
    """PPO-clip epochs over shuffled mini-batches, one optimizer step per mini-batch.

    `batch` is this replica's share; `batch.old_logp` None means on-policy (see is_on_policy).
    Losses are normalised over the whole mini-batch (all micro-batches, all replicas), as the
    gradient of one big batch would be: each micro-batch's sum is divided by the mini-batch's
    count / dp_size, and the gradient average over replicas does the rest.
    """
    a = actor
    mini = a.ppo_mini_batch_size * sampling.n // engine.dp_size
    gen = torch.Generator().manual_seed(sampling.seed * 100003 + step)
    entropy_mode: EntropyMode = "grad" if a.entropy_coeff != 0.0 else "metric"
    sums: dict[str, list[float]] = {}
    for _ in range(a.ppo_epochs):
        shuffled = batch.select(torch.randperm(len(batch), generator=gen))
        for start in range(0, len(batch), mini):
            minibatch = shuffled.select(slice(start, start + mini))
            row_sets = plan_micro_batches(engine, minibatch, a)
            count = algorithms.agg_count(minibatch.response_mask, a.loss_agg_mode)
            denom = max(engine.dp_all_reduce([count])[0], 1.0) / engine.dp_size
            loss_fn = _ppo_loss(a, correction, denom, sampling.max_response_length)
            micro = [minibatch.select(rows) for rows in row_sets]
            for metrics in engine.forward_backward(micro, loss_fn, entropy_mode, sampling.temperature):
                loss = metrics.pop(LOSS_KEY)
                if not math.isfinite(loss):
                    # Before the optimizer step: the weights stay as they were.
                    raise TrainingError(f"step {step}: loss is {loss} (pg {metrics['actor/pg_loss']}); stopping")
                for k, v in metrics.items():
                    sums.setdefault(k, []).append(v)
            sums.setdefault("actor/padding_frac", []).append(padding_frac(micro))
            sums.setdefault("actor/grad_norm", []).append(engine.optimizer_step(step))
            sums.setdefault("actor/micro_batches", []).append(len(row_sets))
            # What the update's measured memory peak is scaled from (lorarl.memory.plan_from_peak).
            sums.setdefault("actor/micro_batch_tokens_max", []).append(max(padded_tokens(m) for m in micro))
    result = reduce_metrics(sums)
    result["actor/lr"] = engine.end_step()
    return result


def _ppo_loss(a: ActorConfig, rc: RolloutCorrectionConfig, denom: float, norm_len: int) -> LossFn:

    def loss_fn(mb: TrainBatch, logp: torch.Tensor, entropy: torch.Tensor | None):
        mask = mb.response_mask
        old = logp.detach() if mb.old_logp is None else mb.old_logp
        metrics: dict[str, float] = {}
        weights = None
        if mb.rollout_logp is not None:
            # The sampler's probabilities differ from the trainer's (kernels, precision): measured
            # every step, corrected when algorithm.rollout_correction.mode asks for it.
            weights, mask, corr = algorithms.rollout_correction(
                old, mb.rollout_logp, mask, rc.mode, rc.threshold, rc.lower
            )
            metrics.update({f"rollout_corr/{k}": v for k, v in corr.items()})
        pg_loss, pg_metrics = algorithms.policy_loss(
            logp,
            old,
            mb.advantages,
            mask,
            clip_ratio_low=a.clip_low,
            clip_ratio_high=a.clip_high,
            clip_ratio_c=a.clip_ratio_c,
            loss_agg_mode=a.loss_agg_mode,
            denom=denom,
            norm_len=norm_len,
            mode=a.policy_loss,
            weights=weights,
        )
        loss = pg_loss
        metrics.update({f"actor/{k}": v for k, v in pg_metrics.items()})
        if entropy is not None:
            if a.entropy_coeff != 0.0:
                loss = loss - a.entropy_coeff * algorithms.agg_loss(entropy, mask, a.loss_agg_mode, denom, norm_len)
            metrics["actor/entropy"] = algorithms.masked_mean(entropy.detach(), mask)
        if a.use_kl_loss:
            kl = algorithms.kl_penalty(logp, mb.ref_logp, a.kl_loss_type)
            loss = loss + a.kl_loss_coef * algorithms.agg_loss(kl, mask, a.loss_agg_mode, denom, norm_len)
            metrics["actor/kl_loss"] = algorithms.masked_mean(kl.detach(), mask)
        metrics[LOSS_KEY] = loss.detach()
        return loss, metrics

    return loss_fn
