"""The house reads top to bottom: every import of the project goes to its own package or to one
ranked below it, so no package imports another through a loop.

LAYERS is the order, once, top to bottom. A row holds packages (or leaf modules) of one rank;
those of one row do not import each other (the training engines and the rollout are built
side by side, each below the workers that hold both). recipes/ and bench/ sit above the library
and may use any of it; nothing of the library uses them. Every import counts: at module level,
inside a function, and under `if TYPE_CHECKING:` (a type the code names is a dependency of the
design all the same).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: list[tuple[str, ...]] = [
    ("recipes", "bench"),  # what a user runs: the GRPO recipe, the verl translator, the benchmarks
    ("lorarl.driver",),  # the run on the driver: checks, specs, the step loop
    ("lorarl.workers",),  # Ray actors holding the devices, and the groups that call them
    ("lorarl.engines", "lorarl.rollout"),  # the training engines; vLLM and its sleep
    ("lorarl.sync",),  # the weight sync and its checks
    ("lorarl.algorithms",),  # the PPO update, its losses, advantages, the rollout correction
    ("lorarl.contract",),  # what the parts agree on: Engine, TrainBatch, WeightPayload, messages, specs
    ("lorarl.models",),  # the embedded tiny model
    ("lorarl.data",),  # prompts and the generated tasks
    ("lorarl.rewards",),  # scoring a response
    ("lorarl.config",),  # the typed config and its checks
    ("lorarl.telemetry", "lorarl.files"),  # where metrics go; what is written to disk
    ("lorarl.metrics", "lorarl.errors"),  # the logged keys; the errors a user sees
]
RANK = {unit: rank for rank, row in enumerate(LAYERS) for unit in row}


def unit_of(module: str) -> str | None:
    """The LAYERS entry a module belongs to: the longest entry that is the module or a package above it."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RANK:
            return ".".join(parts[:n])
    return None


def modules() -> dict[str, Path]:
    """Every Python module of src/lorarl, recipes/ and bench/, by its dotted name."""
    out = {}
    for base, top in ((ROOT / "src", "lorarl"), (ROOT, "recipes"), (ROOT, "bench")):
        for path in (base / top).rglob("*.py"):
            out[".".join(path.relative_to(base).with_suffix("").parts).removesuffix(".__init__")] = path
    out.pop("lorarl")  # the root package: empty (test_the_root_package_is_empty)
    return out


def imported(module: str, path: Path) -> set[str]:
    """The dotted names `module` imports anywhere in its file (absolute and relative imports)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return found


def module_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (`from package import name` counts the module
    `name` when it is one, else the package)."""
    files = modules()
    graph = {}
    for module, path in files.items():
        names = imported(module, path)
        graph[module] = {n if n in files else n.rpartition(".")[0] for n in names} & set(files) - {module}
    return graph


def unit_graph(graph: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """LAYERS entry -> the entries it imports (itself left out)."""
    units: dict[str, set[str]] = {unit: set() for unit in RANK}
    for module, targets in (graph or module_graph()).items():
        units[unit_of(module)] |= {unit_of(t) for t in targets} - {unit_of(module)}
    return units


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every edge that does not go strictly down the ranks: `a -> b` where b ranks level with a or above."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if RANK[b] <= RANK[a])


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import loops of `graph`: its strongly connected parts of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_rank():
    assert [m for m in modules() if unit_of(m) is None] == []
    assert {unit_of(m) for m in modules()} == set(RANK), "a LAYERS entry that holds no module"


def test_the_root_package_is_empty():
    """`import lorarl` runs nothing: each package is imported for itself."""
    assert ast.parse((ROOT / "src" / "lorarl" / "__init__.py").read_text()).body == []


def test_no_import_runs_back_up():
    assert upward(unit_graph()) == []


def test_no_package_loop():
    assert loops(unit_graph()) == []


def test_no_module_imports_itself_through_others():
    """Within a package, too: no loop of imports among modules."""
    assert loops(module_graph()) == []


def test_a_config_that_reaches_up_is_found():
    """What the tests above exist for, on the real graph: the schema importing the fault names
    from sync.faults again (the loop once there) is an upward edge and a loop of two modules."""
    graph = module_graph()
    assert "lorarl.files.peft_io" in graph["lorarl.driver.base_plan"]  # an import inside a function is read
    graph["lorarl.config.schema"] = graph["lorarl.config.schema"] | {"lorarl.sync.faults"}
    assert upward(unit_graph(graph)) == ["lorarl.config -> lorarl.sync"]
    assert loops(graph) == [["lorarl.config.schema", "lorarl.sync.faults"]]


def test_imports_in_functions_and_under_type_checking_are_read(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from lorarl.driver.trainer import GRPOTrainer\n"
        "def f():\n    from ..errors import ConfigError\n    import lorarl.metrics\n"
    )
    assert imported("lorarl.sync.m", path) >= {"lorarl.driver.trainer", "lorarl.errors", "lorarl.metrics"}


@pytest.mark.parametrize(
    ("edges", "up", "loop"),
    [
        # the config asking a backend and the rollout, as config/validate.py once did
        (
            {"lorarl.config": {"lorarl.engines", "lorarl.rollout"}},
            ["lorarl.config -> lorarl.engines", "lorarl.config -> lorarl.rollout"],
            [],
        ),
        # the engines importing the sync while the sync reaches the engines' protocol: a loop of two
        (
            {"lorarl.engines": {"lorarl.sync"}, "lorarl.sync": {"lorarl.engines"}},
            ["lorarl.sync -> lorarl.engines"],
            [["lorarl.engines", "lorarl.sync"]],
        ),
        # siblings of one row importing each other
        ({"lorarl.rollout": {"lorarl.engines"}}, ["lorarl.rollout -> lorarl.engines"], []),
        # downward only: nothing to find
        ({"lorarl.driver": {"lorarl.workers"}, "lorarl.workers": {"lorarl.sync"}}, [], []),
    ],
)
def test_the_checks_see_an_upward_edge_and_a_loop(edges, up, loop):
    """What the tests above exist for, on small graphs of LAYERS' entries."""
    graph = {unit: set() for unit in RANK} | edges
    assert upward(graph) == up
    assert loops(graph) == loop
