"""End of a Hydra multirun: one summary row per job, as summary.md and summary.csv, plus plots.

Registered in conf/hydra/default.yaml as a Hydra callback, so every sweep gets it.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from lorarl import metrics as keys
from lorarl.telemetry.tracking import read_metrics

COLUMNS = ["job", "overrides", "steps", "final_reward", "val_acc", "step_seconds", "sync_seconds", "ended"]
# In a job's folder when it ended before the others of its group (hydra/launcher=shared_base): why.
ENDED_FILE = "ended.txt"


def summarize(sweep_dir: str | Path) -> list[dict[str, Any]]:
    rows = []
    for metrics_file in sorted(Path(sweep_dir).glob("*/metrics.jsonl")):
        job = metrics_file.parent
        metrics = read_metrics(job)
        steps = [r for r in metrics if keys.REWARD_MEAN.key in r]
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = OmegaConf.load(overrides_file) if overrides_file.exists() else []
        val = [r[keys.VAL_ACC.key] for r in metrics if keys.VAL_ACC.key in r]
        tail = steps[-max(1, len(steps) // 5) :] if steps else []
        rows.append(
            {
                "job": job.name,
                "overrides": " ".join(str(o) for o in overrides),
                "steps": len(steps),
                # Mean of the last fifth of the steps: one step's reward is noisy.
                "final_reward": round(statistics.fmean(r[keys.REWARD_MEAN.key] for r in tail), 4) if tail else None,
                "val_acc": round(val[-1], 4) if val else None,
                "step_seconds": round(statistics.median(r[keys.TIMING_STEP.key] for r in steps), 3) if steps else None,
                "sync_seconds": round(statistics.median(r[keys.SYNC_SECONDS.key] for r in steps), 4) if steps else None,
                "ended": (job / ENDED_FILE).read_text().strip() if (job / ENDED_FILE).is_file() else None,
            }
        )
    return rows


def write_summary(sweep_dir: str | Path) -> tuple[Path, Path]:
    sweep_dir = Path(sweep_dir)
    rows = summarize(sweep_dir)
    csv_path, md_path = sweep_dir / "summary.csv", sweep_dir / "summary.md"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join("" if r[c] is None else str(r[c]) for c in COLUMNS) + " |")
    md_path.write_text("\n".join(lines) + "\n")
    return md_path, csv_path


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from lorarl.telemetry.plot import plot

        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.exists():
            return
        md, _ = write_summary(sweep_dir)
        try:
            plot(sweep_dir)
        except FileNotFoundError:
            pass
        print(f"sweep summary: {md}")
        print(md.read_text())
