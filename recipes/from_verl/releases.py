"""The verl releases whose trainer configs the key table covers, and which of them have a key.

Each release is recipes/verl_data/releases/<tag>.json (written by scripts/extract_verl_keys.py
--releases: every key of ppo_trainer.yaml and ppo_megatron_trainer.yaml at that tag, composed
with their component files), and main is verl_defaults.json at the commit recorded there.
"""

from __future__ import annotations

import json
import re
from functools import cache

from recipes.from_verl.defaults import DATA, verl_defaults


def _version(tag: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", tag))


@cache
def release_keys() -> dict[str, frozenset[str]]:
    """{release: every key of its FSDP and Megatron trainer configs}, oldest first, main last."""
    out = {}
    for path in sorted((DATA / "releases").glob("*.json"), key=lambda p: _version(p.stem)):
        body = json.loads(path.read_text())
        out[body["tag"]] = frozenset(body["fsdp"]) | frozenset(body["megatron"])
    main = verl_defaults()
    out[f"main@{main['commit'][:7]}"] = frozenset(main["fsdp"]) | frozenset(main["megatron"])
    return out


def releases_named() -> str:
    """The releases as a message names them: `v0.3.0.post1 to v0.7.0 and main@b178a3c`."""
    names = list(release_keys())
    return f"{names[0]} to {names[-2]} and {names[-1]}" if len(names) > 2 else " and ".join(names)


def releases_with(key: str) -> list[str]:
    return [release for release, keys in release_keys().items() if key in keys]


def every_release_key() -> frozenset[str]:
    return frozenset().union(*release_keys().values())
