"""Reward for the embedded addition task: the last integer in the response must equal the sum."""

from __future__ import annotations

import re

from lorarl.errors import DataError

_INT_RE = re.compile(r"-?\d+")


def parse_ground_truth(ground_truth: str) -> int:
    try:
        return int(str(ground_truth).strip())
    except ValueError:
        raise DataError(
            f"arith ground_truth {ground_truth!r} is not an integer; check reward_model.ground_truth in the data"
        ) from None


def score(solution: str, ground_truth: str) -> float:
    truth = parse_ground_truth(ground_truth)
    found = _INT_RE.findall(solution)
    return 1.0 if found and int(found[-1]) == truth else 0.0
