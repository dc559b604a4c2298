"""The loss side of GRPO: token log-probs and entropy, KL estimators, loss aggregation, PPO-clip.

Pure torch on plain tensors so every piece is testable with hand-computed numbers and
shared by the FSDP and Megatron engines. Shapes: B sequences, T response tokens, V vocab.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

# The names the config accepts (checked there, once, with the key's name); a name outside them
# reaching these functions is a caller's bug, a ValueError.
from lorarl.config.schema import AGG_MODES, KL_KINDS, POLICY_LOSSES

# exp() of a log-ratio above ~88 overflows float32 to inf, and inf in the forward pass
# turns into NaN gradients even where a later clamp hides the value.
_MAX_LOG_RATIO = 20.0
# GSPO's sequence log-ratio is capped above at 10 (no gradient past it), as verl does; below, exp()
# only underflows to 0.
_GSPO_MAX_LOG_RATIO = 10.0


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    # where() instead of x * mask so NaN/Inf in masked-out positions cannot leak in.
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over positions where mask is true; 0 where nothing is kept (not NaN)."""
    total = masked_sum(x, mask, dim)
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return total / count.clamp(min=1).to(total.dtype)


def _blocks(batch: int, width: int, chunk_tokens: int):
    """(row slice, column slice) blocks of a [batch, width] grid, each at most ~chunk_tokens."""
    cols = max(1, min(width, chunk_tokens))
    rows = max(1, chunk_tokens // cols)
    for i in range(0, batch, rows):
        for j in range(0, width, cols):
            yield slice(i, i + rows), slice(j, j + cols)


def _scaled_float(block: torch.Tensor, temperature: float) -> torch.Tensor:
    """block / temperature in float32, for out-of-place use only (a float32 block at T=1 comes
    back as itself)."""
    x = block.float()
    if temperature == 1.0:
        return x
    return x / temperature if block.dtype == torch.float32 else x.div_(temperature)


class _TokenLogProbs(torch.autograd.Function):
    """log softmax(logits / T)[label] per position, with the entropy as a no-gradient extra.

    Every [tokens, V] pass is memory traffic over the 152k-wide vocabulary. Through autograd the
    same math (float cast, divide, logsumexp, gather, each chunk's slice gradient summed into the
    whole logits' gradient) took more GPU time than every matmul of the 0.5B update together
    (bench/results/update_profile_2026-12-01). Here a block is read once in float32 for
    log_softmax (and the entropy from the same values); the backward recomputes the block's
    softmax and writes its gradient, g / T * (onehot(label) - softmax), straight into one buffer.
    Positions past labels.shape[1] (the model's prediction after the last token) get gradient 0,
    so callers pass the model's logits without slicing a copy of them.
    """

    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_tokens, with_entropy):
        batch, width = labels.shape
        logp = torch.empty(batch, width, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        scored = logits[:, :width]  # a view: the positions labels score
        for rows, cols in _blocks(batch, width, chunk_tokens):
            lsm = _scaled_float(scored[rows, cols], temperature).log_softmax(-1)
            logp[rows, cols] = lsm.gather(-1, labels[rows, cols].unsqueeze(-1)).squeeze(-1)
            if with_entropy:
                entropy[rows, cols] = lsm.exp().mul_(lsm).sum(-1).neg_()
        ctx.save_for_backward(logits, labels)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        logits, labels = ctx.saved_tensors
        if grad_logp is None:
            return None, None, None, None, None
        batch, width = labels.shape
        grad = torch.empty_like(logits)
        grad[:, width:].zero_()
        scored, scored_grad = logits[:, :width], grad[:, :width]
        for rows, cols in _blocks(batch, width, ctx.chunk_tokens):
            g = (grad_logp[rows, cols] / ctx.temperature).unsqueeze(-1)
            probs = _scaled_float(scored[rows, cols], ctx.temperature).softmax(-1)
            probs.mul_(-g).scatter_add_(-1, labels[rows, cols].unsqueeze(-1), g)
            scored_grad[rows, cols] = probs
        return grad, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(label), entropy or None) per position, both float32, of softmax(logits / T).

    logits [B, T', V] with T' >= T, labels [B, T]: position t of labels is scored by logits[:, t];
    positions past T are ignored. log p is differentiable; the entropy carries no gradient (a
    metric). Float32 copies exist only for blocks of ~chunk_tokens positions (two at a time).
    """
    if (
        logits.dim() != 3
        or labels.dim() != 2
        or logits.shape[0] != labels.shape[0]
        or logits.shape[1] < labels.shape[1]
    ):
        raise ValueError(f"token_logprobs wants logits [B, T', V] and labels [B, T<=T'], got "
                         f"{tuple(logits.shape)} and {tuple(labels.shape)}")  # fmt: skip
    logp, entropy = _TokenLogProbs.apply(logits, labels, float(temperature), chunk_tokens, with_entropy)
    return logp, (entropy if with_entropy else None)


def _chunk_entropy(rows: torch.Tensor, temperature: float) -> torch.Tensor:
    rows = rows.float() / temperature
    return torch.logsumexp(rows, dim=-1) - (torch.softmax(rows, dim=-1) * rows).sum(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, chunk_rows: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position, float32: logsumexp(l) - sum(p * l).

    Differentiable (chunks recomputed in backward) when `logits` require grad and grad mode is
    on; call it under torch.no_grad() for a metric that costs no memory in the graph.
    """
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    grad = torch.is_grad_enabled() and logits.requires_grad
    out = []
    for start in range(0, flat.shape[0], chunk_rows):
        rows = flat[start : start + chunk_rows]
        out.append(
            checkpoint(_chunk_entropy, rows, temperature, use_reentrant=False)
            if grad
            else _chunk_entropy(rows, temperature)
        )
    if not out:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(out).reshape(logits.shape[:-1])


def logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, entropy: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What an engine's forward hands the loss: log p(label) [B, T] from logits [B, T' >= T, V]
    (position t scores labels[:, t]; later positions are ignored), and the entropy [B, T] as
    `entropy` asks (lorarl.contract.engine.EntropyMode): "metric" from the same float32 blocks, no
    graph; "grad" differentiable, part of the loss; "none" None."""
    logp, ent = token_logprobs(logits, labels, temperature, with_entropy=entropy == "metric")
    if entropy == "grad":
        ent = entropy_from_logits(logits[:, : labels.shape[1]], temperature)
    return logp, ent


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from log-probs of sampled tokens."""
    if kind == "k1":
        return logp - ref_logp
    if kind in ("k2", "mse"):
        return 0.5 * (logp - ref_logp).square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = (ref_logp - logp).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10.0, 10.0)
    raise ValueError(f"KL estimator {kind!r} is not one of {', '.join(KL_KINDS)}")


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    denom: float | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar over the tokens mask keeps.

    Without `denom` the reduction is over this tensor alone. With it, the sum over kept tokens
    (token-mean, seq-mean-token-sum-norm) or over per-sequence values (the other seq-* modes) is
    divided by `denom`: the caller passes the whole mini-batch's count (every micro-batch, every
    data-parallel rank) divided by the data-parallel size, so that micro-batches of any size add
    up, after the gradient average over ranks, to the value of the mini-batch as one. Sequence
    modes count only sequences with a kept token, so fully-masked rows dilute nothing.
    seq-mean-token-sum-norm (Dr. GRPO) is the sum over sequences and tokens divided by one
    constant (`norm_len`, verl's loss_scale_factor; default T): no mean over sequences.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"loss aggregation {mode!r} is not one of {', '.join(AGG_MODES)}")
    if mode == "token-mean":
        return masked_mean(loss_mat, mask) if denom is None else masked_sum(loss_mat, mask) / denom
    if mode == "seq-mean-token-sum-norm":
        return masked_sum(loss_mat, mask) / (float(norm_len or loss_mat.shape[-1]) if denom is None else denom)
    if mode == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, mask, dim=-1)
    else:
        per_seq = masked_sum(loss_mat, mask, dim=-1)
    has_tokens = mask.bool().any(dim=-1)
    return masked_mean(per_seq, has_tokens) if denom is None else masked_sum(per_seq, has_tokens) / denom


def agg_count(mask: torch.Tensor, mode: str) -> int:
    """What agg_loss divides by for `mode`: kept tokens, or sequences with a kept token (not
    used by seq-mean-token-sum-norm, whose divisor is a constant)."""
    return int(mask.bool().sum()) if mode == "token-mean" else int(mask.bool().any(dim=-1).sum())


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    denom: float | None = None,
    norm_len: int | None = None,
    mode: str = "vanilla",
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip surrogate loss (optionally dual-clip) and its diagnostics.

    advantages may be per sequence [B] (GRPO outcome reward) or per token [B, T].
    mode "vanilla": the per-token ratio pi/pi_old, its log clamped to +-20. mode "gspo": one ratio
    per sequence, the length-normalised exp(mean_t log(pi/pi_old)), clipped as a whole; each token
    carries it with its own gradient (sg[s] * pi_t / sg[pi_t]), as GSPO-token defines it; its log
    is capped at 10 from above (no gradient past the cap), and it takes no dual clip and only
    seq-mean-token-mean (lorarl.config.schema.ActorConfig checks it), as in verl.
    `weights` [B, T] (detached; e.g. rollout-mismatch importance weights) multiply the per-token loss.
    Metrics: pg_clipfrac (tokens where the clipped term is active), ppo_kl (k1 estimate
    of KL(old || new), from the clamped log-ratio for vanilla as verl averages it), pg_clipfrac_lower (negative-advantage tokens capped by the dual clip),
    as detached 0-dim tensors: reading one waits for the device, so the update reads them once
    per mini-batch rather than stalling every micro-batch.
    """
    if mode not in POLICY_LOSSES:
        raise ValueError(f"policy loss {mode!r} is not one of {', '.join(POLICY_LOSSES)}")
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    adv = adv.to(logp.dtype)
    token_log_ratio = logp - old_logp
    if mode == "gspo":
        seq_log_ratio = masked_mean(token_log_ratio.detach(), mask, dim=-1).unsqueeze(-1)
        log_ratio = (logp - logp.detach() + seq_log_ratio).clamp(max=_GSPO_MAX_LOG_RATIO)
        ppo_kl = masked_mean(-token_log_ratio.detach(), mask)
    else:
        log_ratio = token_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        ppo_kl = masked_mean(-log_ratio.detach(), mask)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    clipfrac_lower = torch.zeros((), device=logp.device)
    if clip_ratio_c is not None:
        cap = -adv * clip_ratio_c
        negative = (adv < 0).expand_as(loss_mat)
        capped = negative & (loss_mat > cap)
        clipfrac_lower = masked_mean(capped.float(), mask)
        loss_mat = torch.where(negative, torch.minimum(loss_mat, cap), loss_mat)
    if weights is not None:
        loss_mat = loss_mat * weights
    loss = agg_loss(loss_mat, mask, loss_agg_mode, denom, norm_len)
    metrics = {
        # This micro-batch's own mean, comparable across micro-batch sizes (the loss is not).
        "pg_loss": agg_loss(loss_mat.detach(), mask, loss_agg_mode, None, norm_len),
        "pg_clipfrac": clipfrac,
        "ppo_kl": ppo_kl,
        "pg_clipfrac_lower": clipfrac_lower,
    }
    return loss, metrics
