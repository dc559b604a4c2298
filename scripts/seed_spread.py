"""Two sets of sweeps of the same points over several seeds, side by side: per point (the job's
overrides less trainer.seed), each set's final reward (mean of the last fifth of its steps) and
last held-out accuracy per seed, their means, and the seeds' spread (sample standard deviation).
Made to hold a sweep trained on one base (hydra/launcher=shared_base) against the same sweep run
job after job, but any two sets of sweep folders compare.

    python scripts/seed_spread.py --a multirun/basic_seed1 multirun/basic_seeds23 \\
        --b multirun/shared_seed1 multirun/shared_seeds23

A job with fewer steps than the most any job ran (one that ended early) is listed, not averaged.
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

from lorarl.telemetry.sweep import summarize

SEED = re.compile(r"\s*trainer\.seed=(\d+)")


def by_point(folders: list[str]) -> dict[str, dict[int, dict]]:
    """point (overrides less the seed) -> seed -> the job's summary row (lorarl.telemetry.sweep)."""
    out: dict[str, dict[int, dict]] = {}
    for folder in folders:
        for row in summarize(Path(folder)):
            seed = SEED.search(row["overrides"])
            point = SEED.sub("", row["overrides"]).strip()
            out.setdefault(point, {})[int(seed.group(1)) if seed else 1] = row
    return out


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):.3f} (sd {sd:.3f}; {', '.join(f'{v:.3f}' for v in values)})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", nargs="+", required=True, help="sweep folders of the first set")
    ap.add_argument("--b", nargs="+", required=True, help="sweep folders of the second set")
    args = ap.parse_args(argv)
    a, b = by_point(args.a), by_point(args.b)
    steps = max(row["steps"] for runs in (*a.values(), *b.values()) for row in runs.values())
    common = set.intersection(*(set(p.split()) for p in (*a, *b)))  # shown once, above the table
    print("every point:", " ".join(t for t in next(iter(a)).split() if t in common), "\n")
    print("| point | set | seeds | final reward: mean (sd; each seed) | last val acc: mean (sd; each seed) |")
    print("|---|---|---|---|---|")
    for point in sorted(set(a) | set(b)):
        for name, runs in (("a", a.get(point, {})), ("b", b.get(point, {}))):
            whole = {s: r for s, r in sorted(runs.items()) if r["steps"] == steps}
            short = [f"seed {s}: {r['steps']} steps" for s, r in runs.items() if s not in whole]
            rewards = [r["final_reward"] for r in whole.values()]
            val = [r["val_acc"] for r in whole.values() if r["val_acc"] is not None]
            seeds = ", ".join(map(str, whole)) + (f" ({'; '.join(short)})" if short else "")
            label = " ".join(t for t in point.split() if t not in common)
            print(f"| {label} | {name} | {seeds} | {spread(rewards)} | {spread(val)} |")


if __name__ == "__main__":
    main()
