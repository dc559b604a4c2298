"""The boxed-answer math reward on hand-written responses; the symbolic check is the real math-verify
in its real child process."""

import threading
import time

import pytest

from lorarl.errors import DataError
from lorarl.rewards import MATH_SOURCES, check_items, get_reward_fn, math_answer
from lorarl.rewards.symbolic import SymbolicChecker

LIMIT = 10.0  # seconds per symbolic check: generous, as the machine may be busy


@pytest.mark.parametrize(
    "text,expected",
    [
        (r"so the answer is $\boxed{5}$.", "5"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces kept
        (r"\boxed{\left\{ 1, \sqrt{2} \right\}}", r"\left\{ 1, \sqrt{2} \right\}"),
        (r"first \boxed{1}, then \boxed{2}", "2"),  # the last box
        (r"\fbox{7}", "7"),
        (r"\boxed{3} or rather \fbox{4}", "4"),
        (r"$\boxed 12$", "12"),  # brace-less form
        (r"\boxed {  9 }", "9"),
        (r"\boxed{\frac{1}{2", None),  # cut off: no answer
        ("the answer is 5", None),
        (r"\boxed", None),
    ],
)
def test_extract_boxed(text, expected):
    assert math_answer.extract_boxed(text) == expected


# (boxed answer, ground truth, right?)
EQUIVALENCE = [
    (r"\frac{1}{2}", r"\frac{1}{2}", True),
    (r"\dfrac{1}{2}", r"\frac{1}{2}", True),
    (r"\tfrac12", r"\frac{1}{2}", True),
    ("1/2", r"\frac{1}{2}", True),
    ("0.5", r"\frac{1}{2}", True),
    (r"\frac{2}{4}", r"\frac{1}{2}", True),
    (r"\frac{1}{3}", r"\frac{1}{2}", False),
    (r"10\text{ cm}", "10", True),
    (r"10 \text{cm}^2", "10", True),
    (r"12 \mbox{ inches}", "12", True),
    (r"25\%", "25", True),
    ("25%", "25", True),
    ("1,000", "1000", True),
    ("1,234,567", "1234567", True),
    ("x = 3", "3", True),
    ("x=3.", "3", True),
    ("3.", "3", True),
    (r"30^\circ", "30", True),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", True),
    (r"2\sqrt{3}", r"\sqrt{12}", True),
    (r"(x+1)^2", "x^2+2x+1", True),
    (r"\text{(B)}", r"\text{(B)}", True),
    (r"\pi", "3.14159", False),
    ("4", "5", False),
    ("-2", "2", False),
    (r"[1, 2)", r"[1, 2]", False),
]


@pytest.mark.parametrize("answer,truth,right", EQUIVALENCE)
def test_equivalence(answer, truth, right):
    assert math_answer.score(rf"Thus the answer is $\boxed{{{answer}}}$.", truth, LIMIT) == (1.0 if right else 0.0)


def test_normalize_spellings():
    assert math_answer.normalize(r" $x = 1,000\text{ cm}.$ ") == "1000"
    assert math_answer.normalize(r"\dfrac12") == r"\frac{1}{2}"
    assert math_answer.normalize(r"\text{(A)}") == "(A)"
    assert math_answer.normalize(r"5\%") == "5"
    assert math_answer.normalize("10{,}000") == "10000"


def test_no_box_scores_zero_and_empty_truth_is_a_data_error():
    assert math_answer.score("The answer is 5.", "5", LIMIT) == 0.0
    with pytest.raises(DataError, match="ground_truth"):
        math_answer.score(r"\boxed{5}", "  ", LIMIT)


def test_pathological_answer_is_stopped_at_the_time_limit_and_the_checker_recovers():
    checker = SymbolicChecker(timeout_s=2.0)
    try:
        assert checker.equivalent("4", "2+2") is True  # started and warm
        t0 = time.monotonic()
        assert checker.equivalent("7", "9^{9^{9^{9}}}") is None
        assert time.monotonic() - t0 < 8.0
        assert checker.timeouts == 1
        assert checker.equivalent(r"\frac{1}{2}", "0.5") is True  # a fresh child took over
    finally:
        checker.close()


def test_reward_works_off_the_main_thread():
    """math-verify's own SIGALRM limit fails outside the main thread; the child-process one does not."""
    got = []
    t = threading.Thread(target=lambda: got.append(math_answer.score(r"\boxed{\dfrac{6}{4}}", "1.5", LIMIT)))
    t.start()
    t.join(60)
    assert got == [1.0]


def test_math_sources_route_to_the_boxed_reward():
    for source in MATH_SOURCES:
        assert get_reward_fn(source)(r"\boxed{\frac{3}{4}}", "0.75", None) == 1.0
        assert get_reward_fn(source)("0.75", "0.75", None) == 0.0


def test_empty_ground_truth_fails_when_data_is_checked():
    class Item:
        index, data_source, ground_truth = 3, "math", ""

    with pytest.raises(DataError, match="row 3"):
        check_items([Item()])
