"""docs/design.md's step trace names files and functions that exist; modules and functions stay small; no import loops."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DESIGN = (ROOT / "docs" / "design.md").read_text()


def step_trace(text: str) -> list[tuple[str, str]]:
    """(file, name) of each function the section "One step, as the code runs it" names: the lines
    of its code block, `path/module.py  Name, Class.method, ...`."""
    section = text.split("## One step, as the code runs it", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, flags=re.S).group(1)
    out = []
    for line in block.splitlines():
        file, names = line.split(maxsplit=1)
        out += [(file, name.strip()) for name in names.split(",")]
    return out


def resolve(file: str, name: str):
    """The object `name` (a function, or Class.method) of lorarl's module at `file`."""
    module = "lorarl." + file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


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


def test_a_renamed_function_fails():
    """What the test exists for: a name that is gone is an AttributeError, a file that is gone an ImportError."""
    renamed = step_trace(DESIGN.replace("GRPOTrainer.train_step,", "GRPOTrainer.run_step,", 1))
    assert ("driver/trainer.py", "GRPOTrainer.run_step") in renamed
    with pytest.raises(AttributeError):
        resolve("driver/trainer.py", "GRPOTrainer.run_step")
    with pytest.raises(ImportError):
        resolve("sync/gone.py", "verify")


def test_modules_and_functions_stay_small():
    """The project's size rule: no module of src/, recipes/ or bench/ over 500 lines, no function
    over 100; the bench's code no more than 2,500 lines in all."""
    bench = sum(p.read_text().count("\n") for p in (ROOT / "bench").rglob("*.py"))
    too_long = [f"bench/: {bench} lines"] if bench > 2500 else []
    for path in sorted(p for d in ("src", "recipes", "bench") for p in (ROOT / d).rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(ROOT)
        if text.count("\n") > 500:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                too_long.append(f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports, for src/lorarl and recipes/, every import
    counted (one inside a function or under TYPE_CHECKING too: a loop hidden that way is a loop
    in the design all the same)."""
    files = {}
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "recipes").rglob("*.py")]:
        rel = path.relative_to(ROOT / "src" if "src" in path.relative_to(ROOT).parts[:1] else ROOT)
        files[".".join(rel.with_suffix("").parts).removesuffix(".__init__")] = path
    graph = {}
    for module, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found |= {n for n in names if n in files and n != module}
        graph[module] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import loops of `graph`, each as the modules around it (one per strongly connected part)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
                on.discard(part[-1])
            if len(part) > 1:
                out.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others():
    """The layout reads top to bottom: no loop of imports among the project's modules."""
    graph = import_graph()
    assert "lorarl.files.peft_io" in graph["lorarl.engines.shared_base"]  # an import inside a function is read too
    assert cycles(graph) == []
    # what the test exists for: the schema importing the fault names from sync.faults again, the
    # loop once there (faults -> payload -> experts -> schema -> faults), is found
    graph["lorarl.config.schema"] = graph["lorarl.config.schema"] | {"lorarl.sync.faults"}
    loop = ["lorarl.config.schema", "lorarl.contract.payload", "lorarl.sync.experts", "lorarl.sync.faults"]
    assert cycles(graph) == [loop]
