"""Summarise the sampler/trainer mismatch of runs from their metrics.jsonl files into one JSON.

For each run (label=path/to/metrics.jsonl): every `rollout_corr/*` metric (verl's names: kl is
k1 of KL(rollout || trainer), k3_kl, rollout_is_* weight statistics, chi2_*, log_ppl_*) as mean,
min, max and per-step series, plus the step time, update time, reward and ppo_kl beside them.

    python bench/mismatch_summary.py off=RUN1/metrics.jsonl token_tis=RUN2/metrics.jsonl --out mismatch.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BESIDE = ("reward/mean", "actor/ppo_kl", "actor/grad_norm", "timing/step", "timing/train", "timing/old_logp")


def load_steps(path: Path) -> list[dict]:
    """The rows of training steps (step >= 1 with a reward), in order."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]


def summarise(rows: list[dict]) -> dict:
    keys = sorted({k for r in rows for k in r if k.startswith("rollout_corr/") or k in BESIDE})
    out: dict = {"steps": len(rows), "metrics": {}}
    for key in keys:
        series = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if series:
            out["metrics"][key] = {
                "mean": sum(series) / len(series),
                "min": min(series),
                "max": max(series),
                "series": series,
            }
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="label=path/to/metrics.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    result = {}
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            parser.error(f"{spec!r}: give label=path with an existing metrics.jsonl")
        rows = load_steps(Path(path))
        if not rows:
            parser.error(f"{path}: no training steps in it (did the run fail? see its .log beside the folder)")
        result[label] = {"path": path, **summarise(rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for label, run in result.items():
        m = run["metrics"]
        shown = ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_std",
                 "rollout_corr/rollout_is_min", "rollout_corr/rollout_is_max", "rollout_corr/rollout_is_eff_sample_size",
                 "rollout_corr/rollout_is_ratio_fraction_high", "rollout_corr/rollout_is_ratio_fraction_low",
                 "timing/step")  # fmt: skip
        print(label, {k.split("/")[-1]: round(m[k]["mean"], 6) for k in shown if k in m})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
