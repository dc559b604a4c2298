"""The two GSM8K scorers on hand-written responses, each expected score worked out by hand.

verl's scorer (as its published GSM8K table was measured): strict takes the FIRST "#### " followed
by exactly one space and a run of [-0-9.,], removes commas and compares the text with the ground
truth string; flexible takes the last run of [-0-9.,] that is not "." alone, commas kept.
lenient: numbers compared by value, "$" and thousands commas allowed, the last "####" wins.
"""

import pytest

from lorarl.config.compose import load_group
from lorarl.config.schema import RewardConfig
from lorarl.rewards import get_reward_fn, gsm8k

REFERENCE = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)

# (response, ground truth, lenient strict, lenient flexible, verl strict, verl flexible)
TABLE = [
    (REFERENCE, "72", 1, 1, 1, 1),
    ("#### 72", "72", 1, 1, 1, 1),
    ("#### $72", "72", 1, 1, 0, 1),  # verl: "$" is not in the strict pattern; flexible finds "72"
    ("#### 72.", "72", 1, 1, 0, 0),  # verl reads "72." whole and compares text
    ("#### 72.00", "72", 1, 1, 0, 0),
    ("So the total is 72.", "72", 0, 1, 0, 0),  # no marker; verl flexible reads "72."
    ("So the total is 72", "72", 0, 1, 0, 1),
    ("#### 71", "72", 0, 0, 0, 0),
    ("#### 72\n#### 71", "72", 0, 0, 1, 0),  # two marker lines: lenient takes the last, verl the first
    ("#### 71\n#### 72", "72", 1, 1, 0, 1),
    ("####72", "72", 1, 1, 0, 1),  # verl strict needs one space after the marker
    ("####  72", "72", 1, 1, 0, 1),  # ... exactly one
    ("#### 1,080", "1080", 1, 1, 1, 0),  # verl flexible keeps the comma
    ("#### 1,080", "1,080", 1, 1, 0, 1),  # verl compares with the ground truth text as given
    ("#### -3", "-3", 1, 1, 1, 1),
    ("#### -$3", "-3", 1, 1, 0, 0),  # verl: "-" must touch the digits; flexible reads "3"
    ("The answer is 72 dollars.", "72", 0, 1, 0, 1),
    ("I am not sure.", "72", 0, 0, 0, 0),
    ("... so 5 + 3 = 8 ...", "8", 0, 1, 0, 0),  # verl flexible: the last run is "..." (not "." alone)
    ("#### 72\nThat is 72.", "72", 1, 1, 1, 0),  # flexible ends on "72."
    ("", "72", 0, 0, 0, 0),
]


@pytest.mark.parametrize("text,truth,lenient_strict,lenient_flexible,verl_strict,verl_flexible", TABLE)
def test_scorer_table(text, truth, lenient_strict, lenient_flexible, verl_strict, verl_flexible):
    assert gsm8k.score(text, truth, method="strict") == lenient_strict
    assert gsm8k.score(text, truth, method="flexible") == lenient_flexible
    assert gsm8k.score_verl(text, truth, method="strict") == verl_strict
    assert gsm8k.score_verl(text, truth, method="flexible") == verl_flexible


@pytest.mark.parametrize(
    "text,method,expected",
    [
        ("#### 1,234.5\n#### 9", "strict", "1234.5"),
        ("#### $5", "strict", None),
        ("#### .", "strict", "."),
        ("a . b", "flexible", "."),  # only "." runs: verl's search ends on the first run
        ("7 . .", "flexible", "7"),
        ("x -4, y", "flexible", "-4,"),
        ("nothing", "flexible", None),
    ],
)
def test_verl_extraction(text, method, expected):
    assert gsm8k.extract_answer_verl(text, method) == expected


def test_verl_format_score_and_unknown_method():
    assert gsm8k.score_verl("#### 8", "7", format_score=0.1) == 0.1
    assert gsm8k.score_verl("no marker 7", "7", format_score=0.1) == 0.0
    with pytest.raises(ValueError):
        gsm8k.extract_answer_verl("#### 1", "loose")


def test_config_picks_the_scorer():
    lenient, verl = load_group(RewardConfig, "reward/default"), load_group(RewardConfig, "reward/default")
    verl.gsm8k.scoring = "verl"
    assert get_reward_fn("openai/gsm8k", reward=lenient)("#### 72.00", "72", None) == 1.0
    assert get_reward_fn("openai/gsm8k", reward=verl)("#### 72.00", "72", None) == 0.0
    verl.gsm8k.method = "flexible"
    assert get_reward_fn("gsm8k", reward=verl)("it is 72", "72", None) == 1.0
