import sys

import pytest

from lorarl.errors import ConfigError, DataError
from lorarl.rewards import arith, compute_score, get_reward_fn, gsm8k


@pytest.mark.parametrize(
    "text,method,expected",
    [
        ("48/2 = 24\n#### 72", "strict", "72"),
        ("#### 3\nwait, no.\n#### 5", "strict", "5"),  # last marker wins
        ("#### 1,000", "strict", "1000"),
        ("####$5", "strict", "5"),
        ("#### 7.00", "strict", "7"),
        ("#### -3", "strict", "-3"),
        ("#### -$12.50", "strict", "-12.5"),
        ("#### $-4", "strict", "-4"),
        ("the answer is 72", "strict", None),
        ("no numbers here", "flexible", None),
        ("She has 3 apples and 1,234 pears.", "flexible", "1234"),
        ("So it costs $18.", "flexible", "18"),
        ("total 72, and 3", "flexible", "3"),
        ("10 - 5 = 5.0", "flexible", "5"),
        ("temperature went to -7", "flexible", "-7"),
    ],
)
def test_extract_answer(text, method, expected):
    assert gsm8k.extract_answer(text, method) == expected


def test_extract_answer_rejects_unknown_method():
    with pytest.raises(ValueError):
        gsm8k.extract_answer("#### 1", "loose")


def test_gsm8k_score_numeric_comparison():
    assert gsm8k.score("#### 1,000", "1000") == 1.0
    assert gsm8k.score("#### 1000", "1,000") == 1.0
    assert gsm8k.score("#### $5", "5") == 1.0
    assert gsm8k.score("#### 7.0", "7") == 1.0
    assert gsm8k.score("#### 7", "7.00") == 1.0
    assert gsm8k.score("#### -2", "2") == 0.0
    assert gsm8k.score("#### 8", "7") == 0.0


def test_gsm8k_score_format_score_and_methods():
    assert gsm8k.score("#### 8", "7", format_score=0.1) == 0.1
    assert gsm8k.score("the answer is 7", "7", format_score=0.1) == 0.0  # nothing extracted
    assert gsm8k.score("the answer is 7", "7", method="flexible") == 1.0
    assert gsm8k.score("#### 7", "7", score=2.5) == 2.5


def test_gsm8k_non_numeric_ground_truth_names_value():
    with pytest.raises(DataError, match="seven"):
        gsm8k.score("#### 7", "seven")


def test_arith_score():
    assert arith.score("12", "12") == 1.0
    assert arith.score("3 + 9 = 12", "12") == 1.0
    assert arith.score("12 or maybe 13", "12") == 0.0
    assert arith.score("", "12") == 0.0
    assert arith.score("-4", "-4") == 1.0
    with pytest.raises(DataError, match="twelve"):
        arith.score("12", "twelve")


def test_registry_dispatch():
    assert get_reward_fn("openai/gsm8k")("x\n#### 72", "72", None) == 1.0
    assert get_reward_fn("gsm8k")("x\n#### 71", "72", None) == 0.0
    assert get_reward_fn("arith")("9", "9", {"split": "train"}) == 1.0
    assert compute_score("arith", "8", "9") == 0.0
    assert compute_score("openai/gsm8k", "#### 2,000", "2000") == 1.0


def test_unknown_data_source_names_it_and_known_ones():
    with pytest.raises(ConfigError, match=r"'math500'.*arith.*gsm8k.*openai/gsm8k"):
        get_reward_fn("math500")


def test_custom_reward_fn_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_reward(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return len(solution_str) + (100 if data_source == 'anything' else 0)\n"
        "def dict_reward(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': extra_info['w'], 'acc': True}\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    fn = get_reward_fn("anything", custom="my_rewards:length_reward")
    assert fn("abcd", "x", None) == 104.0
    assert get_reward_fn("arith", custom="my_rewards:dict_reward")("1", "1", {"w": 0.25}) == 0.25
    for bad in ("my_rewards", "my_rewards:missing", "my_rewards:NOT_CALLABLE", "no_such_mod_xyz:f", ":f"):
        with pytest.raises(ConfigError, match=r"data\.reward_fn"):
            get_reward_fn("arith", custom=bad)
