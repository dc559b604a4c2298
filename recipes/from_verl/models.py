"""A verl model path -> the conf/model preset that trains it.

A path whose checkpoint a preset names gets that preset. Any other Qwen2, Qwen2.5 (Math and
Coder included), Qwen3 or Qwen3-MoE checkpoint gets the preset of its family nearest in size,
with `model.path` set to the script's path: the presets of one family differ only in their
path, activation checkpointing (on from 14B) and tuning, so the nearest size carries the right
shape of setup. Other models need `--model`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Qwen2-7B-Instruct, Qwen2.5-Math-7B, Qwen2.5-Coder-32B-Instruct, Qwen3-30B-A3B-Instruct-2507, ...
QWEN_NAME = re.compile(
    r"^qwen(?P<version>2\.5|2|3)(?:-(?:math|coder))?-(?P<size>\d+(?:\.\d+)?)b(?:-a(?P<active>\d+(?:\.\d+)?)b)?"
    r"(?:-(?:base|instruct|chat|thinking|2507|1m))*$"
)


@dataclass(frozen=True)
class QwenName:
    family: str  # qwen2, qwen2.5, qwen3, qwen3-moe
    size_b: float


def parse_qwen(path: str) -> QwenName | None:
    """The family and size of a Qwen checkpoint from its hub id or folder name; None otherwise."""
    name = path.rstrip("/").rsplit("/", 1)[-1].lower()
    match = QWEN_NAME.match(name)
    if match is None:
        return None
    family = "qwen" + match["version"]
    if match["active"]:
        if family != "qwen3":
            return None  # Qwen2-57B-A14B and Qwen1.5-MoE have no preset family
        family = "qwen3-moe"
    return QwenName(family, float(match["size"]))


@cache
def _preset_paths() -> dict[str, str]:
    """{preset name: model.path} of every conf/model preset, read with OmegaConf (no Hydra) once."""
    from omegaconf import OmegaConf

    out = {}
    for path in sorted((ROOT / "conf" / "model").glob("*.yaml")):
        node = OmegaConf.select(OmegaConf.load(path), "model.path", throw_on_resolution_failure=False)
        if isinstance(node, str) and "${" not in node:
            out[path.stem] = node
    return out


def model_preset(path: str) -> tuple[str | None, bool]:
    """(preset, whether model.path must be set on top of it); (None, False) when none fits."""
    presets = _preset_paths()
    name = path.rstrip("/").rsplit("/", 1)[-1].lower()
    for preset, preset_path in presets.items():
        if preset_path == path or preset_path.rsplit("/", 1)[-1].lower() == name:
            return preset, False
    wanted = parse_qwen(path)
    if wanted is None:
        return None, False
    family = [
        (abs(math.log(q.size_b / wanted.size_b)), preset)
        for preset, preset_path in presets.items()
        if (q := parse_qwen(preset_path)) is not None and q.family == wanted.family
    ]
    return (min(family)[1], True) if family else (None, False)


def preset_names() -> list[str]:
    return sorted(_preset_paths())
