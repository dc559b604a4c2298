"""The released Megatron-Bridge / megatron-core sources, for tests on a CPU machine.

Neither imports here (Megatron-Bridge needs Python 3.12 and TransformerEngine; megatron-core
needs CUDA to do anything), so tests read the real wheels instead:
`pip download --no-deps` once into the pytest cache (or a folder named by
LORARL_MEGATRON_WHEELS), unzip, and
- list a class's methods and their signatures with `ast` (inherited ones included), so a
  stand-in object can offer exactly those and bind every call against the real signature;
- extract pure functions (tensor layout helpers) and execute their real source.
When neither the folder nor PyPI is reachable the callers skip, saying why.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

WHEELS = {"megatron-bridge": "0.6.2", "megatron-core": "0.19.2"}


class SourcesUnavailable(RuntimeError):
    pass


@cache
def fetch(cache_dir: str) -> Path:
    """Directory with one unpacked tree per wheel: <root>/<dist>/<package files>."""
    root = Path(cache_dir)
    wheel_dir = Path(os.environ.get("LORARL_MEGATRON_WHEELS", root / "wheels"))
    wheel_dir.mkdir(parents=True, exist_ok=True)
    missing = [d for d, v in WHEELS.items() if not list(wheel_dir.glob(f"{d.replace('-', '_')}-{v}-*.whl"))]
    if missing:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
            "--python-version", "3.12", "--only-binary=:all:", "-d", str(wheel_dir),
            *[f"{d}=={WHEELS[d]}" for d in missing],
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SourcesUnavailable(f"pip download of {missing} failed: {e}") from e
        if proc.returncode != 0:
            raise SourcesUnavailable(f"pip download of {missing} failed: {proc.stderr.strip().splitlines()[-1:]}")
    src = root / "src"
    for dist, version in WHEELS.items():
        target = src / dist
        if (target / ".done").exists():
            continue
        (wheel,) = wheel_dir.glob(f"{dist.replace('-', '_')}-{version}-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(target)
        (target / ".done").write_text(wheel.name)
    return src


# ---------------------------------------------------------------------------------------------
# Classes: methods, signatures, dataclass fields
# ---------------------------------------------------------------------------------------------


@dataclass
class ClassInfo:
    name: str
    path: Path
    node: ast.ClassDef
    bases: list[str]


@dataclass
class Api:
    """What the real class offers: callables with their signatures, properties, fields."""

    qualname: str
    methods: dict[str, inspect.Signature] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # name -> instance|classmethod|staticmethod|property
    fields: list[str] = field(default_factory=list)  # annotated class attributes (dataclass fields)

    @property
    def names(self) -> set[str]:
        return set(self.methods) | set(self.fields)


@cache
def _texts(tree_root: str) -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8", errors="replace") for p in Path(tree_root).rglob("*.py")}


@cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


@cache
def _classes_named(tree_root: str, name: str) -> tuple[ClassInfo, ...]:
    # Parsing ~1500 files takes seconds; only files whose text defines the class are parsed.
    pattern = re.compile(rf"^class {re.escape(name)}\b", re.M)
    out = []
    for path, text in _texts(tree_root).items():
        if not pattern.search(text):
            continue
        for node in _parse(path).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                out.append(ClassInfo(node.name, path, node, [_base_name(b) for b in node.bases]))
    return tuple(out)


def _base_name(b: ast.expr) -> str:
    if isinstance(b, ast.Name):
        return b.id
    if isinstance(b, ast.Attribute):
        return b.attr
    if isinstance(b, ast.Subscript) and isinstance(b.value, ast.Name):
        return b.value.id
    return ""


def _find(roots: list[Path], name: str, hint: Path | None) -> ClassInfo | None:
    """The class `name` defined in `hint` (or the module `hint` imports it from), else the
    only class of that name under `roots`."""
    candidates = [c for r in roots for c in _classes_named(str(r), name)]
    if hint is not None:
        same = [c for c in candidates if c.path == hint]
        if same:
            return same[0]
        origin = _imported_from(roots, hint, name)
        same = [c for c in candidates if origin is not None and c.path == origin]
        if same:
            return same[0]
    return candidates[0] if len(candidates) == 1 else None


def _imported_from(roots: list[Path], module: Path, name: str) -> Path | None:
    """File a module imports `name` from; roots are unpacked wheel directories."""
    for node in ast.parse(module.read_text(encoding="utf-8")).body:
        if not (isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names)):
            continue
        parts = [p for p in (node.module or "").split(".") if p]
        if node.level:
            bases = [module.parents[node.level - 1]]
        else:
            bases = list(roots)
        for base in bases:
            target = base.joinpath(*parts)
            for cand in (target.with_suffix(".py"), target / "__init__.py"):
                if cand.exists():
                    return cand
    return None


def class_api(roots: list[Path], path: Path, class_name: str) -> Api:
    """Methods (own and inherited from classes found under `roots`, the unpacked wheel
    directories) of `class_name` in `path`."""
    start = _find(roots, class_name, path)
    if start is None:
        raise LookupError(f"class {class_name} not found in {path}")
    api = Api(f"{start.path.name}:{class_name}")
    seen: set[str] = set()

    def visit(info: ClassInfo) -> None:
        if info.name in seen:
            return
        seen.add(info.name)
        for node in info.node.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in api.methods:
                decos = {
                    d.id if isinstance(d, ast.Name) else d.attr if isinstance(d, ast.Attribute) else ""
                    for d in node.decorator_list
                }
                kind = (
                    "classmethod"
                    if "classmethod" in decos
                    else "staticmethod"
                    if "staticmethod" in decos
                    else "property"
                    if "property" in decos or "cached_property" in decos
                    else "instance"
                )
                api.methods[node.name] = _signature(
                    node.args, drop_first=kind in ("instance", "classmethod", "property")
                )
                api.kinds[node.name] = kind
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if node.target.id not in api.fields:
                    api.fields.append(node.target.id)
        for base in info.bases:
            if base in ("", "object", "ABC", "Generic", "Protocol", "NamedTuple"):
                continue
            parent = _find(roots, base, info.path)
            if parent is not None:
                visit(parent)

    visit(start)
    return api


_REQUIRED = object()


def _signature(args: ast.arguments, drop_first: bool) -> inspect.Signature:
    P = inspect.Parameter
    params: list[inspect.Parameter] = []
    positional = [(a, P.POSITIONAL_ONLY) for a in args.posonlyargs] + [(a, P.POSITIONAL_OR_KEYWORD) for a in args.args]
    defaults = [_REQUIRED] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for (a, kind), d in zip(positional, defaults):
        params.append(P(a.arg, kind, default=P.empty if d is _REQUIRED else _Default(ast.unparse(d))))
    if drop_first and params:
        params = params[1:]
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        params.append(P(a.arg, P.KEYWORD_ONLY, default=P.empty if d is None else _Default(ast.unparse(d))))
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


class _Default:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def spec_object(api: Api, impls: dict[str, Callable[..., Any]], calls: list[tuple[str, inspect.BoundArguments]]) -> Any:
    """An object with exactly the real class's methods; each call is bound against the real
    signature (TypeError on a wrong keyword), recorded, and answered by `impls[name]` (real
    tensors built by the test). A method the real class lacks is an AttributeError."""

    def make(name: str, sig: inspect.Signature) -> Callable[..., Any]:
        def method(self, *args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            calls.append((name, bound))
            if name not in impls:
                raise NotImplementedError(f"{api.qualname}.{name} is real but this test gives it no behaviour")
            return impls[name](bound)

        method.__name__ = name
        return method

    # Dunders stay Python's own: the object is created without the real constructor.
    namespace = {n: make(n, s) for n, s in api.methods.items() if api.kinds[n] != "property" and not n.startswith("__")}
    cls = type(api.qualname.split(":")[-1], (), namespace)
    cls.__module__ = "spec_of_real_source"
    return cls()


# ---------------------------------------------------------------------------------------------
# Executing real pure functions
# ---------------------------------------------------------------------------------------------


def load_functions(
    path: Path, names: list[str], namespace: dict[str, Any], class_name: str | None = None
) -> dict[str, Callable]:
    """Execute the real source of top-level functions (or methods of `class_name`) from `path`."""
    text = path.read_text(encoding="utf-8")
    mod = ast.parse(text)
    body = mod.body
    if class_name is not None:
        (cls,) = [n for n in mod.body if isinstance(n, ast.ClassDef) and n.name == class_name]
        body = cls.body
    ns = dict(namespace)
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), ns)  # noqa: S102
    missing = [n for n in names if n not in ns]
    if missing:
        raise LookupError(f"{missing} not found in {path}")
    return {n: ns[n] for n in names}


def literal(path: Path, name: str) -> Any:
    """Value of a module-level literal assignment (`NAME = {...}`) in the real source."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{name} not found in {path}")


def class_literal(path: Path, class_name: str, name: str) -> Any:
    """Value of a literal class attribute (`NAME = [...]`) in the real source."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in item.targets):
                    return ast.literal_eval(item.value)
    raise LookupError(f"{class_name}.{name} not found in {path}")


def field_default(path: Path, class_name: str, name: str) -> Any:
    """Default of a dataclass field, literal or `field(default_factory=lambda: <literal>)`."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.target.id == name:
                    value = item.value
                    if isinstance(value, ast.Call):
                        for kw in value.keywords:
                            if kw.arg == "default_factory" and isinstance(kw.value, ast.Lambda):
                                return ast.literal_eval(kw.value.body)
                            if kw.arg == "default":
                                return ast.literal_eval(kw.value)
                    return ast.literal_eval(value)
    raise LookupError(f"{class_name}.{name} not found in {path}")


@dataclass(frozen=True)
class Sources:
    root: Path

    @property
    def roots(self) -> list[Path]:
        return [self.root / d for d in WHEELS]

    @property
    def mb(self) -> Path:  # megatron/bridge package
        return self.root / "megatron-bridge" / "megatron" / "bridge"

    @property
    def mc(self) -> Path:  # megatron/core package
        return self.root / "megatron-core" / "megatron" / "core"

    def api(self, path: Path, class_name: str) -> Api:
        return class_api(self.roots, path, class_name)


def sources_or_skip(request: Any) -> Sources:
    """The unpacked wheels, cached in pytest's cache dir; skip (with the reason) if unreachable."""
    import tempfile

    import pytest

    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    where = (
        cache.mkdir("megatron-wheels") if cache is not None else Path(tempfile.gettempdir()) / "lorarl-megatron-wheels"
    )
    try:
        return Sources(fetch(str(where)))
    except SourcesUnavailable as e:
        pytest.skip(f"released Megatron-Bridge/megatron-core wheels unavailable (offline?): {e}")
