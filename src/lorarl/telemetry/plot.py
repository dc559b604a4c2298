"""PNG curves of a run (or of every job of a sweep) from metrics.jsonl.

python -m lorarl.telemetry.plot outputs/2026-11-30/12-00-00_fsdp_qwen2_tiny
python -m lorarl.telemetry.plot multirun/2026-11-30/12-00-00
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lorarl import metrics as keys
from lorarl.telemetry.tracking import read_metrics

CURVES = {
    "reward": (keys.REWARD_MEAN.key, "mean reward, validation accuracy"),
    "val_acc": (keys.VAL_ACC.key, "validation accuracy"),
    "kl": (keys.ACTOR_KL_LOSS.key, "KL to the base model"),
    "response_length": (keys.RESPONSE_LENGTH_MEAN.key, "mean response length (tokens)"),
    "sync_seconds": (keys.SYNC_SECONDS.key, "weight sync (s)"),
    "sync_parity": (keys.SYNC_LOGPROB_DIFF_MAX.key, "max |trainer - vLLM| logp"),
}
LOG_SCALE = {"sync_parity"}  # fp32 runs sit near 1e-6, bf16 near 1e-2
# The per-step reward swings with which prompts a batch drew; a trailing mean over this many steps
# shows the trend (and at the last step equals the "last 10 steps" figure the README quotes).
SMOOTH_WINDOW = 10


SWEEP_REWARD_TITLE = (
    f"reward per step (faint), its mean over the last {SMOOTH_WINDOW} steps (solid),\n"
    "validation accuracy on held-out prompts (dashed, squares)"
)


def moving_average(values: list[float], window: int = SMOOTH_WINDOW) -> list[float]:
    """Trailing mean: point i averages values[max(0, i - window + 1) : i + 1]."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def run_dirs(path: Path) -> list[Path]:
    """The path itself when it holds metrics, else every job folder below it that does."""
    if (path / "metrics.jsonl").exists():
        return [path]
    return sorted(p.parent for p in path.glob("*/metrics.jsonl"))


def plot(path: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    runs = run_dirs(path)
    if not runs:
        raise FileNotFoundError(f"{path}: no metrics.jsonl here or in its sub-folders; pass a run or sweep folder")
    series = {run: read_metrics(run) for run in runs}
    written = []
    for stem, (key, label) in CURVES.items():
        # A sweep's legend (one line per job) goes beside the axes, where it hides no curve.
        fig, ax = plt.subplots(figsize=(6, 3.5) if len(runs) == 1 else (8.5, 3.5))
        drawn = False
        for i, (run, rows) in enumerate(series.items()):
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if not points:
                continue
            xs, ys = zip(*points)
            name = run.name if len(runs) > 1 else None
            color = f"C{i % 10}"
            if stem == "reward":
                _reward_panel(ax, xs, ys, rows, color, name)
            else:
                ax.plot(xs, ys, color=color, marker="." if len(xs) < 50 else None, label=name)
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        if stem in LOG_SCALE:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_title(label if len(runs) == 1 or stem != "reward" else SWEEP_REWARD_TITLE, fontsize=9)
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        elif stem == "reward":
            ax.legend(fontsize=7)
        fig.tight_layout()
        out = path / f"plot_{stem}.png"
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
    return written


def _reward_panel(ax, xs, ys, rows, color, name) -> None:
    """Raw reward (faint), its trailing mean, and the validation accuracy at the steps it was measured.
    One run: each of the three in the legend; a job of a sweep (`name`): the job's name on its mean
    alone (the title says which line is which)."""
    ax.plot(xs, ys, color=color, alpha=0.3, linewidth=0.8, label=None if name else "reward, per step")
    ax.plot(
        xs,
        moving_average(list(ys)),
        color=color,
        linewidth=2.0,
        label=name or f"reward, mean of last {SMOOTH_WINDOW} steps",
    )
    val = [(r["step"], r[keys.VAL_ACC.key]) for r in rows if isinstance(r.get(keys.VAL_ACC.key), (int, float))]
    if val:
        vx, vy = zip(*val)
        # One run: its own colour, so the points stand apart from the reward; a sweep: the run's colour.
        color = "C1" if not name else color
        ax.plot(
            vx,
            vy,
            color=color,
            linestyle="--",
            marker="s",
            markersize=5,
            label=None if name else "validation accuracy (held out)",
        )
        for x, y in (val[0], val[-1]) if len(val) > 1 else val[:1]:
            ax.annotate(
                f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8, color=color
            )
    ax.set_ylim(0, 1.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a run folder (with metrics.jsonl) or a sweep folder")
    args = parser.parse_args(argv)
    try:
        for out in plot(args.path):
            print(out)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
