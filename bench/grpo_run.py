"""Run lorarl's own entry point (`python -m recipes.grpo`) and read its metrics.jsonl.

lorarl gives each CPU worker `os.cpu_count() // ranks` torch threads and has no setting for
it. To compare with a peer at the same thread count, `threads=` launches the entry point
through this module, which makes the driver see `threads x ranks` CPUs:

    python -m bench.grpo_run --cpu-count 1 +backend=fsdp trainer.device=cpu ...
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common import ROOT
from lorarl import metrics as keys


def run_grpo(
    run_dir: Path, cache: Path, overrides: list[str], timeout: int = 1200, threads: int | None = None
) -> list[dict]:
    """One CPU training run (1 rank); returns the per-step metric rows. Raises RuntimeError
    with the log tail when the run fails."""
    env = {
        **os.environ,
        "LORARL_CACHE": str(cache),
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    args = ["+backend=fsdp", "trainer.device=cpu", "trainer.progress_bar=false", f"hydra.run.dir={run_dir}", *overrides]
    if threads is None:
        cmd = [sys.executable, "-m", "recipes.grpo", *args]
    else:
        cmd = [sys.executable, "-m", "bench.grpo_run", "--cpu-count", str(threads), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        raise RuntimeError(f"recipes.grpo exit {proc.returncode}: {(proc.stderr or proc.stdout)[-800:]}")
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if keys.TIMING_STEP.key in r]


def _main() -> None:
    import runpy

    if len(sys.argv) < 3 or sys.argv[1] != "--cpu-count":
        raise SystemExit("usage: python -m bench.grpo_run --cpu-count N <hydra overrides>")
    count = int(sys.argv[2])
    os.cpu_count = lambda: count  # read once by lorarl's worker group for the per-worker threads
    sys.argv = ["recipes.grpo", *sys.argv[3:]]
    runpy.run_module("recipes.grpo", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main()
