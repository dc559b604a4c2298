"""A Hydra sweep run job after job (the basic launcher) against the same sweep trained as adapters
of one base (hydra/launcher=shared_base), side by side in one command.

Each arm is one `python -m recipes.grpo -m ...` process, as users launch a sweep, timed from launch
to exit (Ray, vLLM and the training engine start once per job in the basic arm, once per group in
the shared one). The arms alternate (basic, shared, basic, shared, ...) so drift on the machine
falls on both. Per arm: wall seconds, sequences per second (every job's sampled sequences over the
wall time), the peak memory (GPU: nvidia-smi's largest used memory while it ran; CPU: the largest
resident set of the arm's processes), and each job's final reward and last held-out accuracy;
per repeat, the basic arm's wall time over the shared one's.

    python -m bench.sweep_shared_base --shape tiny --steps 10 --repeats 2          # 4 points, 2 CPU cores
    python -m bench.sweep_shared_base --shape 0.5b --steps 6 --repeats 2 \\
        --points "model.lora.rank=8,16,32,64 actor.optim.lr=1e-5,3e-5"              # 8 points, one GPU
    python -m bench.sweep_shared_base --shape 7b --steps 6 --repeats 2 --points "model.lora.rank=8,16,32,64 actor.optim.lr=1e-5,3e-5"

Writes sweep_shared_base_<date>.json and .md (the command, per-arm rows, the ratio per repeat) to --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import common
from lorarl import metrics as keys

POINTS = "model.lora.rank=8,16 actor.optim.lr=1e-3,5e-4"
# Per shape: the model preset, its vLLM memory share and the work of a step (prompts x samples x tokens).
SHAPES = {
    "tiny": dict(preset="qwen2_tiny", model=None, util=None, work=("data.train_batch_size=16", "rollout.n=8")),
    "0.5b": dict(
        preset="qwen2_5_0_5b_instruct", model="qwen2.5-0.5b", util=0.5,
        work=("data=arith", "data.train_batch_size=32", "rollout.n=8", "actor.ppo_mini_batch_size=32",
              "data.max_response_length=128"),
    ),
    "7b": dict(
        preset="qwen2_5_7b_instruct", model="qwen2.5-7b", util=0.5,
        work=("data=arith", "data.train_batch_size=32", "rollout.n=8", "actor.ppo_mini_batch_size=32",
              "data.max_response_length=128", "backend.liger_kernel=false"),
    ),
}  # fmt: skip


def sweep_command(shape: str, points: str, steps: int, sweep_dir: Path, shared: bool, model: Path | None) -> list[str]:
    """The sweep as a user types it, one of the two launchers."""
    s = SHAPES[shape]
    out = [sys.executable, "-m", "recipes.grpo", "-m", "+backend=fsdp", f"model={s['preset']}", *s["work"]]
    if model is not None:
        out += [f"model.path={model}", "model.builder=null", f"rollout.gpu_memory_utilization={s['util']}"]
        out += ["rollout.enforce_eager=false"]
    out += [f"trainer.total_steps={steps}", "trainer.progress_bar=false"]
    out += ["trainer.logger=[console,jsonl]", f"hydra.sweep.dir={sweep_dir}", *shlex.split(points)]
    return out + (["hydra/launcher=shared_base"] if shared else [])


class PeakMemory:
    """The largest memory in use while a block runs: the GPU's (nvidia-smi) or, on CPU, the
    resident set summed over this process's children."""

    def __init__(self, gpu: bool, interval_s: float = 0.5):
        self.gpu, self.interval_s, self.peak_gib = gpu, interval_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_gib = max(self.peak_gib, self.read_gib())

    def read_gib(self) -> float:
        if self.gpu:
            used = (common.nvidia_smi(("memory.used",)) or {}).get("memory.used")
            return float(used) / 1024 if used is not None else 0.0
        import psutil

        kids = psutil.Process().children(recursive=True)
        total = 0
        for p in kids:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                continue
        return total / 2**30


def jobs_of(sweep_dir: Path) -> list[dict]:
    """Each job folder's steps, sequences sampled, final reward (mean of the last fifth) and last val acc."""
    out = []
    for job in sorted(p for p in sweep_dir.iterdir() if (p / "metrics.jsonl").is_file()):
        rows = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [r for r in rows if keys.REWARD_MEAN.key in r]
        tail = steps[-max(1, len(steps) // 5) :]
        val = [r[keys.VAL_ACC.key] for r in rows if keys.VAL_ACC.key in r]
        out.append(
            {
                "job": job.name,
                "steps": len(steps),
                "final_reward": statistics.fmean(r[keys.REWARD_MEAN.key] for r in tail) if tail else None,
                "val_acc": val[-1] if val else None,
                "step_s": statistics.median(r[keys.TIMING_STEP.key] for r in steps) if steps else None,
            }
        )
    return out


def run_arm(args, shared: bool, repeat: int, model: Path | None, cache: Path, tmp: Path) -> dict:
    name = f"{'shared' if shared else 'basic'}-r{repeat}"
    sweep_dir = tmp / name
    cmd = sweep_command(args.shape, args.points, args.steps, sweep_dir, shared, model)
    with PeakMemory(gpu=model is not None) as peak:
        t0 = time.perf_counter()
        code, log = common.run_logged(cmd, common.child_env(cache), args.timeout, tmp / f"{name}.log")
        wall = time.perf_counter() - t0
    jobs = jobs_of(sweep_dir) if sweep_dir.is_dir() else []
    work = dict(
        x.split("=", 1)
        for x in SHAPES[args.shape]["work"]
        if "=" in x and x.split("=")[0] in ("data.train_batch_size", "rollout.n")
    )
    per_step = int(work.get("data.train_batch_size", 16)) * int(work.get("rollout.n", 8))
    sequences = sum(j["steps"] for j in jobs) * per_step
    return {
        "arm": "shared" if shared else "basic",
        "repeat": repeat,
        "exit": code,
        "wall_s": wall,
        "jobs": jobs,
        "sequences": sequences,
        "sequences_per_s": sequences / wall,
        "peak_gib": peak.peak_gib,
        "command": shlex.join(cmd),
        "error": None if code == 0 else common.tail(log),
    }


def table(result: dict) -> str:
    rows = result["runs"]
    lines = [
        f"# A sweep on one base against job after job ({result['date']}, {result['machine']})",
        "",
        f"`{result['command']}`",
        "",
        f"Sweep: `{result['points']}`, {result['steps']} steps a point, shape {result['shape']}.",
        "",
        "| arm | repeat | wall s | sequences/s | peak GiB | jobs | final reward per job |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rewards = ", ".join(f"{j['final_reward']:.3f}" if j["final_reward"] is not None else "-" for j in r["jobs"])
        lines.append(
            f"| {r['arm']} | {r['repeat']} | {r['wall_s']:.1f} | {r['sequences_per_s']:.1f} | {r['peak_gib']:.1f} "
            f"| {len(r['jobs'])} | {rewards} |"
        )
    ratios = result["ratios"]
    if ratios:
        lines += ["", f"Basic over shared wall time per repeat: {', '.join(f'{x:.2f}x' for x in ratios)}; "
                  f"median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f})."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--points", default=POINTS, help="the sweep's Hydra choices (default: 2 ranks x 2 learning rates)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds an arm may run")
    ap.add_argument("--cache", default=None)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    cache = common.cache_dir(args.cache)
    model = (
        None
        if SHAPES[args.shape]["model"] is None
        else common.shaped_model(cache, SHAPES[args.shape]["model"], device="cuda")
    )
    if model is None:
        common.tiny_model(cache)
    runs, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="lorarl_sweep_bench_") as tmp:
        for repeat in range(1, args.repeats + 1):
            pair = [run_arm(args, shared, repeat, model, cache, Path(tmp)) for shared in (False, True)]
            runs += pair
            print(json.dumps({k: v for r in pair for k, v in [(r["arm"], round(r["wall_s"], 1))]}), flush=True)
            if all(r["exit"] == 0 for r in pair):
                ratios.append(pair[0]["wall_s"] / pair[1]["wall_s"])
    date = dt.date.today().isoformat()
    result = {
        "date": date,
        "machine": f"{os.cpu_count()} CPU cores"
        if model is None
        else (common.nvidia_smi(("name",)) or {}).get("name", "GPU"),
        "command": shlex.join(
            ["python", "-m", "bench.sweep_shared_base", *(argv if argv is not None else sys.argv[1:])]
        ),
        "shape": args.shape,
        "points": args.points,
        "steps": args.steps,
        "versions": common.versions(),
        "runs": runs,
        "ratios": ratios,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"sweep_shared_base_{args.shape}_{date}"
    common.write_json(stem.with_suffix(".json"), result)
    stem.with_suffix(".md").write_text(table(result))
    print(table(result))
    return 0 if all(r["exit"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
