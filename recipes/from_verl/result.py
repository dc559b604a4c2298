"""What a translation produces (Translation, and the Difference rows of `--check`'s table) and
how it reads and writes override values as Hydra does."""

from __future__ import annotations

import copy
import math
import re
import sys
from dataclasses import dataclass, field
from functools import cache, lru_cache

from hydra.core.override_parser.overrides_parser import OverridesParser


@dataclass
class Difference:
    """A key whose lorarl value means something other than verl's, for `--check`'s table."""

    verl: str
    verl_value: str
    lorarl: str
    lorarl_value: str
    why: str


@dataclass
class Translation:
    overrides: list[str]
    ignored: list[tuple[str, str, str]]  # (verl key, value, reason)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    carried: list[tuple[str, str]] = field(default_factory=list)  # (verl key, the override carrying its default)
    differences: list[Difference] = field(default_factory=list)
    backend: str = "fsdp"
    # verl's sequence splits lorarl does without ({verl key: size}): --check estimates their cost.
    splits: dict[str, int] = field(default_factory=dict)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "recipes.grpo", *self.overrides]


def parsed(value: str):
    """The value Hydra (verl's config system too) gives `key=value` (a copy: callers may keep it)."""
    return copy.deepcopy(_parsed(value))


@lru_cache(maxsize=4096)
def _parsed(value: str):
    return _parser().parse_overrides([f"k={value}"])[0].value()


@cache
def _parser() -> OverridesParser:
    return OverridesParser.create()


def render(value) -> str:
    """A Python value as a Hydra override value (quoted unless Hydra reads it bare; `~` needs quotes)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(render(v) for v in value) + "]"
    text = str(value)
    return text if re.fullmatch(r"[A-Za-z_/.][\w./-]*", text) and text not in ("null", "true", "false") else repr(text)


def same(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool | None):
        return not isinstance(b, bool) and math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
