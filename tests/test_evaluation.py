"""Validation metrics against numbers worked out by hand (the arithmetic is in the comments)."""

import pytest

from lorarl.config.compose import load_group
from lorarl.config.schema import RewardConfig
from lorarl.data.dataset import PromptItem
from lorarl.driver.evaluation import accuracy, k_values, pass_at_k, validation_metrics


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (4, 1, 1, 1 / 4),  # pass@1 = c / n
        (4, 1, 2, 1 - 3 / 6),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 1 - 1 / 6),  # 1 - C(2,2)/C(4,2)
        (4, 1, 4, 1.0),  # all four drawn: the right one is among them
        (4, 0, 4, 0.0),
        (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (8, 3, 4, 1 - 5 / 70),  # 1 - C(5,4)/C(8,4) = 1 - 5/70
        (10, 10, 1, 1.0),
    ],
)
def test_pass_at_k_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in ((4, 5, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_k_values():
    assert k_values(1) == [1]
    assert k_values(4) == [1, 2, 4]
    assert k_values(5) == [1, 2, 4, 5]
    assert k_values(16) == [1, 2, 4, 8, 16]


def test_accuracy_mean_and_pass_at_k():
    # prompt 1: 1 of 4 right; prompt 2: none (0.5 is format credit, not right); prompt 3: all
    scores = [[1.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.5], [1.0, 1.0, 1.0, 1.0]]
    out = accuracy(scores, "x", "acc")
    assert set(out) == {"val/x/acc/mean@4", "val/x/acc/pass@1", "val/x/acc/pass@2", "val/x/acc/pass@4"}
    assert out["val/x/acc/mean@4"] == pytest.approx((0.25 + 0.0 + 1.0) / 3)
    assert out["val/x/acc/pass@1"] == pytest.approx((0.25 + 0.0 + 1.0) / 3)
    assert out["val/x/acc/pass@2"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert out["val/x/acc/pass@4"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="same number"):
        accuracy([[1.0, 0.0], [1.0]], "p", "acc")


def item(source: str, truth: str) -> PromptItem:
    return PromptItem(index=0, prompt_ids=[1], data_source=source, ground_truth=truth)


def test_validation_metrics_per_source_with_both_gsm8k_scorers():
    items = [item("openai/gsm8k", "72"), item("openai/gsm8k", "5"), item("math", r"\frac{1}{2}"), item("arith", "9")]
    texts = [
        ["#### 72.00", "#### 72"],  # lenient: 2 right; verl strict: 1 ("72.00" is not "72")
        ["it is 5", "#### 4"],  # strict: 0 right; flexible: 1 (lenient and verl both read "5")
        [r"\boxed{0.5}", "no box"],  # 1 of 2
        ["9", "9"],
    ]
    out = validation_metrics(items, texts, load_group(RewardConfig, "reward/default"))
    g = "val/openai/gsm8k"
    assert out[f"{g}/acc/mean@2"] == pytest.approx((2 / 2 + 0 / 2) / 2)
    assert out[f"{g}/acc/pass@2"] == pytest.approx((1 + 0) / 2)
    assert out[f"{g}/acc_verl/mean@2"] == pytest.approx((1 / 2 + 0) / 2)
    assert out[f"{g}/acc_flexible/mean@2"] == pytest.approx((1 + 1 / 2) / 2)
    # verl flexible: "72.00" is not "72" text; "it is 5" gives "5", "#### 4" gives "4"
    assert out[f"{g}/acc_verl_flexible/mean@2"] == pytest.approx((1 / 2 + 1 / 2) / 2)
    assert out[f"{g}/reward/mean"] == pytest.approx(2 / 4)
    assert out["val/math/acc/mean@2"] == pytest.approx(0.5)
    assert out["val/math/acc/pass@1"] == pytest.approx(0.5)
    assert out["val/math/acc/pass@2"] == pytest.approx(1.0)
    assert "val/math/acc_verl/mean@2" not in out
    assert out["val/arith/acc/mean@2"] == 1.0
    assert out["val/acc"] == pytest.approx((0.5 + 0.5 + 1.0) / 3)


def test_validation_metrics_with_verl_as_the_configured_scorer():
    reward = load_group(RewardConfig, "reward/default")
    reward.gsm8k.scoring = "verl"
    out = validation_metrics([item("gsm8k", "72")], [["#### 72.00"]], reward)
    assert out["val/gsm8k/acc/mean@1"] == 0.0 and out["val/gsm8k/acc_verl/mean@1"] == 0.0
    assert out["val/gsm8k/acc_flexible/mean@1"] == 0.0  # verl flexible reads "72.00"
    assert (
        validation_metrics([item("gsm8k", "72")], [["#### 72.00"]], load_group(RewardConfig, "reward/default"))[
            "val/gsm8k/acc/mean@1"
        ]
        == 1.0
    )


def test_validation_metrics_with_a_custom_reward_still_logs_verl_accuracy(tmp_path, monkeypatch):
    (tmp_path / "always_one.py").write_text(
        "def fn(data_source, solution_str, ground_truth, extra_info=None):\n    return 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = validation_metrics(
        [item("gsm8k", "72")], [["#### 71"]], load_group(RewardConfig, "reward/default"), custom="always_one:fn"
    )
    assert out["val/gsm8k/acc/mean@1"] == 1.0 and out["val/gsm8k/acc_verl/mean@1"] == 0.0


def test_validation_metrics_needs_one_response_list_per_prompt():
    with pytest.raises(ValueError, match="2 prompts but 1"):
        validation_metrics(
            [item("arith", "1"), item("arith", "2")], [["1"]], load_group(RewardConfig, "reward/default")
        )
