"""Reward for MATH-style problems: the last \\boxed{...} (or \\fbox{...}) of the response must
equal the reference answer.

Equal means: the same after light normalization (done here, in-process, for the common case),
or else symbolically equivalent by math-verify, which runs in a child process under a time limit
(lorarl.rewards.symbolic). A response without a complete box scores 0; so does an answer whose
check runs out of time.
"""

from __future__ import annotations

import re

from lorarl.errors import DataError
from lorarl.rewards.symbolic import checker

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...}, nested braces kept; None if absent or cut off.

    Also reads the brace-less form "\\boxed 5" (up to the next space or "$").
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    i = start + next(len(c) for c in _BOX_COMMANDS if text.startswith(c, start))
    if i < len(text) and text[i] == " ":
        rest = text[i:].lstrip(" ")
        if not rest.startswith("{"):
            token = re.match(r"[^\s$]+", rest)
            return token.group(0) if token else None
        i = len(text) - len(rest)
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # the box was never closed: a truncated response has no answer


# Unit words after a number ("10\text{ cm}", "12 \mbox{inches}"); a \text{} standing alone is an answer.
_TRAILING_TEXT = re.compile(r"(?<=\S)\s*\\(?:text|mbox|mathrm)\{[^{}]*\}(?:\^\{?\d\}?)?$")
_WRAPPING_TEXT = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}$")
_LEADING_VARIABLE = re.compile(r"^[a-zA-Z](?:_\{?\w+\}?)?\s*=\s*(?=\S)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_SPACING = re.compile(r"\\[!,;: ]|\\quad|\\qquad|\\left|\\right")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?")


def normalize(answer: str) -> str:
    """A canonical spelling for the fast exact comparison; equivalence beyond this is math-verify's job."""
    s = answer.strip()
    s = s.strip("$").strip().rstrip(".").strip()
    s = _TRAILING_TEXT.sub("", s)
    wrapped = _WRAPPING_TEXT.match(s)
    if wrapped:
        s = wrapped.group(1)
    s = _SPACING.sub("", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "")
    s = _LEADING_VARIABLE.sub("", s)
    s = _THOUSANDS.sub("", s.replace("{,}", ","))
    s = s.rstrip(".").strip()
    s = re.sub(r"\s+", "", s)
    # \frac12 and \frac{1}{2} are one number.
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    return s


def parse_ground_truth(ground_truth: str) -> str:
    truth = str(ground_truth).strip()
    if not truth:
        raise DataError("math ground_truth is empty; check reward_model.ground_truth in the data")
    return truth


def is_equivalent(answer: str, truth: str, timeout_s: float) -> bool:
    """Same after normalization, or equivalent by math-verify within timeout_s (an overrun is False)."""
    if normalize(answer) == normalize(truth):
        return True
    return checker(timeout_s).equivalent(truth, answer) is True


def score(solution: str, ground_truth: str, timeout_s: float) -> float:
    truth = parse_ground_truth(ground_truth)
    answer = extract_boxed(solution)
    if answer is None:
        return 0.0
    return 1.0 if is_equivalent(answer, truth, timeout_s) else 0.0
