"""A verl launch's arguments read as verl's Hydra reads them: `key=value` overrides (`+`/`++`
add a key, the last of a repeated key wins), `--config-name` picking the backend, every value
parsed by Hydra's own grammar; keys no verl release has are named in one line."""

from __future__ import annotations

import difflib

from hydra.errors import HydraException

from recipes.from_verl.errors import Problems, VerlTranslationError
from recipes.from_verl.keys import BY_VERL, VERL_KEYS, A, verl_row
from recipes.from_verl.releases import every_release_key, releases_named
from recipes.from_verl.result import parsed


def split_override(arg: str) -> tuple[str, str]:
    key, sep, value = arg.partition("=")
    if arg.strip() in ("", "\\"):
        raise VerlTranslationError(
            f"{arg!r}: a stray argument (a backslash or space left by the script's line continuations, which "
            "verl's Hydra refuses too); remove it"
        )
    if key.startswith("~"):
        raise VerlTranslationError(f"{arg}: deleting verl keys has no lorarl equivalent; leave it out")
    if not sep or not key.lstrip("+"):
        raise VerlTranslationError(f"{arg!r} is not a verl override (key=value)")
    return key.lstrip("+"), value


def known_names() -> list[str]:
    return sorted({k.verl for k in VERL_KEYS if "*" not in k.verl} | every_release_key())


def foreign_line(unknown: list[str]) -> str:
    """One line for the keys of no verl release (a fork's own), each with its close verl keys."""
    names = known_names()
    named = []
    for key in unknown:
        close = [c for c in difflib.get_close_matches(key, names, n=3, cutoff=0.8) if c != key][:2]
        named.append(key + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    which = "not in" if len(unknown) == 1 else f"none of these {len(unknown)} keys is in"
    return (
        f"{', '.join(named)}: {which} verl's trainer config of any release lorarl knows ({releases_named()}), "
        f"so a fork's own; remove {'it' if len(unknown) == 1 else 'them'} or see recipes/from_verl/keys.py"
    )


def readable(key: str, value: str, problems: Problems) -> bool:
    """Whether Hydra's grammar reads `value` (verl's Hydra would stop at it otherwise)."""
    try:
        parsed(value)
    except HydraException as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        problems.append(f"{key}={value}: not a value Hydra can read ({first[:160]}); quote it or fix it")
        return False
    return True


def read_args(args: list[str], problems: Problems) -> tuple[str, dict[str, str], list[str]]:
    """(backend, {verl key: value as written}, notes); bad and unknown keys go to `problems`."""
    backend, values, unknown, notes = "fsdp", {}, [], []
    for arg in args:
        if arg.startswith("--config-name") or arg.startswith("--config-path"):
            name = arg.partition("=")[2].strip("'\"")
            if arg.startswith("--config-name") and "megatron" in name:
                backend = "megatron"
            continue
        try:
            key, value = split_override(arg)
        except VerlTranslationError as err:
            problems.extend(err.problems)
            continue
        if verl_row(key)[0] is None:
            if key not in unknown:
                unknown.append(key)
            continue
        if key in values and values[key] != value:
            notes.append(f"{key} is given twice: the last value ({value}) wins, as in verl")
        values.pop(key, None)  # the last one keeps its place too
        if readable(key, value, problems):
            values[key] = value
    if unknown:
        problems.foreign = foreign_line(unknown)
    for key, value in values.items():
        if value.strip() == "" and verl_row(key)[1] is not None:
            problems.append(f"{key}= has no value (a variable the script did not set?); set it or give the value")
    strategy = values.get(A + "actor.strategy")
    if strategy is not None:
        backend = BY_VERL[A + "actor.strategy"].values.get(strategy, backend)
    elif any(k.startswith(A + "actor.megatron.") for k in values):
        backend = "megatron"  # only a Megatron config has these keys (a custom --config-name)
    return backend, values, notes
