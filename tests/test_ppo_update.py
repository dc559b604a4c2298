"""The one PPO update both engines share (lorarl.algorithms.ppo), run with a small real torch
policy in place of an engine's forward: loss normalisation over micro-batches, the on-policy
shortcut, token-budget micro-batches and the metrics."""

from __future__ import annotations

import typing

import pytest
import torch

from lorarl.algorithms.ppo import AdapterPlan, Correction, is_on_policy, needs_old_logp
from lorarl.algorithms.ppo import ppo_update as run_ppo_update
from lorarl.config.compose import compose
from lorarl.contract.engine import (
    Engine,
    EntropyMode,
    LossFn,
    build_batch,
    micro_batches,
    padding_frac,
    plan_micro_batches,
    read_metrics,
    split_to,
)
from lorarl.contract.messages import UpdateReport
from lorarl.driver.jobs import sampling_of

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
        from lorarl.algorithms.losses import token_logprobs

        logits = self.E[ids[:, :-1]] @ self.W
        return token_logprobs(logits, ids[:, 1:])[0]

    def forward_backward(self, micro, loss_fn: LossFn, entropy: EntropyMode, temperature: float):
        self.micro_sizes.append([len(m) for m in micro])
        out = []
        for mb in micro:
            mb = mb.trimmed()
            loss, metrics = loss_fn(mb, self.logp(mb.input_ids), torch.zeros(mb.response_mask.shape))
            loss.backward()
            out.append(metrics)
        return read_metrics(out)

    def optimizer_step(self, step: int, skip=()) -> list[float]:
        self.grads.append(self.W.grad.clone())
        norm = float(self.W.grad.norm())
        self.W.grad = None
        return [norm]

    def end_step(self) -> list[float]:
        return [0.5]

    def dp_all_reduce(self, values, op="sum"):
        return list(values)


def test_engines_implement_the_protocol():
    from lorarl.engines.fsdp import FSDPEngine
    from lorarl.engines.megatron.engine import MegatronEngine

    # compute_dtype and pad_token_id are set per instance by the Megatron engine, adapter_names by FSDP's.
    members = typing._get_protocol_attrs(Engine) - {"compute_dtype", "pad_token_id", "adapter_names"}
    for cls in (FSDPEngine, MegatronEngine):
        assert [m for m in members if not hasattr(cls, m)] == [], cls.__name__


def ppo_stats(policy, batch, step: int, run):
    """The update as the worker calls it, with the run's sampling facts and actor settings."""
    correction = Correction.of(run.algorithm.rollout_correction, run.trainer.device)
    return run_ppo_update(policy, batch, step, [AdapterPlan(run.actor, sampling_of(run), correction)])[0]


def ppo_update(policy, batch, step: int, run) -> dict[str, float]:
    """The update's logged keys and values."""
    return ppo_stats(policy, batch, step, run).metrics()


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


def _with_rollout(batch, reject_rows=(), reject_tokens=()):
    """The batch with the trainer's log-probs (old_logp) and sampler log-probs equal to them except
    where a row or (row, column) is to be rejected: there the sampler is 5 nats more confident."""
    with torch.no_grad():
        batch.old_logp = TablePolicy().logp(batch.input_ids)
    rollout = batch.old_logp.clone()
    for r in reject_rows:
        rollout[r] += 5.0 * batch.response_mask[r]
    for r, c in reject_tokens:
        rollout[r, c] += 5.0
    batch.rollout_logp = rollout
    return batch


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_masked_step_trains_at_full_strength(agg):
    """Rejecting tokens or sequences gives the gradient of the step on what survives: the loss,
    its KL and entropy terms are divided by the surviving count (as verl rewrites the mask first),
    not by the count before rejection."""
    key = "algorithm.rollout_correction"
    kl = {"use_kl_loss": "true", "kl_loss_type": "low_var_kl", "entropy_coeff": 0.01}
    rejected = _with_rollout(batch_of(LENGTHS), reject_rows=(1, 3, 5, 7))  # half the sequences
    ref = torch.randn(rejected.old_logp.shape, generator=torch.Generator().manual_seed(3)) * 0.1
    rejected.ref_logp = rejected.old_logp + ref
    run = run_with(micro_rows=2, agg=agg, **kl)
    run_rs = compose(
        ["+backend=fsdp", "data.train_batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=2",
         "actor.ppo_micro_batch_size_per_gpu=2", f"actor.loss_agg_mode={agg}", "actor.use_kl_loss=true",
         "actor.entropy_coeff=0.01", f"{key}.rollout_rs=seq_sum_k1", f"{key}.rollout_rs_threshold=2.0",
         f"{key}.rollout_is=null"]
    )  # fmt: skip
    policy = TablePolicy()
    metrics = ppo_update(policy, rejected, step=1, run=run_rs)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(
        float(batch_of(LENGTHS).response_mask[[1, 3, 5, 7]].sum() / batch_of(LENGTHS).response_mask.sum())
    )
    kept = [0, 2, 4, 6]
    survivors = _with_rollout(batch_of(LENGTHS)).select(kept)
    survivors.ref_logp = rejected.ref_logp[kept]
    survivors.rollout_logp = None
    plain = TablePolicy()
    # The survivors alone: 4 of the 8 sequences, one mini-batch of them.
    ppo_update(plain, survivors, step=1, run=run)
    torch.testing.assert_close(policy.grads[0], plain.grads[0], atol=1e-6, rtol=1e-5)
    assert policy.grads[0].abs().sum() > 0

    # Token rejection: the same gradient as the step with those tokens out of the mask.
    tokens = [(0, c) for c in range(rejected.response_mask.shape[1]) if rejected.response_mask[0, c]][:1]
    tokens += [(5, c) for c in range(rejected.response_mask.shape[1]) if rejected.response_mask[5, c]][:3]
    tok = _with_rollout(batch_of(LENGTHS), reject_tokens=tokens)
    tok_run = compose([*_overrides(agg), f"{key}.rollout_rs=token_k1", f"{key}.rollout_rs_threshold=2.0"])
    a = TablePolicy()
    ppo_update(a, tok, step=1, run=tok_run)
    masked = _with_rollout(batch_of(LENGTHS))
    for r, c in tokens:
        masked.response_mask[r, c] = 0.0
    masked.rollout_logp = None
    b = TablePolicy()
    ppo_update(b, masked, step=1, run=compose(_overrides(agg)))
    torch.testing.assert_close(a.grads[0], b.grads[0], atol=1e-6, rtol=1e-5)


def _overrides(agg: str, micro_rows: int = 2) -> list[str]:
    return ["+backend=fsdp", "data.train_batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=2",
            f"actor.ppo_micro_batch_size_per_gpu={micro_rows}", f"actor.loss_agg_mode={agg}",
            "actor.use_kl_loss=false"]  # fmt: skip


def test_token_tis_on_policy_uses_the_update_forward():
    """Token TIS on the on-policy path needs no old-log-prob pass: the weights come from the
    update's own forward (detached), and give the gradient of the loss weighted by hand."""
    key = "algorithm.rollout_correction"
    # One micro-batch, so the logged means are over the whole batch.
    run = compose([*_overrides("token-mean", 8), f"{key}.rollout_is=token", f"{key}.rollout_is_threshold=2.0"])

    assert not needs_old_logp(
        run.actor, run.data.train_batch_size, Correction.of(run.algorithm.rollout_correction, run.trainer.device)
    )
    batch = batch_of(LENGTHS)
    with torch.no_grad():
        trainer = TablePolicy().logp(batch.input_ids)
    noise = torch.randn(trainer.shape, generator=torch.Generator().manual_seed(5))
    batch.rollout_logp = trainer + noise  # ratios exp(-noise): some truncated at 2
    policy = TablePolicy()
    metrics = ppo_update(policy, batch, step=1, run=run)
    W = TablePolicy().W.detach().clone().requires_grad_(True)
    ref = TablePolicy()
    ref.W = W
    logp = ref.logp(batch.input_ids)
    mask = batch.response_mask
    w = torch.exp(-noise).clamp(max=2.0)
    loss = -(batch.advantages[:, None] * w * torch.exp(logp - logp.detach()) * mask).sum() / mask.sum()
    loss.backward()
    torch.testing.assert_close(policy.grads[0], W.grad, atol=1e-6, rtol=1e-5)
    keep = mask.bool()
    assert metrics["rollout_corr/kl"] == pytest.approx(float(noise[keep].mean()), rel=1e-4)
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(float(torch.exp(-noise)[keep].max()), rel=1e-5)


def test_dr_grpo_sums_over_sequences_and_divides_by_the_constant():
    """seq-mean-token-sum-norm: the mini-batch's sum over sequences and tokens / loss_scale_factor,
    whatever the micro-batching (no mean over sequences)."""
    grads = []
    for rows in (8, 1, 2):
        policy = TablePolicy()
        overrides = [*_overrides("seq-mean-token-sum-norm", rows), "actor.loss_scale_factor=16"]
        ppo_update(policy, batch_of(LENGTHS), step=1, run=compose(overrides))
        grads.append(policy.grads[0])
    W = TablePolicy().W.detach().clone().requires_grad_(True)
    ref = TablePolicy()
    ref.W = W
    batch = batch_of(LENGTHS)
    logp = ref.logp(batch.input_ids)
    loss = -(batch.advantages[:, None] * torch.exp(logp - logp.detach()) * batch.response_mask).sum() / 16
    loss.backward()
    for g in grads:
        torch.testing.assert_close(g, W.grad, atol=1e-6, rtol=1e-5)


def _hand_gradient(batch, per_token):
    """The gradient of sum(per_token(logp) * mask) / mask.sum() at a fresh TablePolicy's weights."""
    ref = TablePolicy()
    ref.W = ref.W.detach().clone().requires_grad_(True)
    logp = ref.logp(batch.input_ids)
    (per_token(logp) * batch.response_mask).sum().div(batch.response_mask.sum()).backward()
    return ref.W.grad


def test_batch_normalised_weights_and_bypass_mode():
    key = "algorithm.rollout_correction"
    batch = _with_rollout(batch_of(LENGTHS))
    noise = torch.randn(batch.old_logp.shape, generator=torch.Generator().manual_seed(9)) * 0.5
    batch.rollout_logp = batch.old_logp + noise
    adv = batch.advantages[:, None]
    # Token weights divided by their mean over the batch's tokens (computed before the update).
    run = compose([*_overrides("token-mean"), f"{key}.rollout_is=token", f"{key}.rollout_is_batch_normalize=true"])
    policy = TablePolicy()
    metrics = ppo_update(policy, batch, step=1, run=run)
    w = torch.exp(-noise).clamp(max=2.0)
    mean = float((w * batch.response_mask).sum() / batch.response_mask.sum())
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean, rel=1e-5)
    expect = _hand_gradient(batch, lambda lp: -adv * (w / mean) * torch.exp(lp - lp.detach()))
    torch.testing.assert_close(policy.grads[0], expect, atol=1e-6, rtol=1e-5)
    # Bypass: pi_old is the sampler's, so the PPO ratio pi / pi_rollout is clipped at 1 -+ 0.2.
    run = compose([*_overrides("token-mean"), f"{key}.rollout_is=null", f"{key}.bypass_mode=true"])
    batch.old_logp = None
    policy = TablePolicy()
    ppo_update(policy, batch, step=1, run=run)

    def clipped(lp):
        r = torch.exp(lp - batch.rollout_logp)
        return torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))

    torch.testing.assert_close(policy.grads[0], _hand_gradient(batch, clipped), atol=1e-6, rtol=1e-5)


def test_update_report_logs_the_updates_keys_unchanged():
    """What crosses back from the worker is typed (lorarl.contract.messages.UpdateReport); the keys it
    logs are the update's own, with the same values in the same order (the rollout correction's
    first, as the loss reports them), then the worker's timings."""
    key = "algorithm.rollout_correction"
    run = compose([*_overrides("token-mean", 2), f"{key}.rollout_is=token", f"{key}.rollout_is_threshold=2.0"])
    stats = ppo_stats(TablePolicy(), _with_rollout(batch_of(LENGTHS)), step=1, run=run)
    metrics = stats.metrics()
    assert next(iter(metrics)).startswith("rollout_corr/")
    worker = {"sleep_seconds": 0.0, "slept": False, "update_seconds": 1.5, "old_logp_seconds": 0.25}
    report = UpdateReport(ppo=[stats], **worker)
    assert report.ppo[0].entropy == metrics["actor/entropy"] and report.ppo[0].kl_loss is None
    assert set(report.ppo[0].extra) == {k for k in metrics if k.startswith("rollout_corr/")}
    logged = report.metrics()
    timings = {"timing/sleep": 0.0, "rollout/sleeps": 0.0, "timing/old_logp": 0.25, "timing/update": 1.5}
    assert list(logged.items()) == [*metrics.items(), *timings.items()]
