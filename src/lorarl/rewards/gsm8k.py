"""GSM8K reward: compare the model's final number with the reference answer.

Two scorers, chosen with `reward.gsm8k.scoring`:

- lenient (`score`): numbers compared by value, so "#### 18.", "#### 18.00", "#### $18" and
  "#### 1,000" all count; the last "####" line wins. A forgiving training signal.
- verl (`score_verl`): verl's GSM8K scorer as it was when its published GSM8K baselines were
  measured (Qwen2.5-0.5B-Instruct: PPO 56.7, GRPO-LoRA r32 54.3): the first "#### N" (exactly
  one space after the marker), text compared with the ground truth string. Use it for numbers
  that are put beside that table. verl later switched to the last "####" and to reading only the
  last 300 characters; those changes postdate the table and are not reproduced.

Each has two extraction methods: "strict" trusts only the "#### N" line the prompt asks for (it
also rewards the format); "flexible" takes the last number anywhere.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from lorarl.errors import DataError

# A sign may sit on either side of a dollar sign ("-$5", "$-5"). Thousands separators
# must group by three so "72, and 3" reads as 72 then 3, not 723.
_NUMBER = r"(?:(?<!\d)-)?\$?\s?-?\d+(?:,\d{3})*(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_STRICT_RE = re.compile(r"####\s*(" + _NUMBER + ")")


def normalize_number(text: str) -> str | None:
    """Canonical form of one number ("$1,000.00" -> "1000", "-7.50" -> "-7.5"); None if not a number."""
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "")
    negative = cleaned.count("-") % 2 == 1
    cleaned = cleaned.replace("-", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite() or not re.fullmatch(r"\d+(?:\.\d+)?", cleaned):
        return None
    if negative and value != 0:
        value = -value
    # normalize() alone gives "1E+3" for 1000; quantize integers so the text stays plain.
    if value == value.to_integral_value():
        return str(value.quantize(Decimal(1)))
    return format(value.normalize(), "f")


def extract_answer(text: str, method: str = "strict") -> str | None:
    if method == "strict":
        found = _STRICT_RE.findall(text)
    elif method == "flexible":
        found = _NUMBER_RE.findall(text)
    else:
        raise ValueError(f"gsm8k extract method must be 'strict' or 'flexible', got {method!r}")
    if not found:
        return None
    return normalize_number(found[-1])


def parse_ground_truth(ground_truth: str) -> str:
    """The reference answer as a canonical number; a non-number is a data error, not a zero reward."""
    truth = normalize_number(str(ground_truth))
    if truth is None:
        raise DataError(
            f"gsm8k ground_truth {ground_truth!r} is not a number; check reward_model.ground_truth in the data"
        )
    return truth


def score(
    solution: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    truth = parse_ground_truth(ground_truth)
    answer = extract_answer(solution, method)
    if answer is None:
        return 0.0
    return score if Decimal(answer) == Decimal(truth) else format_score


# verl's patterns: a number is any run of digits, dots and commas with an optional leading minus,
# so "18." and "1,080" are taken whole; nothing allows "$" or more than one space after "####".
_VERL_STRICT_RE = re.compile(r"#### (-?[0-9.,]+)")
_VERL_NUMBER_RE = re.compile(r"-?[0-9.,]+")


def extract_answer_verl(text: str, method: str = "strict") -> str | None:
    """The answer text verl's scorer compares, unnormalized; None when it finds none.

    strict: the first "#### N", commas removed. flexible: the last number-like run that is not
    "." alone, commas kept; when every run is ".", verl ends its search on the first one.
    """
    if method == "strict":
        found = _VERL_STRICT_RE.search(text)
        return None if found is None else found.group(1).replace(",", "")
    if method == "flexible":
        runs = _VERL_NUMBER_RE.findall(text)
        if not runs:
            return None
        real = [r for r in runs if r != "."]
        return real[-1] if real else runs[0]
    raise ValueError(f"gsm8k extract method must be 'strict' or 'flexible', got {method!r}")


def score_verl(solution: str, ground_truth: str, method: str = "strict", **scores: float) -> float:
    """verl's GSM8K score: the extracted text must equal the ground truth string exactly.
    `scores`: score (1.0) and format_score (0.0), as `score` takes them."""
    answer = extract_answer_verl(solution, method)
    if answer is None:
        return 0.0
    return scores.get("score", 1.0) if answer == str(ground_truth) else scores.get("format_score", 0.0)
