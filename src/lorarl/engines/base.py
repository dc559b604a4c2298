"""The contract both training engines implement, and the one PPO update they share.

An engine owns a sharded (FSDP2) or model-parallel (Megatron) policy with LoRA: it runs
forward passes, applies optimizer steps and exports weights. Everything about what a step
computes lives here once: mini-batches, micro-batches (fixed rows or a token budget), the
PPO-clip loss with its global normalisation, the KL and entropy terms, and the metrics.
An engine contributes only how to run its forward/backward over a list of micro-batches.

Every method of an engine is collective: all ranks of the job call it in the same order,
each with its own data-parallel share (ranks of one tensor/pipeline group pass the same).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, Protocol, runtime_checkable

import torch

from lorarl import algorithms
from lorarl.batch import TrainBatch, micro_batches, padded_tokens, padding_frac, split_to
from lorarl.config import RunConfig
from lorarl.errors import TrainingError
from lorarl.sync import PayloadKind, WeightPayload

# loss_fn(micro_batch, log_probs, entropy) -> (loss to backpropagate, metrics). The engine
# passes the micro-batch as it ran it (on its device, possibly trimmed), so `log_probs`
# [b, T] lines up with `micro_batch.response_mask`. Metrics are detached 0-dim tensors on the
# device: an engine reads them (`read_metrics`) after its last micro-batch, so the host never
# waits for the device between micro-batches and keeps queueing the next one's kernels.
LossFn = Callable[[TrainBatch, torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, dict[str, torch.Tensor]]]
# The micro-batch's loss, among its metrics: checked for NaN/inf once the values are read.
LOSS_KEY = "loss"
# grad: entropy is part of the loss; metric: computed without autograd; none: not computed.
EntropyMode = Literal["grad", "metric", "none"]


@runtime_checkable
class Engine(Protocol):
    dp_rank: int  # which data-parallel replica this rank belongs to
    dp_size: int  # how many replicas split the data
    pad_token_id: int
    compute_dtype: torch.dtype  # dtype of the forward's matmuls (what the parity probe's bound reads)
    left_pad_prompts: bool  # the batch layout it wants (lorarl.batch.build_batch)

    def log_probs(
        self, batch: TrainBatch, *, reference: bool = False, temperature: float | None = None
    ) -> torch.Tensor:
        """[B, L-1] float32 on CPU: log p(token t+1) at the rollout temperature (or `temperature`);
        `reference=True` with the adapter disabled."""

    def forward_backward(
        self, micro: list[TrainBatch], loss_fn: LossFn, entropy: EntropyMode
    ) -> list[dict[str, float]]:
        """Forward, loss_fn, backward for each micro-batch, gradients accumulated; their
        metrics, read after the last micro-batch (`read_metrics`)."""

    def optimizer_step(self, step: int) -> float:
        """Clip, step, zero the gradients; the grad norm. A non-finite norm raises TrainingError
        and leaves the weights as they were."""

    def end_step(self) -> float:
        """Advance the learning-rate schedule by one trainer step; the learning rate used."""

    def dp_all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Sum or max of `values` over data-parallel replicas."""

    def export(self, kind: PayloadKind, method: str) -> tuple[WeightPayload, float]:
        """The payload of `kind` and the seconds spent gathering it; every rank gets it whole."""

    def adapter_config(self) -> dict: ...

    def lora_state(self) -> dict[str, torch.Tensor]:
        """Full LoRA tensors under PEFT names, on CPU."""

    def load_state(self, lora: dict[str, torch.Tensor], optimizer: dict | None, scheduler: dict | None) -> None: ...

    def optimizer_state(self) -> dict: ...

    def scheduler_state(self) -> dict: ...


def is_on_policy(run: RunConfig) -> bool:
    """One PPO epoch over one mini-batch: the update's first forward sees exactly the weights
    that sampled, so the old log-probs are that forward's own values, detached (ratio 1 with
    the same gradient), and the separate old-log-prob pass is skipped."""
    return run.actor.ppo_epochs == 1 and run.actor.ppo_mini_batch_size == run.data.train_batch_size


def log_prob_token_budget(run: RunConfig) -> int:
    """Padded tokens per forward of a pass without backward: nothing is kept for autograd, so
    it holds a layer's transient activations and the logits, not every layer's activations. At
    twice the update's budget its peak stays under what lorarl.memory counts for the update
    (bf16 logits of 2x the tokens against the update's 3 logit-sized buffers, one layer's
    activations against all of them), so the sleep decision holds for it too. On one H200 the
    7B step's reference pass took 0.99 s at 8192 tokens, 1.33 s at 4096 a release before."""
    a = run.actor
    return a.log_prob_max_token_len_per_gpu or 2 * a.ppo_max_token_len_per_gpu


def plan_micro_batches(engine: Engine, batch: TrainBatch, run: RunConfig, *, backward: bool = True) -> list[list[int]]:
    """Row indices per micro-batch: `ppo_micro_batch_size_per_gpu` rows, or with
    `use_dynamic_bsz` a budget of `ppo_max_token_len_per_gpu` padded tokens
    (`log_prob_token_budget` for a pass with no backward). Collective: every data-parallel rank
    gets the same number of micro-batches (FSDP gathers weights per forward)."""
    a = run.actor
    lengths = batch.lengths.tolist()
    if not a.use_dynamic_bsz:
        return micro_batches(lengths, rows=a.ppo_micro_batch_size_per_gpu)
    budget = a.ppo_max_token_len_per_gpu if backward else log_prob_token_budget(run)
    groups = micro_batches(lengths, token_budget=budget)
    count = int(engine.dp_all_reduce([len(groups)], op="max")[0])
    return split_to(groups, count, lengths)


def ppo_update(engine: Engine, batch: TrainBatch, step: int, run: RunConfig) -> dict[str, float]:
    """PPO-clip epochs over shuffled mini-batches, one optimizer step per mini-batch.

    `batch` is this replica's share; `batch.old_logp` None means on-policy (see is_on_policy).
    Losses are normalised over the whole mini-batch (all micro-batches, all replicas), as the
    gradient of one big batch would be: each micro-batch's sum is divided by the mini-batch's
    count / dp_size, and the gradient average over replicas does the rest.
    """
    a = run.actor
    mini = a.ppo_mini_batch_size * run.rollout.n // engine.dp_size
    gen = torch.Generator().manual_seed(run.trainer.seed * 100003 + step)
    entropy_mode: EntropyMode = "grad" if a.entropy_coeff != 0.0 else "metric"
    sums: dict[str, list[float]] = {}
    for _ in range(a.ppo_epochs):
        shuffled = batch.select(torch.randperm(len(batch), generator=gen))
        for start in range(0, len(batch), mini):
            minibatch = shuffled.select(slice(start, start + mini))
            groups = plan_micro_batches(engine, minibatch, run)
            count = algorithms.agg_count(minibatch.response_mask, a.loss_agg_mode)
            denom = max(engine.dp_all_reduce([count])[0], 1.0) / engine.dp_size
            loss_fn = _ppo_loss(run, denom, step)
            micro = [minibatch.select(g) for g in groups]
            for metrics in engine.forward_backward(micro, loss_fn, entropy_mode):
                loss = metrics.pop(LOSS_KEY)
                if not math.isfinite(loss):
                    # Before the optimizer step: the weights stay as they were.
                    raise TrainingError(f"step {step}: loss is {loss} (pg {metrics['actor/pg_loss']}); stopping")
                for k, v in metrics.items():
                    sums.setdefault(k, []).append(v)
            sums.setdefault("actor/padding_frac", []).append(padding_frac(micro))
            sums.setdefault("actor/grad_norm", []).append(engine.optimizer_step(step))
            sums.setdefault("actor/micro_batches", []).append(len(groups))
            # What the update's measured memory peak is scaled from (lorarl.memory.plan_from_peak).
            sums.setdefault("actor/micro_batch_tokens_max", []).append(max(padded_tokens(m) for m in micro))
    result = reduce_metrics(sums)
    result["actor/lr"] = engine.end_step()
    return result


def _ppo_loss(run: RunConfig, denom: float, step: int) -> LossFn:
    a = run.actor

    rc = run.algorithm.rollout_correction
    norm_len = run.data.max_response_length

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


def read_metrics(per_micro: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """The micro-batches' metric tensors as floats, after the last micro-batch is queued: the
    first read waits for the device to finish, the rest are already there."""
    return [{k: float(v) for k, v in m.items()} for m in per_micro]


def reduce_metrics(values: dict[str, list[float]]) -> dict[str, float]:
    """One number per metric over micro-batches (or workers): the largest for `*_max` keys,
    else the mean."""
    return {k: max(v) if k.endswith("_max") else sum(v) / len(v) for k, v in values.items()}


def check_grad_norm(grad_norm: float, step: int) -> float:
    if not math.isfinite(grad_norm):
        raise TrainingError(f"step {step}: grad norm is {grad_norm}; stopping before the update is applied")
    return grad_norm
