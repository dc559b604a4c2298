"""Reward functions chosen by a row's data_source, or a user function (data.reward_fn: an import path
or a file, lorarl.rewards.custom).

A reward function maps (solution_str, ground_truth, extra_info) to a float. The trainer hands it the
row's extra_info plus the response's token ids under RESPONSE_IDS, for rewards that score tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from lorarl.errors import ConfigError, DataError
from lorarl.rewards import arith, gsm8k, math_answer, token_share
from lorarl.rewards.custom import custom_reward, load_function

RewardFn = Callable[[str, str, "dict | None"], float]

# The extra_info key under which the trainer passes the response's token ids (a list of ints).
RESPONSE_IDS = "response_ids"

# The data_source names each reward serves: verl's parquet names and ours.
GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
# MATH-style data with boxed answers: MATH (as verl's preprocessing and the hub mirrors name it),
# MATH-500, DAPO-Math, and "math" for files written by scripts/prepare_math.py.
MATH_SOURCES = ("math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math_dapo")


def _gsm8k(reward: Any) -> RewardFn:
    g = reward.gsm8k
    scorer = gsm8k.score_verl if g.scoring == "verl" else gsm8k.score

    def fn(solution: str, ground_truth: str, extra_info: dict | None = None) -> float:
        return scorer(solution, ground_truth, method=g.method)

    return fn


def _math(reward: Any) -> RewardFn:
    timeout_s = reward.math.timeout_s

    def fn(solution: str, ground_truth: str, extra_info: dict | None = None) -> float:
        return math_answer.score(solution, ground_truth, timeout_s=timeout_s)

    return fn


def _arith(reward: Any) -> RewardFn:
    def fn(solution: str, ground_truth: str, extra_info: dict | None = None) -> float:
        return arith.score(solution, ground_truth)

    return fn


def _token_share(reward: Any) -> RewardFn:
    def fn(solution: str, ground_truth: str, extra_info: dict | None = None) -> float:
        return token_share.score((extra_info or {}).get(RESPONSE_IDS), ground_truth)

    return fn


# data_source -> builder of its reward function from the `reward` config section.
REGISTRY: dict[str, Callable[[Any], RewardFn]] = {
    **dict.fromkeys(GSM8K_SOURCES, _gsm8k),
    **dict.fromkeys(MATH_SOURCES, _math),
    "arith": _arith,
    "token_share": _token_share,
}


# Parsers of each source's reference answer, so a bad ground truth fails when the data is
# loaded instead of at the first reward, minutes into a run.
GROUND_TRUTH_PARSERS: dict[str, Callable[[str], Any]] = {
    **dict.fromkeys(GSM8K_SOURCES, gsm8k.parse_ground_truth),
    **dict.fromkeys(MATH_SOURCES, math_answer.parse_ground_truth),
    "arith": arith.parse_ground_truth,
    "token_share": token_share.parse_ground_truth,
}


def check_items(items: Iterable[Any], custom: str | None = None) -> None:
    """Every prompt can be scored: its data_source has a reward function and its ground truth parses.

    `items` carry `index`, `data_source` and `ground_truth` (lorarl.data.dataset.PromptItem).
    A custom function decides for itself what a ground truth means, so only its loading is checked.
    """
    if custom:
        load_function(custom)
        return
    items = list(items)
    for source in dict.fromkeys(item.data_source for item in items):
        get_reward_fn(source)  # once per source: building one reads conf/reward/default.yaml
    for item in items:
        parse = GROUND_TRUTH_PARSERS.get(item.data_source)
        if parse is None:
            continue
        try:
            parse(item.ground_truth)
        except DataError as err:
            raise DataError(f"data row {item.index} (data_source {item.data_source!r}): {err}") from None


def get_reward_fn(
    data_source: str, custom: str | None = None, reward: Any = None, custom_kwargs: Mapping[str, Any] | None = None
) -> RewardFn:
    """The reward function for `data_source`; `custom` (data.reward_fn) overrides the registry.

    `reward` is the config's `reward` section (lorarl.config.schema.RewardConfig); None means its defaults.
    A custom function is called as verl calls one (lorarl.rewards.custom), with `custom_kwargs`
    (data.reward_kwargs) as extra keyword arguments, so reward functions written for verl plug in
    unchanged. Its extra_info carries RESPONSE_IDS too.
    """
    if custom:
        return custom_reward(custom, data_source, custom_kwargs)
    try:
        build = REGISTRY[data_source]
    except KeyError:
        raise ConfigError(
            f"no reward function for data_source {data_source!r}; known: {', '.join(sorted(REGISTRY))}"
            f" (or set data.reward_fn='package.module:function' or 'path/to/file.py:function')"
        ) from None
    if reward is None:
        from lorarl.config.compose import load_group
        from lorarl.config.schema import RewardConfig

        reward = load_group(RewardConfig, "reward/default")
    return build(reward)


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, reward: Any = None
) -> float:
    return get_reward_fn(data_source, reward=reward)(solution_str, ground_truth, extra_info)


__all__ = [
    "GROUND_TRUTH_PARSERS",
    "GSM8K_SOURCES",
    "MATH_SOURCES",
    "REGISTRY",
    "RESPONSE_IDS",
    "RewardFn",
    "check_items",
    "compute_score",
    "get_reward_fn",
]
