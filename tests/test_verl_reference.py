"""lorarl's loss and rollout-correction math against verl's formulas on seeded random inputs.

The reference functions below re-derive verl's semantics (core_algos.agg_loss and the vanilla
and GSPO policy losses, rollout_corr_helper's importance weights, rejection criteria and
diagnostics, as documented in its docs/algo/rollout_corr.md) one sequence at a time in float64,
written from the formulas rather than from its code. Known, documented differences are not
exercised: rows without a kept token (verl counts them in some sequence fractions) and
seq-mean-token-sum-norm over several data-parallel ranks.
"""

from __future__ import annotations

import math

import pytest
import torch

from lorarl.algorithms import losses as A
from lorarl.algorithms import rollout_correction as RC
from lorarl.config.schema import AGG_MODES

B, T = 7, 11
BOUND = 20.0


def random_inputs(seed: int, scale: float = 0.6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    rollout = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    trainer = rollout + torch.randn(B, T, generator=g, dtype=torch.float64) * scale
    trainer[0, 0] = rollout[0, 0] + 25.0  # beyond the +-20 safety bound
    trainer[1, 0] = rollout[1, 0] - 25.0
    return trainer, rollout, mask


def rows(mask):
    return [[t for t in range(T) if mask[i, t] > 0] for i in range(B)]


# ---- verl's formulas, one sequence at a time --------------------------------------------------


def ref_agg(loss, mask, mode, scale=None):
    seqs = [(i, toks) for i, toks in enumerate(rows(mask)) if toks]
    if mode == "token-mean":
        return sum(float(loss[i, t]) for i, ts in seqs for t in ts) / sum(len(ts) for _, ts in seqs)
    if mode == "seq-mean-token-sum":
        return sum(sum(float(loss[i, t]) for t in ts) for i, ts in seqs) / len(seqs)
    if mode == "seq-mean-token-mean":
        return sum(sum(float(loss[i, t]) for t in ts) / len(ts) for i, ts in seqs) / len(seqs)
    return sum(float(loss[i, t]) for i, ts in seqs for t in ts) / (scale or loss.shape[-1])


def ref_vanilla_tokens(logp, old, adv, lo, hi, c):
    out = torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        for t in range(T):
            r = math.exp(max(-BOUND, min(BOUND, float(logp[i, t] - old[i, t]))))
            a = float(adv[i])
            x = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
            out[i, t] = min(x, -a * c) if a < 0 else x
    return out


def ref_ppo_kl(logp, old, mask):
    vals = [max(-BOUND, min(BOUND, float(logp[i, t] - old[i, t]))) for i, ts in enumerate(rows(mask)) for t in ts]
    return -sum(vals) / len(vals)


def ref_token_weights(trainer, rollout, mask, level, thr):
    w = torch.zeros(B, T, dtype=torch.float64)
    for i, ts in enumerate(rows(mask)):
        s = sum(float(trainer[i, t] - rollout[i, t]) for t in ts)
        for t in ts:
            lr = float(trainer[i, t] - rollout[i, t]) if level == "token" else s
            w[i, t] = min(math.exp(max(-BOUND, min(BOUND, lr))), thr)
    return w


def ref_keep(trainer, rollout, mask, option, upper, lower=None):
    """verl's rejection: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r with log r clamped;
    k1 bounds in log space, the others an upper bound; seq_* by sum, mean or max over the sequence."""
    keep = torch.zeros(B, T, dtype=torch.bool)
    level, _, kind = option.rpartition("_")
    for i, ts in enumerate(rows(mask)):
        stats = []
        for t in ts:
            x = max(-BOUND, min(BOUND, float(trainer[i, t] - rollout[i, t])))
            stats.append({"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[kind])

        def ok(v):
            return math.log(lower) <= v <= math.log(upper) if kind == "k1" else v <= upper

        if level == "token":
            for t, v in zip(ts, stats):
                keep[i, t] = ok(v)
            continue
        agg = {"seq_sum": sum(stats), "seq_mean": sum(stats) / len(stats), "seq_max": max(stats)}[level]
        for t in ts:
            keep[i, t] = ok(agg)
    return keep


def ref_offpolicy(trainer, rollout, mask):
    toks = [(i, t) for i, ts in enumerate(rows(mask)) for t in ts]
    lr = {(i, t): float(trainer[i, t] - rollout[i, t]) for i, t in toks}
    seqs = [ts for ts in rows(mask) if ts]
    diffs = [sum(float(rollout[i, t]) for t in ts) / len(ts) - sum(float(trainer[i, t]) for t in ts) / len(ts)
             for i, ts in enumerate(rows(mask)) if ts]  # fmt: skip
    seq_lr = [max(-BOUND, min(BOUND, sum(lr[(i, t)] for t in ts))) for i, ts in enumerate(rows(mask)) if ts]
    return {
        "kl": sum(-v for v in lr.values()) / len(toks),
        "k3_kl": sum(math.exp(v) - v - 1 for v in lr.values()) / len(toks),
        "log_ppl_diff": sum(diffs) / len(seqs),
        "log_ppl_abs_diff": sum(abs(d) for d in diffs) / len(seqs),
        "chi2_token": sum(math.exp(2 * max(-BOUND, min(BOUND, v))) for v in lr.values()) / len(toks) - 1,
        "chi2_seq": sum(math.exp(2 * s) for s in seq_lr) / len(seq_lr) - 1,
    }


def ref_token_is_metrics(trainer, rollout, mask, thr):
    w = [math.exp(max(-BOUND, min(BOUND, float(trainer[i, t] - rollout[i, t])))) for i, ts in enumerate(rows(mask)) for t in ts]  # fmt: skip
    band = [min(max(x, 1 / thr), thr) for x in w]
    mean_band = sum(band) / len(band)
    var = sum(x * x for x in band) / len(band) - mean_band**2
    return {
        "rollout_is_mean": sum(w) / len(w),
        "rollout_is_max": max(w),
        "rollout_is_min": min(w),
        "rollout_is_ratio_fraction_high": sum(x > thr for x in w) / len(w),
        "rollout_is_ratio_fraction_low": sum(x < 1 / thr for x in w) / len(w),
        "rollout_is_std": math.sqrt(max(var, 0.0)),
        "rollout_is_eff_sample_size": 1 / (sum((x / (mean_band + 1e-8)) ** 2 for x in band) / len(band)),
    }


# ---- comparisons ------------------------------------------------------------------------------

SEEDS = [0, 1, 2, 3]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_matches_verl(seed, mode):
    _, _, mask = random_inputs(seed)
    loss = torch.randn(B, T, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64)
    assert float(A.agg_loss(loss, mask, mode, norm_len=40)) == pytest.approx(ref_agg(loss, mask, mode, 40), rel=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
def test_vanilla_policy_loss_with_dual_clip_matches_verl(seed):
    trainer, rollout, mask = random_inputs(seed)
    adv = torch.randn(B, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    loss, m = A.policy_loss(trainer, rollout, adv, mask, 0.2, 0.28, 3.0, "token-mean")
    ref = ref_agg(ref_vanilla_tokens(trainer, rollout, adv, 0.2, 0.28, 3.0), mask, "token-mean")
    assert float(loss) == pytest.approx(ref, rel=1e-9)
    # ppo_kl averages the clamped log-ratio, as verl does (one token sits 25 nats out).
    assert float(m["ppo_kl"]) == pytest.approx(ref_ppo_kl(trainer, rollout, mask), rel=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_loss_and_gradient_match_verl(seed):
    _, old, mask = random_inputs(seed)
    g = torch.Generator().manual_seed(seed + 7)
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.01).requires_grad_(True)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    with torch.no_grad():  # sequence 2 far past the cap of 10 with a negative advantage
        logp[2] += 12.0
    adv[2] = -1.0
    loss, _ = A.policy_loss(logp, old, adv, mask, 3e-4, 4e-4, None, "seq-mean-token-mean", mode="gspo")
    loss.backward()
    # verl: s_i,t = exp(min(sg[mean_t log r] + log p - sg[log p], 10)), PPO clip per token, seq-mean-token-mean
    ref_logp = logp.detach().clone().requires_grad_(True)
    per_seq = []
    for i, ts in enumerate(rows(mask)):
        seq = sum(float(ref_logp[i, t].detach() - old[i, t]) for t in ts) / len(ts)
        terms = []
        for t in ts:
            log_s = torch.clamp(seq + ref_logp[i, t] - ref_logp[i, t].detach(), max=10.0)
            s = torch.exp(log_s)
            terms.append(torch.maximum(-adv[i] * s, -adv[i] * torch.clamp(s, 1 - 3e-4, 1 + 4e-4)))
        per_seq.append(torch.stack(terms).mean())
    ref = torch.stack(per_seq).mean()
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-9)
    torch.testing.assert_close(logp.grad, ref_logp.grad, rtol=1e-9, atol=1e-12)
    assert logp.grad[2].abs().sum() == 0  # capped: no gradient, where +-20 would give e^12


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("level", RC.IS_LEVELS)
def test_importance_weights_match_verl(seed, level):
    trainer, rollout, mask = random_inputs(seed)
    w, new_mask, _ = RC.correct(trainer, rollout, mask, level, 2.0)
    torch.testing.assert_close(w, ref_token_weights(trainer, rollout, mask, level, 2.0), rtol=1e-9, atol=0)
    assert torch.equal(new_mask, mask)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("option", RC.RS_OPTIONS)
def test_rejection_matches_verl(seed, option):
    trainer, rollout, mask = random_inputs(seed, scale=0.3)
    wide = option.startswith("seq_sum")  # a sum over up to 11 tokens: a wider bound
    if option.endswith("k1"):  # an explicit lower bound: it bounds pi_rollout / pi_trainer
        spec, upper, lower = ("0.3_3.0", 3.0, 0.3) if wide else ("0.8_1.1", 1.1, 0.8)
    else:
        spec, upper, lower = ("0.4", 0.4, None) if wide else ("0.05", 0.05, None)
    rules = RC.parse_rejection(option, spec)
    _, new_mask, m = RC.correct(trainer, rollout, mask, None, 2.0, rules)
    keep = ref_keep(trainer, rollout, mask, option, upper, lower)
    assert torch.equal(new_mask.bool(), keep & mask.bool())
    dropped = (mask.bool() & ~keep).sum() / mask.sum()
    assert float(m["rollout_rs_masked_fraction"]) == pytest.approx(float(dropped), rel=1e-9)
    assert 0 < float(dropped) < 1 or option.startswith("seq_max")  # the bounds bite on these inputs


def test_k1_single_threshold_means_the_reciprocal_band():
    assert RC.parse_rejection("token_k1,seq_mean_k2", "2.0,0.01") == (
        RC.Rejection("token_k1", 2.0, 0.5),
        RC.Rejection("seq_mean_k2", 0.01),
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_diagnostics_match_verl(seed):
    trainer, rollout, mask = random_inputs(seed)
    _, _, m = RC.correct(trainer, rollout, mask, "token", 2.0)
    expect = {**ref_offpolicy(trainer, rollout, mask), **ref_token_is_metrics(trainer, rollout, mask, 2.0)}
    for key, value in expect.items():
        assert float(m[key]) == pytest.approx(value, rel=1e-6, abs=1e-9), key


@pytest.mark.parametrize("seed", SEEDS)
def test_sequence_weight_statistics_match_verl(seed):
    """At sequence level verl takes max / min and the fractions over sequences, in log space (the
    max capped at e^20), and the mean over tokens of the broadcast weights."""
    trainer, rollout, mask = random_inputs(seed, scale=0.3)
    _, _, m = RC.correct(trainer, rollout, mask, "sequence", 2.0)
    sums = [sum(float(trainer[i, t] - rollout[i, t]) for t in ts) for i, ts in enumerate(rows(mask))]
    per_token = [math.exp(max(-BOUND, min(BOUND, s))) for s, ts in zip(sums, rows(mask)) for _ in ts]
    assert float(m["rollout_is_max"]) == pytest.approx(math.exp(min(max(sums), BOUND)), rel=1e-6)
    assert float(m["rollout_is_min"]) == pytest.approx(math.exp(min(sums)), rel=1e-6)
    assert float(m["rollout_is_mean"]) == pytest.approx(sum(per_token) / len(per_token), rel=1e-6)
    assert float(m["rollout_is_ratio_fraction_high"]) == pytest.approx(sum(s > math.log(2) for s in sums) / B)
    assert float(m["rollout_is_ratio_fraction_low"]) == pytest.approx(sum(s < math.log(0.5) for s in sums) / B)
