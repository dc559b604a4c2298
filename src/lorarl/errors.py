"""Errors a user can act on. Each message is one line naming the key or file and the fix."""

from __future__ import annotations

from typing import Any


class LorarlError(Exception):
    """Base of every error lorarl raises on purpose."""


class ConfigError(LorarlError):
    """A config value is missing, mistyped or inconsistent with another."""


class DataError(LorarlError):
    """A data file is missing, unreadable or lacks what the task needs."""


class ModelError(LorarlError):
    """A model path or LoRA target cannot be used."""


class SyncError(LorarlError):
    """A weight payload is malformed or the rollout disagrees with the trainer after a sync."""


class TrainingError(LorarlError):
    """Training diverged (NaN/Inf) or a worker failed."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty):
    what a one-line error quotes from a library's multi-line one."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one line of at most `limit` characters (vLLM's messages can list every
    parameter of the model)."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + " ..."


def check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def one_of(key: str, value: Any, allowed: tuple) -> None:
    shown = ", ".join(str(a) for a in allowed if a is not None)
    check(value in allowed, f"{key}={value!r} is not valid; use {'null or ' if None in allowed else ''}one of: {shown}")
