"""Where a CPU training step goes: one end-to-end run of the embedded default, per-phase time.

    python -m recipes.grpo +backend=fsdp trainer.total_steps=20 trainer.device=cpu

(tiny Qwen2, arith task, 16 prompts x 8 samples x <= 8 tokens, 1 FSDP rank, vLLM CPU).
Each phase's median and spread over the steps after the first two, and its share of the
step, taken step by step (phase / timing/step of the same step).

    python -m bench.step_breakdown --out /tmp/breakdown.json [--steps 20]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.common import Record, Stat, cache_dir, ratio_stat, tiny_model, write_json
from bench.grpo_run import run_grpo

WARMUP_STEPS = 2
PHASES = {
    "timing/gen": "rollout generation (vLLM)",
    "timing/old_logp": "old log-probs (trainer forward)",
    "timing/ref_logp": "reference log-probs (adapter off)",
    "timing/update": "PPO update (forward+backward+step)",
    "timing/train": "train call incl. Ray (old+ref+update)",
    "sync/seconds": "sync inside the worker (gather+transfer+load)",
    "timing/sync": "sync as the driver sees it (incl. Ray)",
    "timing/step": "whole step",
}


def breakdown(rows: list[dict], config: str, measurement: str = "step_breakdown") -> list[Record]:
    rows = rows[WARMUP_STEPS:]
    step = [r["timing/step"] for r in rows]
    out = []
    for key, label in PHASES.items():
        values = [r[key] for r in rows if key in r]
        if len(values) != len(rows):
            continue
        other = key == "timing/step"
        out.append(
            Record(
                measurement,
                f"{key}: {label}",
                config,
                Stat.of(values),
                baseline=None if other else "timing/step: whole step (share of it)",
                ratio=None if other else ratio_stat(values, step),
            )
        )
    accounted = [r["timing/gen"] + r["timing/train"] + r["timing/sync"] for r in rows]
    rest = [s - a for s, a in zip(step, accounted)]
    out.append(
        Record(
            measurement,
            "rest: rewards, batching, driver (step - gen - train - sync)",
            config,
            Stat.of(rest),
            baseline="timing/step: whole step (share of it)",
            ratio=ratio_stat(rest, step),
        )
    )
    for record in out:
        if record.what.startswith("sync/seconds"):
            record.extra["sync_bytes"] = rows[-1].get("sync/bytes")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    cache = cache_dir(args.cache)
    tiny_model(cache)
    config = f"default run: tiny Qwen2 fp32, arith, 16 prompts x 8 x <=8 tokens, LoRA r=16, 1 rank, {args.steps} steps (first {WARMUP_STEPS} dropped)"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            rows = run_grpo(Path(tmp) / "run", cache, [f"trainer.total_steps={args.steps}"])
            records = breakdown(rows, config)
        except Exception as exc:  # noqa: BLE001 - recorded as the result
            records = [
                Record("step_breakdown", "end-to-end run", config, None, error=f"{type(exc).__name__}: {exc}"[:900])
            ]
    write_json(Path(args.out), [r.as_dict() for r in records])
    return 0


if __name__ == "__main__":
    sys.exit(main())
