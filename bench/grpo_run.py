"""Run lorarl's own entry point (`python -m recipes.grpo`) and read its metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_grpo(run_dir: Path, cache: Path, overrides: list[str], timeout: int = 1200) -> list[dict]:
    """One CPU training run; returns the per-step metric rows. Raises RuntimeError with the
    log tail when the run fails."""
    env = {**os.environ, "LORARL_CACHE": str(cache), "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable, "-m", "recipes.grpo", "+backend=fsdp", "trainer.device=cpu", "trainer.progress_bar=false",
        f"hydra.run.dir={run_dir}", *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    metrics = run_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        raise RuntimeError(f"recipes.grpo exit {proc.returncode}: {(proc.stderr or proc.stdout)[-800:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines() if '"timing/step"' in line]
