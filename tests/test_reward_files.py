"""data.reward_fn naming a reward file, as verl's custom_reward_function.path does: the file is run
once, its function (verl's default compute_score) is called by verl's keywords with
data.reward_kwargs, and each way it can fail is one line naming the file."""

from __future__ import annotations

import os
import re

import pytest

from lorarl.config.compose import compose
from lorarl.errors import ConfigError
from lorarl.rewards import check_items, get_reward_fn

# A reward file as verl's users write them: a float scorer under verl's default name, a dict one,
# and one whose parameters come in another order (verl calls by keyword, so that works too).
VERL_STYLE = """
import re

CALLS = []


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append(data_source)
    digits = re.findall(r"-?\\d+", solution_str)
    return 1.0 if digits and digits[-1] == ground_truth else 0.25


def with_details(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": len(solution_str) / 10 + bonus, "acc": solution_str == ground_truth}


def reordered(ground_truth, solution_str, extra_info=None, data_source=None):
    return float(ground_truth == solution_str) + (0.5 if data_source == "arith" else 0.0)


def text_score(data_source, solution_str, ground_truth, extra_info=None):
    return "high"


def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}
"""


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(VERL_STYLE)
    return path


def test_the_default_name_is_verls_compute_score(reward_file):
    fn = get_reward_fn("arith", str(reward_file))
    assert (fn("so it is 7", "7", None), fn("so it is 8", "7", None)) == (1.0, 0.25)
    assert get_reward_fn("gsm8k", f"{reward_file}:compute_score")("7", "7", {}) == 1.0


def test_a_dict_score_and_reward_kwargs(reward_file):
    fn = get_reward_fn("arith", f"{reward_file}:with_details", custom_kwargs={"bonus": 2.0})
    assert fn("abcde", "1", None) == 2.5
    assert get_reward_fn("arith", f"{reward_file}:with_details")("abcde", "1", None) == 0.5


def test_called_by_keyword_as_verl_calls_it(reward_file):
    assert get_reward_fn("arith", f"{reward_file}:reordered")("4", "4", None) == 1.5
    assert get_reward_fn("gsm8k", f"{reward_file}:reordered")("4", "5", None) == 0.0


def test_the_file_runs_once_per_process(reward_file):
    import sys

    for source in ("a", "b", "c"):
        get_reward_fn(source, str(reward_file))("1", "1", None)
    (module,) = [m for m in sys.modules.values() if getattr(m, "__file__", None) == str(reward_file)]
    assert module.CALLS[-3:] == ["a", "b", "c"]


def test_a_relative_path_is_read_from_the_working_folder(reward_file, monkeypatch):
    monkeypatch.chdir(reward_file.parent)
    assert get_reward_fn("arith", "./my_reward.py")("7", "7", None) == 1.0


@pytest.mark.parametrize(
    "name, needle",
    [
        ("missing.py", r"data\.reward_fn='.*missing\.py': no file .*missing\.py; give the path of the reward file"),
        (
            "my_reward.py:nope",
            r"my_reward\.py has no function 'nope' \(it defines: compute_score, no_score, reordered, text_score, "
            r"with_details\); name one after ':'",
        ),
        ("broken.py", r"running .*broken\.py failed: ZeroDivisionError: division by zero$"),
        ("syntax.py", r"running .*syntax\.py failed: SyntaxError: "),
    ],
)
def test_a_file_that_cannot_give_the_function_is_one_line(reward_file, name, needle):
    (reward_file.parent / "broken.py").write_text("X = 1\nY = X / 0\n\ndef compute_score(*a, **k):\n    return 1\n")
    (reward_file.parent / "syntax.py").write_text("def compute_score(:\n")
    with pytest.raises(ConfigError) as err:
        check_items([], str(reward_file.parent / name))
    assert re.search(needle, str(err.value)) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "name, needle",
    [
        ("text_score", "text_score returned str 'high' for data_source 'arith'"),
        ("no_score", "no_score returned a dict without a numeric 'score' for data_source 'arith'"),
    ],
)
def test_a_score_of_the_wrong_type_is_one_line(reward_file, name, needle):
    fn = get_reward_fn("arith", f"{reward_file}:{name}")
    with pytest.raises(ConfigError) as err:
        fn("1", "1", None)
    assert needle in str(err.value) and "a number or a dict with a 'score' number" in str(err.value)


def test_reward_kwargs_need_a_reward_function(reward_file):
    with pytest.raises(ConfigError, match="data.reward_kwargs are passed to data.reward_fn only"):
        compose(["+backend=fsdp", "+data.reward_kwargs.bonus=1"])
    run = compose(["+backend=fsdp", f"data.reward_fn={reward_file}:with_details", "+data.reward_kwargs.bonus=1"])
    assert run.data.reward_kwargs == {"bonus": 1} and os.path.isabs(run.data.reward_fn.rpartition(":")[0])
