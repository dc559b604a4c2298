"""JSON files as this project writes them: indented, sorted keys; unreadable ones read as None."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=1, sort_keys=True))


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def read_json_if_valid(path: Path) -> dict | None:
    """The JSON object in `path`, or None when the file is missing, unreadable or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
