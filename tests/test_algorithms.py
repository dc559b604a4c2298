"""GRPO math against numbers worked out by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from lorarl.algorithms.advantages import grpo_advantages
from lorarl.algorithms.losses import (
    agg_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_and_entropy,
    masked_mean,
    masked_sum,
    policy_loss,
    token_logprobs,
)
from lorarl.config.compose import compose
from lorarl.errors import ConfigError

T = torch.tensor


def close(actual, expected, tol=1e-6):
    assert torch.allclose(
        torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=0
    ), (actual, expected)


# ---------------------------------------------------------------- masked reductions


def test_masked_sum_and_mean_all_and_per_row():
    x = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = T([[1, 1, 0], [0, 0, 0]])
    close(masked_sum(x, mask), 3.0)
    close(masked_mean(x, mask), 1.5)  # (1 + 2) / 2
    close(masked_sum(x, mask, dim=-1), [3.0, 0.0])
    close(masked_mean(x, mask, dim=-1), [1.5, 0.0])  # empty row is 0, not NaN
    close(masked_mean(x, T([[1, 0, 1], [1, 0, 1]]), dim=0), [2.5, 0.0, 4.5])


def test_masked_mean_ignores_nan_in_masked_positions():
    x = T([float("nan"), 2.0, float("inf")])
    close(masked_mean(x, T([False, True, False])), 2.0)


# ---------------------------------------------------------------- advantages


def test_grpo_advantages_interleaved_groups():
    # group 7 -> rewards 0, 2, 4: mean 2, unbiased var (4+0+4)/2 = 4, std 2 -> -1, 0, 1
    # group 3 -> rewards 1, 1: all equal -> 0
    rewards = T([0.0, 1.0, 2.0, 1.0, 4.0])
    groups = T([7, 3, 7, 3, 7])
    close(grpo_advantages(rewards, groups, eps=0.0), [-1.0, 0.0, 0.0, 0.0, 1.0])
    # eps in the denominator: 2 / (2 + 1e-6)
    close(grpo_advantages(rewards, groups), [-0.9999995, 0.0, 0.0, 0.0, 0.9999995], tol=1e-7)


def test_grpo_advantages_binary_rewards_and_no_std():
    # rewards 1,0,1,0: mean .5, unbiased var (4 * .25) / 3 = 1/3, std .5773503 -> +-.8660254
    rewards = T([1.0, 0.0, 1.0, 0.0])
    groups = T([0, 0, 0, 0])
    close(grpo_advantages(rewards, groups, eps=0.0), [0.8660254, -0.8660254, 0.8660254, -0.8660254])
    close(grpo_advantages(rewards, groups, norm_by_std=False), [0.5, -0.5, 0.5, -0.5])


def test_grpo_advantages_constant_and_singleton_groups_are_exactly_zero():
    # 0.1 * 3 / 3 != 0.1 in floating point: the deviation must not become signal
    rewards = T([0.1, 0.1, 0.1, 5.0], dtype=torch.float32)
    adv = grpo_advantages(rewards, T([0, 0, 0, 1]))
    assert adv.dtype == torch.float32
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]
    adv64 = grpo_advantages(T([0.1, 0.1, 0.1], dtype=torch.float64), T([2, 2, 2]))
    assert adv64.tolist() == [0.0, 0.0, 0.0]


def test_grpo_advantages_rejects_shape_mismatch():
    with pytest.raises(ValueError):
        grpo_advantages(T([1.0, 2.0]), T([0, 0, 0]))


# ---------------------------------------------------------------- log-probs / entropy


def test_token_logprobs_hand_values():
    # softmax(log([1,2,3,4])) = [.1,.2,.3,.4]; uniform over 4 -> -ln 4
    lp = torch.log(T([1.0, 2.0, 3.0, 4.0]))
    logits = torch.stack([lp, lp, torch.zeros(4)]).unsqueeze(0)  # [1, 3, 4]
    labels = T([[3, 0, 2]])
    out, _ = token_logprobs(logits, labels, chunk_tokens=2)  # chunk boundary inside the row
    assert out.shape == (1, 3) and out.dtype == torch.float32
    close(out, [[-0.9162907, -2.3025851, -1.3862944]])


def test_logprobs_from_bf16_logits_are_float32():
    logits = torch.zeros(2, 1, 2, dtype=torch.bfloat16)
    out, _ = token_logprobs(logits, T([[0], [1]]))
    assert out.dtype == torch.float32
    close(out, [[-0.6931472], [-0.6931472]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,chunk", [(1.0, 4), (0.7, 4), (0.7, 1024)])
def test_token_logprobs_match_float64_math_and_its_gradient(dtype, temperature, chunk):
    """Values, the no-gradient entropy and the gradient of a weighted sum against float64
    autograd; blocks that cut rows (chunk 4 < 7 positions) and the ignored last position."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 8, 50, generator=gen) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (5, 7), generator=gen)
    weights = torch.randn(5, 7, generator=gen)
    logp, entropy = token_logprobs(logits, labels, temperature, with_entropy=True, chunk_tokens=chunk)
    assert logp.dtype == entropy.dtype == torch.float32 and not entropy.requires_grad
    (logp * weights).sum().backward()
    ref = logits.detach().double().requires_grad_()
    lsm = (ref[:, :7] / temperature).log_softmax(-1)
    ref_logp = lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (ref_logp * weights.double()).sum().backward()
    assert (logp.double() - ref_logp).abs().max() < 1e-5
    assert (entropy.double() + (lsm.exp() * lsm).sum(-1)).abs().max() < 1e-5
    # bf16 gradients are the float64 ones rounded to bf16 (8 bits of mantissa).
    tol = 1e-6 if dtype == torch.float32 else 2**-8 * ref.grad.abs().max()
    assert (logits.grad.double() - ref.grad).abs().max() <= tol
    assert logits.grad[:, 7:].abs().max() == 0  # the position past the labels


def test_logprobs_and_entropy_in_each_entropy_mode():
    """The engines' one path from logits [B, L, V] to the loss's inputs for labels [B, L-1]: the
    entropy as a metric (no graph), as part of the loss (its gradient against float64 autograd)
    or not at all; log p the same in every mode."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 6, 40, generator=gen) * 2).requires_grad_()
    labels = torch.randint(0, 40, (3, 5), generator=gen)
    ref = logits.detach().double().requires_grad_()
    lsm = (ref[:, :5] / 0.7).log_softmax(-1)
    ref_entropy = -(lsm.exp() * lsm).sum(-1)
    ref_entropy.sum().backward()
    logps = []
    for mode in ("none", "metric", "grad"):
        logp, entropy = logprobs_and_entropy(logits, labels, 0.7, mode)
        logps.append(logp.detach())
        if mode == "none":
            assert entropy is None
            continue
        assert entropy.shape == (3, 5) and (entropy.double() - ref_entropy).abs().max() < 1e-5
        assert entropy.requires_grad == (mode == "grad")
    torch.testing.assert_close(logps[0], logps[1], rtol=0, atol=0)
    torch.testing.assert_close(logps[0], logps[2], rtol=0, atol=0)
    entropy.sum().backward()
    assert (logits.grad.double() - ref.grad).abs().max() < 1e-5
    assert logits.grad[:, 5:].abs().max() == 0


def test_megatron_engine_at_one_tp_rank_scores_each_next_token():
    """MegatronEngine._token_logp at TP=1, the path that imports nothing of Megatron: the model's
    logits [b, L, V] for ids [b, L] give log p(ids[:, t+1]) [b, L-1] and the entropy metric, and
    the gradient reaches every position but the last."""
    from lorarl.engines.megatron.engine import MegatronEngine

    engine = MegatronEngine.__new__(MegatronEngine)  # the method reads only the TP size
    engine.tp = 1
    gen = torch.Generator().manual_seed(9)
    output = (torch.randn(2, 7, 30, generator=gen) * 2).requires_grad_()
    ids = torch.randint(0, 30, (2, 7), generator=gen)
    logp, entropy = engine._token_logp(output, ids, 0.8, "metric")
    lsm = (output.detach().double()[:, :6] / 0.8).log_softmax(-1)
    assert logp.shape == entropy.shape == (2, 6)
    assert (logp.double() - lsm.gather(-1, ids[:, 1:, None]).squeeze(-1)).abs().max() < 1e-5
    assert (entropy.double() + (lsm.exp() * lsm).sum(-1)).abs().max() < 1e-5
    logp.sum().backward()
    assert output.grad[:, 6].abs().max() == 0 and output.grad[:, :6].abs().min() > 0


def test_token_logprobs_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="token_logprobs wants"):
        token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_entropy_hand_values():
    lp = torch.log(T([1.0, 2.0, 3.0, 4.0]))
    logits = torch.stack([torch.zeros(4), lp, T([100.0, 0.0, 0.0, 0.0])]).unsqueeze(0)
    # ln 4; -(.1 ln .1 + .2 ln .2 + .3 ln .3 + .4 ln .4) = 1.2798542; near one-hot -> ~0
    close(entropy_from_logits(logits, chunk_rows=2), [[1.3862944, 1.2798542, 0.0]], tol=1e-5)


# ---------------------------------------------------------------- KL


def test_kl_penalty_kinds():
    logp = T([-1.0, -2.0])
    ref = T([-1.5, -1.0])
    close(kl_penalty(logp, ref, "k1"), [0.5, -1.0])
    close(kl_penalty(logp, ref, "k2"), [0.125, 0.5])
    close(kl_penalty(logp, ref, "mse"), [0.125, 0.5])
    # ref - logp = -0.5, 1.0: e^-0.5 + 0.5 - 1 = 0.1065307; e - 1 - 1 = 0.7182818
    close(kl_penalty(logp, ref, "k3"), [0.1065307, 0.7182818])
    close(kl_penalty(logp, ref, "low_var_kl"), [0.1065307, 0.7182818])


def test_k3_is_clamped_and_has_finite_gradient():
    logp = T([0.0, 0.0, 0.0], requires_grad=True)
    ref = T([5.0, -30.0, 100.0])
    # e^5 - 6 = 142.4 -> 10; -30 -> 19 -> 10; e^100 overflows float32 unless clamped first
    kl = kl_penalty(logp, ref, "k3")
    close(kl, [10.0, 10.0, 10.0])
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all(), logp.grad


def test_kl_penalty_unknown_kind_is_a_caller_bug():
    # The config rejects it first (tests/test_config.py); here it is a ValueError naming the choices.
    with pytest.raises(ValueError, match=r"'k4'.*low_var_kl"):
        kl_penalty(T([0.0]), T([0.0]), "k4")


# ---------------------------------------------------------------- aggregation


def test_agg_loss_modes():
    loss = T([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0], [9.0, 9.0, 9.0]])
    mask = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    close(agg_loss(loss, mask, "token-mean"), 2.5)  # (1+2+3+4)/4
    close(agg_loss(loss, mask, "seq-mean-token-sum"), 5.0)  # (6 + 4) / 2 non-empty seqs
    close(agg_loss(loss, mask, "seq-mean-token-mean"), 3.0)  # (2 + 4) / 2


def test_agg_loss_unknown_mode_is_a_caller_bug():
    with pytest.raises(ValueError, match=r"'sum'.*token-mean"):
        agg_loss(T([[1.0]]), T([[1]]), "sum")


# ---------------------------------------------------------------- PPO-clip
# old_logp = 0 and logp = ln(ratio). Seq 0: A=+1, ratios 1.5, 0.5, 1.0. Seq 1: A=-1, ratios 1.5, 0.5, 4.0.
# Per token max(-A r, -A clip(r, .8, 1.2)):
#   seq 0: max(-1.5,-1.2)=-1.2 (clipped) | max(-0.5,-0.8)=-0.5 | -1.0
#   seq 1: max(1.5,1.2)=1.5 | max(0.5,0.8)=0.8 (clipped) | max(4.0,1.2)=4.0
RATIOS = [[1.5, 0.5, 1.0], [1.5, 0.5, 4.0]]
ADV = [1.0, -1.0]


def _inputs(requires_grad=False):
    logp = torch.log(T(RATIOS)).requires_grad_(requires_grad)
    return logp, torch.zeros(2, 3), T(ADV), torch.ones(2, 3)


def test_policy_loss_ppo_clip_hand_values_and_gradient():
    logp, old, adv, mask = _inputs(requires_grad=True)
    loss, m = policy_loss(logp, old, adv, mask)
    close(loss, 0.6)  # (-1.2 - 0.5 - 1.0 + 1.5 + 0.8 + 4.0) / 6 = 3.6 / 6
    close(m["pg_clipfrac"], 2 / 6)
    # ppo_kl = mean(-ln r) = -(2 ln 1.5 + 2 ln .5 + ln 4) / 6 = -0.8109302 / 6
    close(m["ppo_kl"], -0.1351550)
    assert m["pg_clipfrac_lower"] == 0.0
    # Detached 0-dim tensors: the update reads them once per mini-batch, not per micro-batch.
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in m.values())
    loss.backward()
    # d/dlogp of -A r is -A r / 6 where unclipped, 0 where the clipped branch is active
    close(logp.grad, [[0.0, -0.5 / 6, -1.0 / 6], [1.5 / 6, 0.0, 4.0 / 6]])


def test_policy_loss_dual_clip():
    logp, old, adv, mask = _inputs(requires_grad=True)
    loss, m = policy_loss(logp, old, adv, mask, clip_ratio_c=3.0)
    close(loss, 2.6 / 6)  # the A<0, r=4 token is capped at -A*c = 3
    close(m["pg_clipfrac_lower"], 1 / 6)
    loss.backward()
    assert logp.grad[1, 2].item() == 0.0


def test_policy_loss_asymmetric_clip():
    logp, old, adv, mask = _inputs()
    loss, _ = policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    close(loss, 3.52 / 6)  # seq 0 first token becomes max(-1.5, -1.28) = -1.28


def test_policy_loss_mask_and_agg_modes():
    logp, old, adv, _ = _inputs()
    mask = T([[1, 1, 1], [1, 1, 0]])  # drop the r=4 token
    close(policy_loss(logp, old, adv, mask)[0], -0.08)  # (-2.7 + 2.3) / 5
    close(policy_loss(logp, old, adv, mask, loss_agg_mode="seq-mean-token-sum")[0], -0.2)  # (-2.7 + 2.3) / 2
    close(policy_loss(logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")[0], 0.125)  # (-0.9 + 1.15) / 2


def test_policy_loss_token_level_advantages_match_sequence_level():
    logp, old, adv, mask = _inputs()
    loss, _ = policy_loss(logp, old, adv.unsqueeze(-1).expand(2, 3), mask)
    close(loss, 0.6)


def test_config_rejects_dual_clip_at_or_below_one():
    with pytest.raises(ConfigError, match=r"actor\.clip_ratio_c"):
        compose(["+backend=fsdp", "actor.clip_ratio_c=1.0"])


def test_policy_loss_on_policy_equals_minus_mean_advantage():
    # ratio 1 everywhere: loss = -mean(A) over kept tokens = -(1 + 1 - 1) / 3
    logp = torch.full((2, 2), -0.7)
    loss, m = policy_loss(logp, logp.clone(), T([1.0, -1.0]), T([[1, 1], [1, 0]]).float(), loss_agg_mode="token-mean")
    close(loss, (-(1 + 1) + 1) / 3)
    assert m["pg_clipfrac"] == 0.0 and m["ppo_kl"] == 0.0
    assert math.isfinite(loss.item())
