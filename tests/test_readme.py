"""The README is a manual: its commands compose as written, and the verl table (docs/from_verl.md) is the code's."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from lorarl.config.compose import compose
from recipes.from_verl import markdown_table

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def recipe_commands() -> list[str]:
    """Every single-run `python -m recipes.grpo ...` line of the README's bash blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(("python -m recipes.grpo", ".venv/bin/python -m recipes.grpo"))]


@pytest.mark.parametrize("command", [c for c in recipe_commands() if " -m +" not in c])
def test_readme_commands_compose(command):
    overrides = [a for a in shlex.split(command.split("recipes.grpo", 1)[1]) if not a.startswith("--")]
    compose(overrides)


def test_readme_has_its_commands():
    assert len(recipe_commands()) >= 4


def test_readme_verl_table_is_the_code_table():
    assert "docs/from_verl.md" in README
    assert markdown_table() in (ROOT / "docs" / "from_verl.md").read_text(), (
        "docs/from_verl.md's table differs from recipes/from_verl/keys.py VERL_KEYS: "
        "paste the output of python -c 'from recipes.from_verl import markdown_table; print(markdown_table())'"
    )
