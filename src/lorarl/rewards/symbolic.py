"""Symbolic answer equivalence through math-verify, run in a child process under a time limit.

math-verify parses LaTeX into sympy and compares the two expressions (numbers, fractions,
radicals, intervals, sets, equations; units, "\\text{...}", percentages and thousands commas
are read the way people write them). Its own time limit is a SIGALRM, which works only in a
main thread and cannot stop a long computation inside sympy's C helpers (a huge power, say).
Here the check runs in a child process instead: the caller waits at most `timeout_s` per
answer, and a child that overruns is killed and replaced, so no answer can hang a worker.

The child speaks JSON lines over its stdin/stdout: ["gold", "pred"] in, true/false out.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from lorarl.errors import LorarlError

# Importing sympy and math-verify in a fresh child takes a few seconds on a loaded machine;
# this bounds the start, separately from the per-answer limit.
START_TIMEOUT_S = 120.0


class SymbolicChecker:
    """One long-lived child process doing math-verify checks; thread-safe, restarted on overrun."""

    def __init__(self, timeout_s: float):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.timeouts = 0
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def equivalent(self, gold: str, pred: str) -> bool | None:
        """True/False from math-verify; None when the check ran past the time limit."""
        with self._lock:
            proc = self._ensure_started()
            proc.stdin.write(json.dumps([gold, pred]) + "\n")
            proc.stdin.flush()
            line = self._read_line(proc, self.timeout_s)
            if line is None:
                self.timeouts += 1
                self._kill()
                return None
            return bool(json.loads(line))

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _ensure_started(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        # The child imports this package from wherever the parent found it.
        src = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "lorarl.rewards.symbolic"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=env,
        )
        if self._read_line(self._proc, START_TIMEOUT_S) != "ready":
            self._kill()
            raise LorarlError(
                "the math answer checker did not start (python -m lorarl.rewards.symbolic); "
                "is math-verify installed? pip install 'math-verify[antlr4_9_3]'"
            )
        return self._proc

    @staticmethod
    def _read_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if ready:
                line = proc.stdout.readline()
                return line.strip() if line else None

    def _kill(self) -> None:
        if self._proc is None:
            return
        self._proc.kill()
        self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            stream.close()
        self._proc = None


_checkers: dict[float, SymbolicChecker] = {}
_checkers_lock = threading.Lock()


def checker(timeout_s: float) -> SymbolicChecker:
    """The process-wide checker for a time limit, started on first use and stopped at exit."""
    with _checkers_lock:
        if timeout_s not in _checkers:
            _checkers[timeout_s] = SymbolicChecker(timeout_s)
        return _checkers[timeout_s]


@atexit.register
def _close_all() -> None:
    for c in list(_checkers.values()):
        c.close()


def _verify(gold: str, pred: str) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # Both sides are already extracted answers; "$...$" makes math-verify read them as LaTeX.
    # Its SIGALRM limits are off: the parent enforces the limit by killing this process.
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold_parsed = parse(f"${gold}$", extraction_config=configs, parsing_timeout=None)
    pred_parsed = parse(f"${pred}$", extraction_config=configs, parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _serve() -> None:
    import logging

    logging.disable(logging.CRITICAL)  # math-verify warns once that its own timeout is off
    import math_verify  # noqa: F401  (import before answering "ready", so the start is timed once)

    print("ready", flush=True)
    for line in sys.stdin:
        gold, pred = json.loads(line)
        try:
            ok = _verify(gold, pred)
        except Exception:
            ok = False  # an unparsable answer is a wrong answer
        print(json.dumps(ok), flush=True)


if __name__ == "__main__":
    _serve()
