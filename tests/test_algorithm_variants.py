"""GRPO variants and the rollout-mismatch correction against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from lorarl.algorithms import advantages, losses
from lorarl.algorithms.ppo import clip_range
from lorarl.config.compose import compose
from lorarl.errors import ConfigError

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_seq_mean_token_sum_norm_divides_by_one_constant():
    loss = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    # sums 6 and 4 over both sequences, / 4 (the norm length), no mean over sequences: 10 / 4
    assert losses.agg_loss(loss, MASK, "seq-mean-token-sum-norm", norm_len=4).item() == pytest.approx(2.5)
    # with a global denominator (the constant / dp_size, here 1 rank): the same
    assert losses.agg_loss(loss, MASK, "seq-mean-token-sum-norm", denom=4.0, norm_len=4).item() == pytest.approx(2.5)
    # seq-mean-token-sum would favour neither length either, but does not divide: (6 + 4) / 2
    assert losses.agg_loss(loss, MASK, "seq-mean-token-sum").item() == pytest.approx(5.0)


def test_gspo_ratio_is_one_per_sequence_length_normalised():
    # Seq 0: log-ratios ln2, 0, -ln2 -> mean 0 -> s = 1 for every token. Seq 1: ln(1.5) -> 1.5.
    old = torch.zeros(2, 4)
    logp = torch.tensor([[math.log(2.0), 0.0, -math.log(2.0), 5.0], [math.log(1.5), 5.0, 5.0, 5.0]])
    logp.requires_grad_(True)
    adv = torch.tensor([1.0, 1.0])
    loss, m = losses.policy_loss(
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
    a, _ = losses.policy_loss(logp, old, adv, MASK)
    b, _ = losses.policy_loss(logp, old, adv, MASK, weights=torch.ones(2, 4))
    assert a.item() == b.item()


def test_overlong_penalty_and_group_filter():
    # max 100, buffer 20: free up to 80, then linear to -1 at 100
    assert advantages.overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert advantages.overlong_penalty(90, 100, 20, 1.0) == pytest.approx(-0.5)
    assert advantages.overlong_penalty(100, 100, 20, 0.5) == pytest.approx(-0.5)
    from lorarl.driver.rollouts import PromptGroup

    groups = [PromptGroup(None, [[1]] * 2, [[0.0]] * 2, r) for r in ([1.0, 1.0], [0.0, 1.0], [0.5, 0.5])]
    assert [g.has_signal() for g in groups] == [False, True, False]
    # acc reads the reward function's values: equal scores, different overlong penalties
    g = PromptGroup(None, [[1]] * 2, [[0.0]] * 2, [1.0, 0.5], scores=[1.0, 1.0], overlong=[0.0, -0.5])
    assert g.has_signal("seq_final_reward") and not g.has_signal("acc")


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
    assert clip_range(run.actor) == pytest.approx((expect["clip_low"], expect["clip_high"]))
    assert run.actor.loss_agg_mode == expect["loss_agg_mode"]
    assert run.actor.use_kl_loss is expect["use_kl_loss"]
    assert run.algorithm.norm_adv_by_std_in_grpo is expect["norm"]
    assert run.actor.policy_loss == ("gspo" if name == "gspo" else "vanilla")
    assert run.algorithm.filter_groups.enable is (name == "dapo")
    assert run.algorithm.overlong_buffer.enable is (name == "dapo")


def test_rollout_correction_config_is_checked():
    key = "algorithm.rollout_correction"
    with pytest.raises(ConfigError, match=f"{key}.rollout_is="):
        compose(["+backend=fsdp", f"{key}.rollout_is=tis"])
    with pytest.raises(ConfigError, match="rollout_is_threshold"):
        compose(["+backend=fsdp", f"{key}.rollout_is_threshold=0.5"])
    with pytest.raises(ConfigError, match="rollout_rs_threshold"):
        compose(["+backend=fsdp", f"{key}.rollout_rs=seq_mean_k1"])
    with pytest.raises(ConfigError, match="unknown option"):
        compose(["+backend=fsdp", f"{key}.rollout_rs=seq_max_k1", f"{key}.rollout_rs_threshold=2"])
    with pytest.raises(ConfigError, match="only k1 options take lower_upper"):
        compose(["+backend=fsdp", f"{key}.rollout_rs=token_k3", f"{key}.rollout_rs_threshold=0.5_2.0"])
    with pytest.raises(ConfigError, match="bypass_mode"):
        compose(["+backend=fsdp", f"{key}.bypass_mode=true", f"{key}.rollout_is=token"])
    run = compose(["+backend=fsdp", f"{key}.rollout_rs=seq_mean_k1", f"{key}.rollout_rs_threshold=1.001"])
    assert run.algorithm.rollout_correction.rollout_rs_threshold == "1.001"


def test_gspo_refuses_what_verl_does_not_define():
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        compose(["+backend=fsdp", "algorithm=gspo", "actor.clip_ratio_c=3.0"])
    with pytest.raises(ConfigError, match="seq-mean-token-mean"):
        compose(["+backend=fsdp", "algorithm=gspo", "actor.loss_agg_mode=token-mean"])


def test_dapo_sampling_keys_are_checked():
    assert compose(["+backend=fsdp", "algorithm=dapo"]).algorithm.filter_groups.metric == "acc"
    with pytest.raises(ConfigError, match="filter_groups.metric"):
        compose(["+backend=fsdp", "algorithm=dapo", "algorithm.filter_groups.metric=reward"])
    with pytest.raises(ConfigError, match="gen_batch_size"):
        compose(["+backend=fsdp", "data.gen_batch_size=64"])  # dynamic sampling is off
    with pytest.raises(ConfigError, match="gen_batch_size"):
        compose(["+backend=fsdp", "algorithm=dapo", "data.gen_batch_size=2"])
    run = compose(["+backend=fsdp", "algorithm=dapo", "data.gen_batch_size=24", "algorithm.filter_groups.max_num_gen_batches=0"])  # fmt: skip
    assert run.data.gen_batch_size == 24 and run.algorithm.filter_groups.max_num_gen_batches == 0


def test_auto_importance_weights_are_token_tis_on_cuda_only():
    from lorarl.algorithms.rollout_correction import resolve_is_level

    assert resolve_is_level("auto", "cuda", bypass_mode=False) == "token"
    assert resolve_is_level("auto", "cpu", bypass_mode=False) is None  # the CPU default run is unchanged
    assert resolve_is_level("auto", "cuda", bypass_mode=True) is None  # the ratio is pi / pi_rollout already
    assert resolve_is_level("sequence", "cpu", bypass_mode=False) == "sequence"
    assert compose(["+backend=fsdp"]).algorithm.rollout_correction.rollout_is == "auto"


def test_rollout_correction_by_hand():
    from lorarl.algorithms import rollout_correction as RC

    mask = torch.tensor([[1.0, 1.0, 0.0]])
    rollout = torch.zeros(1, 3)
    # Sequence weights clamp the summed log-ratio: +25 and -24 sum to 1, so w = e^1 (per-token
    # clamping at +-20 would have given e^0 = 1).
    w, _, _ = RC.correct(torch.tensor([[25.0, -24.0, 0.0]]), rollout, mask, "sequence", 3.0)
    assert w[0, :2].tolist() == pytest.approx([math.e, math.e]) and w[0, 2] == 0
    # k1 bounds pi_rollout / pi_trainer: "0.5_4.0" keeps trainer/rollout ratios in [1/4, 2].
    trainer = torch.tensor([[math.log(3.0), -math.log(3.0), 0.0]])
    _, keep, m = RC.correct(trainer, rollout, mask, None, 2.0, RC.parse_rejection("token_k1", "0.5_4.0"))
    assert keep.tolist() == [[0.0, 1.0, 0.0]]  # ratio 3 dropped, ratio 1/3 kept
    assert float(m["rollout_rs_masked_fraction"]) == pytest.approx(0.5)
    # kl is k1: mean(log pi_rollout - log pi_trainer) = -(ln 3 - ln 3) / 2 = 0; k3_kl its k3.
    assert float(m["kl"]) == pytest.approx(0.0, abs=1e-7)
    assert float(m["k3_kl"]) == pytest.approx(((3 - math.log(3) - 1) + (1 / 3 + math.log(3) - 1)) / 2, rel=1e-6)
