"""GSM8K reward: compare the model's final number with the reference answer.

"strict" trusts only the "#### N" line the prompt asks for (it also rewards the format);
"flexible" takes the last number anywhere, useful for models that ignore the format.
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
