"""The one PPO update both engines share (lorarl.ppo), run with a small real torch
policy in place of an engine's forward: loss normalisation over micro-batches, the on-policy
shortcut, token-budget micro-batches and the metrics."""

from __future__ import annotations

import typing

import pytest
import torch

from lorarl.batch import build_batch, micro_batches, padding_frac, plan_micro_batches, split_to
from lorarl.config import compose
from lorarl.engines.base import Engine, EntropyMode, LossFn, read_metrics
from lorarl.ppo import is_on_policy
from lorarl.ppo import ppo_update as run_ppo_update
from lorarl.trainer import sampling_of

VOCAB, HIDDEN = 32, 8


class TablePolicy:
    """A bigram policy, logits = E[token] @ W with W trained: every Engine method the update
    loop calls, on one process (dp_size 1)."""

    dp_rank, dp_size, pad_token_id, compute_dtype, left_pad_prompts = 0, 1, 0, torch.float32, True

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.E = torch.randn(VOCAB, HIDDEN, generator=g)
        self.W = torch.nn.Parameter(torch.randn(HIDDEN, VOCAB, generator=g) * 0.5)
        self.grads: list[torch.Tensor] = []
        self.micro_sizes: list[list[int]] = []

    def logp(self, ids: torch.Tensor) -> torch.Tensor:
        from lorarl.algorithms import logprobs_from_logits

        logits = self.E[ids[:, :-1]] @ self.W
        return logprobs_from_logits(logits, ids[:, 1:])

    def forward_backward(self, micro, loss_fn: LossFn, entropy: EntropyMode, temperature: float):
        self.micro_sizes.append([len(m) for m in micro])
        out = []
        for mb in micro:
            mb = mb.trimmed()
            loss, metrics = loss_fn(mb, self.logp(mb.input_ids), torch.zeros(mb.response_mask.shape))
            loss.backward()
            out.append(metrics)
        return read_metrics(out)

    def optimizer_step(self, step: int) -> float:
        self.grads.append(self.W.grad.clone())
        norm = float(self.W.grad.norm())
        self.W.grad = None
        return norm

    def end_step(self) -> float:
        return 0.5

    def dp_all_reduce(self, values, op="sum"):
        return list(values)


def test_engines_implement_the_protocol():
    from lorarl.engines.fsdp import FSDPEngine
    from lorarl.engines.megatron.engine import MegatronEngine

    # compute_dtype and pad_token_id are set per instance by the Megatron engine.
    members = typing._get_protocol_attrs(Engine) - {"compute_dtype", "pad_token_id"}
    for cls in (FSDPEngine, MegatronEngine):
        assert [m for m in members if not hasattr(cls, m)] == [], cls.__name__


def ppo_update(policy, batch, step: int, run):
    """The update as the worker calls it, with the run's sampling facts and actor settings."""
    return run_ppo_update(policy, batch, step, sampling_of(run), run.actor, run.algorithm.rollout_correction)


def batch_of(lengths: list[int], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (3,), generator=g).tolist() for _ in lengths]
    responses = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]
    adv = torch.randn(len(lengths), generator=g).tolist()
    return build_batch(prompts, responses, 0, adv, left_pad_prompts=True)


def run_with(micro_rows: int | None = None, token_budget: int | None = None, agg="token-mean", **actor):
    overrides = [
        "data.train_batch_size=2",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=2",
        f"actor.loss_agg_mode={agg}",
        "actor.use_kl_loss=false",
    ]
    if token_budget is not None:
        overrides += ["actor.use_dynamic_bsz=true", f"actor.ppo_max_token_len_per_gpu={token_budget}"]
    else:
        overrides += [f"actor.ppo_micro_batch_size_per_gpu={micro_rows}"]
    return compose(["+backend=fsdp", *overrides] + [f"actor.{k}={v}" for k, v in actor.items()])


LENGTHS = [1, 7, 2, 5, 3, 8, 4, 6]  # rows of unequal length: where per-micro-batch means go wrong


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_gradient_does_not_depend_on_micro_batching(agg):
    """Normalised over the whole mini-batch, micro-batches of 1, 2 or 8 rows, or by token
    budget, accumulate the same gradient as one forward over all rows."""
    grads = []
    for kw in ({"micro_rows": 8}, {"micro_rows": 1}, {"micro_rows": 2}, {"token_budget": 24}):
        policy = TablePolicy()
        ppo_update(policy, batch_of(LENGTHS), step=1, run=run_with(agg=agg, **kw))
        grads.append(policy.grads[0])
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0], atol=1e-6, rtol=1e-5)
    assert grads[0].abs().sum() > 0


def test_token_mean_is_the_mean_over_all_tokens():
    """Hand check: on-policy the ratio is 1, so the token-mean loss is -sum(A_i * n_i * logp)/N
    in value and its gradient is that of -(1/N) sum_tokens A * logp."""
    policy = TablePolicy()
    batch = batch_of(LENGTHS)
    ppo_update(policy, batch, step=1, run=run_with(micro_rows=2))
    W = policy.W.detach().clone().requires_grad_(True)
    ref = TablePolicy()
    ref.W = W
    logp = ref.logp(batch.input_ids)
    mask = batch.response_mask
    loss = -(batch.advantages[:, None] * logp * mask).sum() / mask.sum()
    loss.backward()
    torch.testing.assert_close(policy.grads[0], W.grad, atol=1e-6, rtol=1e-5)


def test_on_policy_shortcut_equals_a_separate_old_logprob_pass():
    run = run_with(micro_rows=4)
    assert is_on_policy(run.actor, run.data.train_batch_size)
    shortcut, separate = TablePolicy(), TablePolicy()
    batch = batch_of(LENGTHS)
    ppo_update(shortcut, batch, step=1, run=run)
    with torch.no_grad():
        batch.old_logp = separate.logp(batch.input_ids)
    ppo_update(separate, batch, step=1, run=run)
    torch.testing.assert_close(shortcut.grads[0], separate.grads[0], atol=1e-6, rtol=1e-5)
    off = run_with(micro_rows=4, ppo_epochs=2)
    assert not is_on_policy(off.actor, off.data.train_batch_size)


def test_metrics_and_token_budget_micro_batches():
    policy = TablePolicy()
    metrics = ppo_update(policy, batch_of(LENGTHS), step=3, run=run_with(token_budget=24))
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm"):
        assert key in metrics, key
    assert metrics["actor/lr"] == 0.5
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/ppo_kl"] == 0.0  # ratio 1 on-policy
    # 8 rows of 4-11 real tokens in a budget of 24 padded tokens: several micro-batches, no row dropped.
    assert sum(policy.micro_sizes[0]) == 8 and metrics["actor/micro_batches"] == len(policy.micro_sizes[0]) > 1
    assert 0.0 <= metrics["actor/padding_frac"] < 1.0
    # The largest micro-batch, in the padded tokens its forward computes: within the budget.
    assert 4 <= metrics["actor/micro_batch_tokens_max"] <= 24


def test_padding_frac_counts_what_the_forward_computes():
    # Left-padded prompts: row 0 is 3 + 2 tokens at columns 0-4, row 1 is 1 + 4 at columns 2-6;
    # the forward runs 2 rows x 7 columns for 10 real tokens.
    batch = build_batch([[1, 2, 3], [6]], [[4, 5], [7, 8, 9, 10]], pad_id=0, left_pad_prompts=True)
    assert padding_frac([batch]) == pytest.approx(4 / 14)
    # Each row alone: its own columns only, nothing padded.
    assert padding_frac([batch.select([0]), batch.select([1])]) == 0.0
    assert padding_frac([]) == 0.0


def test_passes_without_backward_take_a_larger_token_budget():
    """Old and reference log-probs keep no activations for a backward: by default their
    micro-batches hold twice the update's padded tokens; the key sets it explicitly."""
    batch, policy = batch_of(LENGTHS), TablePolicy()

    def biggest(plan):
        return max(len(g) * max(int(batch.lengths[i]) for i in g) for g in plan)

    run = run_with(token_budget=24)
    update, no_grad = (
        plan_micro_batches(policy, batch, run.actor),
        plan_micro_batches(policy, batch, run.actor, backward=False),
    )
    assert biggest(update) <= 24 < biggest(no_grad) <= 48 and len(no_grad) < len(update)
    explicit = plan_micro_batches(
        policy, batch, run_with(token_budget=24, log_prob_max_token_len_per_gpu=12).actor, backward=False
    )
    assert biggest(explicit) <= 12 and len(explicit) > len(update)
    for plan in (update, no_grad, explicit):
        assert sorted(i for g in plan for i in g) == list(range(len(LENGTHS)))


def test_micro_batch_plans():
    lengths = [10, 3, 9, 2, 4]
    assert micro_batches(lengths, rows=2) == [[0, 1], [2, 3], [4]]
    groups = micro_batches(lengths, token_budget=20)
    assert sorted(i for g in groups for i in g) == list(range(5))
    # rows x longest row within the budget, longest rows together
    assert all(len(g) * max(lengths[i] for i in g) <= 20 for g in groups)
    assert groups[0] == [0, 2]
    # a row longer than the budget gets its own micro-batch
    assert micro_batches([50, 1], token_budget=20) == [[0], [1]]
    # evened out to the count another rank needs
    more = split_to(groups, len(groups) + 1, lengths)
    assert len(more) == len(groups) + 1 and sorted(i for g in more for i in g) == list(range(5))
    with pytest.raises(ValueError):
        split_to([[0]], 2, [5])
