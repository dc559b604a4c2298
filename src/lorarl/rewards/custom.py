"""A user's reward function, named by data.reward_fn in one of two forms:

- `package.module:function`: the module is imported (it must be on PYTHONPATH);
- `path/to/file.py:function` or `path/to/file.py`: the file is run, as verl runs the file of
  `custom_reward_function.path`, and `function` defaults to verl's `compute_score`. Loading a
  file runs its code; a relative path is read from the folder the run starts in.

The function is called as verl calls it, by keyword:
`fn(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **data.reward_kwargs)`,
and returns a number or a dict whose `score` is one (verl's two forms). Every failure is a
one-line ConfigError naming data.reward_fn and the file or module.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from numbers import Real
from pathlib import Path
from typing import Any

from lorarl.errors import ConfigError, first_line

# verl's default for custom_reward_function.name.
DEFAULT_NAME = "compute_score"


@dataclass(frozen=True)
class RewardSpec:
    """Where a user's reward function lives: a file path or a module name, and its name."""

    given: str  # data.reward_fn as written, for messages
    file: Path | None
    module: str | None
    name: str

    @property
    def where(self) -> str:
        return str(self.file) if self.file is not None else f"module {self.module!r}"


def parse_spec(given: str) -> RewardSpec:
    """data.reward_fn -> RewardSpec. A target ending in `.py` or holding a `/` is a file."""
    head, sep, name = given.rpartition(":")
    if not sep:
        head, name = given, ""
    is_file = head.endswith(".py") or "/" in head
    if not head or (not is_file and not name):
        raise ConfigError(
            f"data.reward_fn={given!r} must look like 'package.module:function' or 'path/to/file.py[:function]'"
        )
    if is_file:
        return RewardSpec(given, Path(head).expanduser().absolute(), None, name or DEFAULT_NAME)
    return RewardSpec(given, None, head, name)


@cache
def _run_file(path: Path) -> Any:
    """The module made by running `path` once per process (later calls share it, as an import would)."""
    module_name = f"lorarl_reward_file_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"data.reward_fn: {path} is not a Python file Python can load; give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling in the file look their module up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _module_of(spec: RewardSpec) -> Any:
    if spec.file is not None:
        if not spec.file.is_file():
            raise ConfigError(
                f"data.reward_fn={spec.given!r}: no file {spec.file}; give the path of the reward file "
                "(a relative path is read from the folder the run starts in)"
            )
        try:
            return _run_file(spec.file)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"data.reward_fn={spec.given!r}: running {spec.file} failed: {type(exc).__name__}: {first_line(exc)}"
            ) from exc
    try:
        return importlib.import_module(spec.module)
    except Exception as exc:
        raise ConfigError(
            f"data.reward_fn={spec.given!r}: cannot import module {spec.module!r} "
            f"({type(exc).__name__}: {first_line(exc)})"
        ) from exc


def load_function(given: str) -> tuple[RewardSpec, Callable[..., Any]]:
    """(its spec, the callable data.reward_fn names); ConfigError when it cannot be had."""
    spec = parse_spec(given)
    module = _module_of(spec)
    fn = getattr(module, spec.name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        defines = f" (it defines: {', '.join(found)})" if found else ""
        raise ConfigError(
            f"data.reward_fn={given!r}: {spec.where} has no function {spec.name!r}{defines}; name one after ':'"
        )
    return spec, fn


def as_score(result: Any, spec: RewardSpec, data_source: str) -> float:
    """verl's two return forms (a number, or a dict whose `score` is one) as a float."""
    value = result.get("score") if isinstance(result, Mapping) else result
    if isinstance(value, Real) or _is_scalar_array(value):
        return float(value)
    got = "a dict without a numeric 'score'" if isinstance(result, Mapping) else f"{type(result).__name__} {result!r}"
    raise ConfigError(
        f"data.reward_fn={spec.given!r}: {spec.name} returned {got:.120} for data_source {data_source!r}; "
        "a reward function returns a number or a dict with a 'score' number"
    )


def _is_scalar_array(value: Any) -> bool:
    """A numpy or torch scalar (what a scorer computing with either returns)."""
    return getattr(value, "shape", None) == () and hasattr(value, "item")


def custom_reward(
    given: str, data_source: str, kwargs: Mapping[str, Any] | None = None
) -> Callable[[str, str, dict | None], float]:
    """The scorer lorarl calls, (solution, ground_truth, extra_info) -> float, for one data_source."""
    spec, fn = load_function(given)
    extra = dict(kwargs or {})

    def score(solution: str, ground_truth: str, extra_info: dict | None = None) -> float:
        result = fn(
            data_source=data_source, solution_str=solution, ground_truth=ground_truth, extra_info=extra_info, **extra
        )
        return as_score(result, spec, data_source)

    return score


__all__ = ["DEFAULT_NAME", "RewardSpec", "as_score", "custom_reward", "load_function", "parse_spec"]
