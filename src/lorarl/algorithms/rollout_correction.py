"""Rollout correction: the sampler (pi_rollout, vLLM) and the trainer (pi_trainer) give the sampled
tokens different probabilities (kernels, precision). This module turns the two log-probs into
truncated importance weights, a rejection mask and diagnostics, with verl's semantics and key
names (`algorithm.rollout_correction.*`, metrics under `rollout_corr/`).

log_ratio = log pi_trainer - log pi_rollout per response token, clamped to +-SAFETY_BOUND before
any exp(). Pure torch on [B, T] tensors; everything returned is detached (weights change the
measure, not the objective). The formulas are in docs/algorithms.md.
"""

from __future__ import annotations

import math

import torch

from lorarl.algorithms.losses import masked_mean, masked_sum
from lorarl.config.algorithm import (  # noqa: F401  (the option names and their parser live with the schema)
    IS_CHOICES,
    IS_LEVELS,
    RS_OPTIONS,
    Rejection,
    parse_rejection,
)

SAFETY_BOUND = 20.0  # exp(20) ~ 4.9e8: the largest weight or ratio any statistic may reach


def resolve_is_level(rollout_is: str | None, device: str, bypass_mode: bool, off_policy: bool = False) -> str | None:
    """The importance-weight level a run uses: `auto` is token on CUDA, and on any device when the
    batch may be an adapter version behind (trainer.off_policy_steps > 0: the sampler's policy is
    then not the trainer's even in exact arithmetic); off on CPU on-policy and in bypass mode
    (there the PPO ratio already is pi / pi_rollout). An explicit level or null is kept."""
    if rollout_is != "auto":
        return rollout_is
    on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return "token" if (on_cuda or off_policy) and not bypass_mode else None


def needs_trainer_logp_first(rules: tuple[Rejection, ...], batch_normalize: bool) -> bool:
    """Rejection and batch-normalised weights change what the loss is normalised by (the kept
    tokens, the batch's mean weight), so they must be known before the first micro-batch: they
    need the trainer's log-probs of the whole batch from a pass before the update, as in verl."""
    return bool(rules) or batch_normalize


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x detached, in float32 at least (16-bit log-probs widened, float64 kept)."""
    return x.detach().to(torch.promote_types(x.dtype, torch.float32))


def _log_ratio(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    diff = _wide(trainer_logp) - _wide(rollout_logp)
    return torch.where(keep, diff, diff.new_zeros(()))


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float) -> torch.Tensor:
    """min(w, threshold) on kept tokens, 0 elsewhere. token: w = exp(log_ratio); sequence: w =
    exp(sum of the sequence's log_ratio), the sum clamped (not each token) to +-SAFETY_BOUND."""
    keep = mask.bool()
    if level == "token":
        w = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        seq = masked_sum(log_ratio, keep, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
        w = torch.exp(seq).unsqueeze(-1).expand_as(log_ratio)
    return torch.where(keep, w.clamp(max=threshold), w.new_zeros(()))


def _sequence_stat(values: torch.Tensor, keep: torch.Tensor, how: str) -> torch.Tensor:
    if how == "sum":
        return masked_sum(values, keep, dim=-1)
    if how == "mean":
        return masked_mean(values, keep, dim=-1)
    top = values.masked_fill(~keep, -math.inf).amax(-1)
    return torch.where(keep.any(-1), top, torch.zeros_like(top))


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, rules: tuple[Rejection, ...]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mask with every token (token_*) or whole sequence (seq_*) that breaks a criterion
    dropped; all criteria must pass. Metrics: the fraction of kept tokens each option and all
    together drop, and the fraction of sequences that lost a token."""
    keep = mask.bool()
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}
    combined = keep.clone()
    metrics: dict[str, torch.Tensor] = {}
    for rule in rules:
        parts = rule.option.split("_")
        token_stat = stats[parts[-1]]
        stat = token_stat if parts[0] == "token" else _sequence_stat(token_stat, keep, parts[1]).unsqueeze(-1)
        if rule.lower is not None:
            passed = (stat >= math.log(rule.lower)) & (stat <= math.log(rule.upper))
        else:
            passed = stat <= rule.upper
        passed = passed.expand_as(keep)
        metrics[f"rollout_rs_{rule.option}_masked_fraction"] = masked_mean((~passed).float(), keep)
        combined &= passed
    rows = keep.any(-1)
    metrics["rollout_rs_masked_fraction"] = masked_mean((keep & ~combined).float(), keep)
    metrics["rollout_rs_seq_masked_fraction"] = masked_mean((keep & ~combined).any(-1).float(), rows)
    return combined.to(mask.dtype), metrics


def is_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float) -> dict[str, torch.Tensor]:
    """Statistics of the weights before truncation (verl's rollout_is_*): mean, max, min, the
    fractions above threshold and below 1 / threshold, and, of the weights clamped to that band,
    the std and the effective sample size 1 / mean((w / mean w)^2)."""
    keep = mask.bool()
    lo = 1.0 / threshold
    if level == "token":
        w = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        high, low = masked_mean((w > threshold).float(), keep), masked_mean((w < lo).float(), keep)
        w_max = w.masked_fill(~keep, -math.inf).amax()
        w_min = w.masked_fill(~keep, math.inf).amin()
    else:
        rows = keep.any(-1)
        seq = masked_sum(log_ratio, keep, dim=-1)
        w = torch.exp(seq.clamp(-SAFETY_BOUND, SAFETY_BOUND)).unsqueeze(-1).expand_as(log_ratio)
        high = masked_mean((seq > math.log(threshold)).float(), rows)
        low = masked_mean((seq < math.log(lo)).float(), rows)
        w_max = torch.exp(seq.masked_fill(~rows, -math.inf).amax().clamp(max=SAFETY_BOUND))
        w_min = torch.exp(seq.masked_fill(~rows, math.inf).amin())
    band = w.clamp(lo, threshold)
    band_mean = masked_mean(band, keep)
    var = (masked_mean(band.square(), keep) - band_mean.square()).clamp(min=0.0)
    normalised = band / (band_mean + 1e-8)
    any_kept = keep.any()
    one = torch.ones((), device=w.device)
    return {
        "rollout_is_mean": masked_mean(w, keep),
        "rollout_is_std": var.sqrt(),
        "rollout_is_max": torch.where(any_kept, w_max, one),
        "rollout_is_min": torch.where(any_kept, w_min, one),
        "rollout_is_ratio_fraction_high": high,
        "rollout_is_ratio_fraction_low": low,
        "rollout_is_eff_sample_size": torch.where(any_kept, 1.0 / masked_mean(normalised.square(), keep), one),
    }


def mismatch_metrics(
    trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """verl's off-policy diagnostics over kept tokens: kl = mean(log pi_rollout - log pi_trainer)
    (k1 of KL(rollout || trainer)), k3_kl = mean(r - log r - 1), the per-sequence log-perplexities
    and their difference (rollout minus trainer mean log-prob), and the chi-square divergences
    E[r^2] - 1 per token and E[(prod r)^2] - 1 per sequence, r = pi_trainer / pi_rollout."""
    keep = mask.bool()
    rows = keep.any(-1)
    lr = _log_ratio(trainer_logp, rollout_logp, keep)
    safe = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    trainer_mean = masked_mean(_wide(trainer_logp), keep, dim=-1)
    rollout_mean = masked_mean(_wide(rollout_logp), keep, dim=-1)
    diff = rollout_mean - trainer_mean
    seq = masked_sum(lr, keep, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "kl": masked_mean(-lr, keep),
        "k3_kl": masked_mean(torch.exp(lr) - lr - 1.0, keep),
        "training_log_ppl": masked_mean(-trainer_mean, rows),
        "rollout_log_ppl": masked_mean(-rollout_mean, rows),
        "log_ppl_diff": masked_mean(diff, rows),
        "log_ppl_abs_diff": masked_mean(diff.abs(), rows),
        "chi2_token": masked_mean(torch.exp(2.0 * safe), keep) - 1.0,
        "chi2_seq": masked_mean(torch.exp(2.0 * seq), rows) - 1.0,
    }


def correct(
    trainer_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    level: str | None,
    threshold: float,
    rules: tuple[Rejection, ...] = (),
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """(truncated weights or None, the mask to train on, metrics without the `rollout_corr/`
    prefix). Weights and their statistics use the mask as given (before rejection), as verl
    does; the weight statistics are logged at token level when no weights are applied, so the
    mismatch is visible whatever the mode."""
    keep = mask.bool()
    lr = _log_ratio(trainer_logp, rollout_logp, keep)
    metrics = mismatch_metrics(trainer_logp, rollout_logp, mask)
    metrics.update(is_metrics(lr, mask, level or "token", threshold))
    weights = None if level is None else importance_weights(lr, mask, level, threshold)
    new_mask = mask
    if rules:
        new_mask, rs = rejection_mask(lr, mask, rules)
        metrics.update(rs)
    return weights, new_mask, metrics


def batch_mean_weight(weights: torch.Tensor, mask: torch.Tensor, level: str) -> tuple[float, float]:
    """(sum, count) whose ratio, summed over data-parallel ranks, is the batch's mean weight: over
    tokens (token level) or one weight per sequence (sequence level)."""
    keep = mask.bool()
    if level == "token":
        return float(masked_sum(weights, keep)), float(keep.sum())
    rows = keep.any(-1)
    return float(masked_sum(masked_mean(weights, keep, dim=-1), rows)), float(rows.sum())
