"""docs/design.md's step trace names files and functions that exist; modules and functions stay small.
That no import runs back up or around a loop: tests/test_layers.py."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = (ROOT / "docs" / "design.md").read_text()


def _blocks(text: str) -> list[str]:
    """The code blocks of the section "One step, as the code runs it": the spine, then the trace."""
    section = text.split("## One step, as the code runs it", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```\n(.*?)```", section, flags=re.S)


def step_rows(text: str) -> list[tuple[str, int, list[str]]]:
    """(file, lines, functions) of each line of the step's trace: `path/module.py  N  Name, Class.method, ...`."""
    rows = []
    for line in _blocks(text)[1].splitlines():
        file, lines, names = line.split(maxsplit=2)
        rows.append((file, int(lines), [name.strip() for name in names.split(",")]))
    return rows


def step_trace(text: str) -> list[tuple[str, str]]:
    """(file, name) of each function the step's trace names."""
    return [(file, name) for file, _, names in step_rows(text) for name in names]


def spine(text: str) -> list[tuple[str, int]]:
    """(file, lines) of each line of the spine: `path/module.py  N  what it does`."""
    return [(line.split()[0], int(line.split()[1])) for line in _blocks(text)[0].splitlines()]


def resolve(file: str, name: str):
    """The object `name` (a function, or Class.method) of lorarl's module at `file`."""
    module = "lorarl." + file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def lines_of(file: str, names: list[str]) -> int:
    """The source lines of the functions `names` of `file` (a property's getter), decorators included."""
    objs = [resolve(file, name) for name in names]
    return sum(len(inspect.getsourcelines(o.fget if isinstance(o, property) else o)[0]) for o in objs)


TRACE = step_trace(DESIGN)


def test_the_trace_is_read():
    files = {file for file, _ in TRACE}
    assert (
        len(TRACE) > 50 and {"driver/trainer.py", "workers/worker.py", "engines/fsdp.py", "workers/group.py"} <= files
    )


@pytest.mark.parametrize("file, name", TRACE, ids=[f"{f}:{n}" for f, n in TRACE])
def test_each_named_function_exists(file, name):
    assert (ROOT / "src" / "lorarl" / file).is_file(), f"docs/design.md names {file}, which src/lorarl lacks"
    assert callable(resolve(file, name)) or isinstance(resolve(file, name), property)


def test_the_counts_are_the_functions_lines():
    """Each file's count is the lines of the functions named beside it (python scripts/trace_step.py
    prints both); the spine's counts are the trace's."""
    stale = [
        f"{file}: {n}, its functions have {lines_of(file, names)}"
        for file, n, names in step_rows(DESIGN)
        if n != lines_of(file, names)
    ]
    assert not stale, f"docs/design.md's step trace is stale: {stale}"
    counts = {file: n for file, n, _ in step_rows(DESIGN)}
    assert all(counts.get(file) == n for file, n in spine(DESIGN)), (spine(DESIGN), counts)


def test_a_step_enters_few_files_for_a_few_lines():
    """At most three files of the step are opened for fewer than 15 lines of what it runs."""
    small = [file for file, n, _ in step_rows(DESIGN) if n < 15]
    assert len(small) <= 3, small


def test_a_renamed_function_fails():
    """What the tests exist for: a name that is gone is an AttributeError, a file that is gone an
    ImportError, a count that no longer holds is seen."""
    renamed = step_trace(DESIGN.replace("GRPOTrainer.train_step,", "GRPOTrainer.gone_step,", 1))
    assert ("driver/trainer.py", "GRPOTrainer.gone_step") in renamed
    with pytest.raises(AttributeError):
        resolve("driver/trainer.py", "GRPOTrainer.gone_step")
    with pytest.raises(ImportError):
        resolve("sync/gone.py", "verify")
    file, n, names = step_rows(DESIGN)[0]
    assert lines_of(file, names[1:]) < n


def test_modules_and_functions_stay_small():
    """The project's size rule: no module of src/, recipes/ or bench/ over 500 lines, no function
    over 100; the bench's code no more than 2,700 lines in all (2,500 until the sweep-on-one-base
    benchmark, bench/sweep_shared_base.py, came in at 160: the cap keeps the rest from growing)."""
    bench = sum(p.read_text().count("\n") for p in (ROOT / "bench").rglob("*.py"))
    too_long = [f"bench/: {bench} lines"] if bench > 2700 else []
    for path in sorted(p for d in ("src", "recipes", "bench") for p in (ROOT / d).rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(ROOT)
        if text.count("\n") > 500:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                too_long.append(f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long
