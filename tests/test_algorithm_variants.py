"""GRPO variants and the rollout-mismatch correction against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from lorarl import algorithms as A
from lorarl.config import compose
from lorarl.errors import ConfigError

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_seq_mean_token_sum_norm_divides_by_one_constant():
    loss = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    # sums 6 and 4, each / 4 (the norm length), mean over the 2 sequences: (1.5 + 1.0) / 2
    assert A.agg_loss(loss, MASK, "seq-mean-token-sum-norm", norm_len=4).item() == pytest.approx(1.25)
    # with a global denominator (2 sequences over 1 rank): the same
    assert A.agg_loss(loss, MASK, "seq-mean-token-sum-norm", denom=2.0, norm_len=4).item() == pytest.approx(1.25)
    # seq-mean-token-sum would favour neither length either, but does not divide: (6 + 4) / 2
    assert A.agg_loss(loss, MASK, "seq-mean-token-sum").item() == pytest.approx(5.0)


def test_gspo_ratio_is_one_per_sequence_length_normalised():
    # Seq 0: log-ratios ln2, 0, -ln2 -> mean 0 -> s = 1 for every token. Seq 1: ln(1.5) -> 1.5.
    old = torch.zeros(2, 4)
    logp = torch.tensor([[math.log(2.0), 0.0, -math.log(2.0), 5.0], [math.log(1.5), 5.0, 5.0, 5.0]])
    logp.requires_grad_(True)
    adv = torch.tensor([1.0, 1.0])
    loss, m = A.policy_loss(
        logp,
        old,
        adv,
        MASK,
        clip_ratio_low=3e-4,
        clip_ratio_high=4e-4,
        loss_agg_mode="seq-mean-token-mean",
        mode="gspo",
    )
    # seq 0: ratio 1 (inside the clip range), loss -1 per token; seq 1: ratio 1.5 clipped to
    # 1.0004 for A > 0 -> -1.0004. Mean of the two sequence means.
    assert loss.item() == pytest.approx(-(1.0 + 1.0004) / 2, rel=1e-6)
    assert float(m["pg_clipfrac"]) == pytest.approx(1 / 4)  # seq 1's one token of 4 kept tokens
    loss.backward()
    # gradient of seq 0's tokens: -A * s / |y| / 2 sequences = -1/6 each; clipped seq 1: 0
    torch.testing.assert_close(logp.grad[0, :3], torch.full((3,), -1 / 6))
    assert logp.grad[1].abs().sum() == 0


def test_vanilla_loss_unchanged_by_unit_weights():
    logp = torch.tensor([[0.1, -0.2, 0.3, 0.0], [0.5, 0.0, 0.0, 0.0]])
    old = torch.zeros(2, 4)
    adv = torch.tensor([1.0, -1.0])
    a, _ = A.policy_loss(logp, old, adv, MASK)
    b, _ = A.policy_loss(logp, old, adv, MASK, weights=torch.ones(2, 4))
    assert a.item() == b.item()


def test_rollout_correction_by_hand():
    # trainer (old) vs rollout log-probs: token ratios e^0.5, e^-1, 1 | e^2
    old = torch.tensor([[0.5, -1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    rollout = torch.zeros(2, 4)
    r = [math.exp(0.5), math.exp(-1.0), 1.0]
    w, mask, m = A.rollout_correction(old, rollout, MASK, "token_tis", threshold=2.0)
    m = {k: float(v) for k, v in m.items()}
    torch.testing.assert_close(w[0, :3], torch.tensor([r[0], r[1], 1.0]))
    assert w[1, 0].item() == pytest.approx(2.0)  # e^2 truncated at the threshold
    assert torch.equal(mask, MASK)
    # metrics: k3 = e^x - x - 1 averaged over the 4 kept tokens; the largest ratio; nothing masked
    k3 = [math.exp(x) - x - 1 for x in (0.5, -1.0, 0.0, 2.0)]
    assert m["kl"] == pytest.approx(sum(k3) / 4, rel=1e-5)
    assert m["ratio_max"] == pytest.approx(math.exp(2.0), rel=1e-5)
    assert m["masked_frac"] == 0.0

    w, _, _ = A.rollout_correction(old, rollout, MASK, "seq_tis", threshold=2.0)
    # seq 0: e^(0.5 - 1) = e^-0.5; seq 1: e^2 -> 2
    assert w[0, 0].item() == pytest.approx(math.exp(-0.5), rel=1e-6) and w[1, 0].item() == pytest.approx(2.0)

    _, mask, m = A.rollout_correction(old, rollout, MASK, "token_mask", threshold=2.0)
    m = {k: float(v) for k, v in m.items()}
    # band [0.5, 2]: e^-1 = 0.37 and e^2 = 7.4 leave it
    assert mask.tolist() == [[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    assert m["masked_frac"] == pytest.approx(2 / 4)

    _, mask, _ = A.rollout_correction(old, rollout, MASK, "seq_mask", threshold=2.0, lower=0.5)
    # seq 0: e^-0.5 = 0.61 inside [0.5, 2]; seq 1: e^2 outside
    assert mask.tolist() == [[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]

    w, mask, m = A.rollout_correction(old, rollout, MASK, None)
    assert w is None and torch.equal(mask, MASK) and m["kl"] > 0
    # Nothing kept: no largest ratio, so 1 (no mismatch), and nothing masked.
    _, _, m = A.rollout_correction(old, rollout, torch.zeros_like(MASK), "token_mask")
    assert float(m["ratio_max"]) == 1.0 and float(m["masked_frac"]) == 0.0
    with pytest.raises(ValueError, match="'tis'"):
        A.rollout_correction(old, rollout, MASK, "tis")


def test_overlong_penalty_and_group_filter():
    # max 100, buffer 20: free up to 80, then linear to -1 at 100
    assert A.overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert A.overlong_penalty(90, 100, 20, 1.0) == pytest.approx(-0.5)
    assert A.overlong_penalty(100, 100, 20, 0.5) == pytest.approx(-0.5)
    from lorarl.trainer import PromptGroup as Group

    groups = [Group(None, [[1]] * 2, [[0.0]] * 2, r) for r in ([1.0, 1.0], [0.0, 1.0], [0.5, 0.5])]
    assert [g.has_signal for g in groups] == [False, True, False]


@pytest.mark.parametrize(
    "name,expect",
    [
        ("grpo", dict(clip_low=0.2, clip_high=0.2, loss_agg_mode="token-mean", use_kl_loss=True, norm=True)),
        ("dapo", dict(clip_low=0.2, clip_high=0.28, loss_agg_mode="token-mean", use_kl_loss=False, norm=True)),
        (
            "dr_grpo",
            dict(clip_low=0.2, clip_high=0.2, loss_agg_mode="seq-mean-token-sum-norm", use_kl_loss=False, norm=False),
        ),
        (
            "gspo",
            dict(clip_low=3e-4, clip_high=4e-4, loss_agg_mode="seq-mean-token-mean", use_kl_loss=False, norm=True),
        ),
    ],
)
def test_algorithm_presets_compose(name, expect):
    run = compose(["+backend=fsdp", f"algorithm={name}"])
    assert (run.actor.clip_low, run.actor.clip_high) == pytest.approx((expect["clip_low"], expect["clip_high"]))
    assert run.actor.loss_agg_mode == expect["loss_agg_mode"]
    assert run.actor.use_kl_loss is expect["use_kl_loss"]
    assert run.algorithm.norm_adv_by_std_in_grpo is expect["norm"]
    assert run.actor.policy_loss == ("gspo" if name == "gspo" else "vanilla")
    assert run.algorithm.filter_groups.enable is (name == "dapo")
    assert run.algorithm.overlong_buffer.enable is (name == "dapo")


def test_rollout_correction_config_is_checked():
    with pytest.raises(ConfigError, match="algorithm.rollout_correction.mode"):
        compose(["+backend=fsdp", "algorithm.rollout_correction.mode=tis"])
    with pytest.raises(ConfigError, match="threshold"):
        compose(["+backend=fsdp", "algorithm.rollout_correction.threshold=0.5"])
    assert (
        compose(["+backend=fsdp", "algorithm.rollout_correction.mode=seq_mask"]).algorithm.rollout_correction.mode
        == "seq_mask"
    )
