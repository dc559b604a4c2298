"""A Hydra sweep run job after job (the basic launcher) against the same sweep trained as adapters
of one base (hydra/launcher=shared_base), side by side in one command.

Each arm is one `python -m recipes.grpo -m ...` process, as users launch a sweep, timed from launch
to exit (Ray, vLLM and the training engine start once per job in the basic arm, once per group in
the shared one). The arms alternate (basic, shared, basic, shared, ...) so drift on the machine falls
on both. Per arm: wall seconds, sequences per second (every job's sampled sequences over the wall
time), peak memory (the GPU's used memory, or on CPU the run's processes' resident memory, sampled
each second: bench.common.Sampler) and each job's final reward (mean of its last fifth of steps) and
last held-out accuracy; per repeat, the basic arm's wall time over the shared one's.

    python -m bench.sweep_shared_base --shape tiny --steps 10 --repeats 2          # 4 points, 2 CPU cores
    python -m bench.sweep_shared_base --shape 0.5b --steps 6 --repeats 2 \\
        --points "model.lora.rank=8,16,32,64 actor.optim.lr=1e-5,3e-5"              # 8 points, one GPU

Writes sweep_shared_base_<shape>_<date>.json and .md (the command, per-arm rows, the ratios) to --out.
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
import time
from pathlib import Path

from bench import common
from lorarl import metrics as keys

POINTS = "model.lora.rank=8,16 actor.optim.lr=1e-3,5e-4"
GPU_WORK = ("data.train_batch_size=32", "actor.ppo_mini_batch_size=32", "rollout.n=8", "data.max_response_length=128")
# Per shape: the model preset, the shaped random model (None: the embedded one) and what differs from the preset.
SHAPES = {
    "tiny": ("qwen2_tiny", None, ()),
    "0.5b": ("qwen2_5_0_5b_instruct", "qwen2.5-0.5b", (*GPU_WORK, "rollout.gpu_memory_utilization=0.5")),
    "7b": ("qwen2_5_7b_instruct", "qwen2.5-7b", (*GPU_WORK, "rollout.gpu_memory_utilization=0.5", "backend.liger_kernel=false")),
}  # fmt: skip


def sweep_command(shape: str, points: str, steps: int, sweep_dir: Path, shared: bool, model: Path | None) -> list[str]:
    """The sweep as a user types it, through one of the two launchers."""
    preset, _, work = SHAPES[shape]
    out = [sys.executable, "-m", "recipes.grpo", "-m", "+backend=fsdp", f"model={preset}", *work]
    if model is not None:
        out += [f"model.path={model}", "model.builder=null", "data=arith", "rollout.enforce_eager=false"]
    out += [f"trainer.total_steps={steps}", "trainer.progress_bar=false", f"hydra.sweep.dir={sweep_dir}"]
    return out + shlex.split(points) + (["hydra/launcher=shared_base"] if shared else [])


def jobs_of(sweep_dir: Path) -> list[dict]:
    """Each job folder's steps, final reward (mean of the last fifth) and last held-out accuracy."""
    out = []
    for job in sorted(p for p in sweep_dir.iterdir() if (p / "metrics.jsonl").is_file()):
        rows = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [r[keys.REWARD_MEAN.key] for r in rows if keys.REWARD_MEAN.key in r]
        val = [r[keys.VAL_ACC.key] for r in rows if keys.VAL_ACC.key in r]
        tail = steps[-max(1, len(steps) // 5) :]
        out.append({"job": job.name, "steps": len(steps), "final_reward": statistics.fmean(tail) if tail else None,
                    "val_acc": val[-1] if val else None})  # fmt: skip
    return out


def sequences_per_step(cmd: list[str], cache: Path) -> int:
    """A job's sampled sequences per step, from the command's config (the swept keys change none)."""
    os.environ["LORARL_CACHE"] = str(cache)
    from lorarl.config.compose import compose

    run = compose([c for c in cmd[4:] if "," not in c and not c.startswith("hydra")])
    return run.data.train_batch_size * run.rollout.n


def run_arm(args, shared: bool, repeat: int, model: Path | None, cache: Path, tmp: Path) -> dict:
    name = f"{'shared' if shared else 'basic'}-r{repeat}"
    cmd = sweep_command(args.shape, args.points, args.steps, tmp / name, shared, model)
    with common.Sampler(gpu=model is not None) as sampled:
        t0 = time.perf_counter()
        code, log = common.run_logged(cmd, common.child_env(cache), args.timeout, tmp / f"{name}.log")
        wall = time.perf_counter() - t0
    memory = sampled.summary()["memory.used" if model is not None else "children_rss_gib"]
    jobs = jobs_of(tmp / name) if (tmp / name).is_dir() else []
    sequences = sum(j["steps"] for j in jobs) * sequences_per_step(cmd, cache)
    return {
        "arm": "shared" if shared else "basic", "repeat": repeat, "exit": code, "wall_s": wall, "jobs": jobs,
        "sequences_per_s": sequences / wall, "command": shlex.join(cmd), "error": None if code == 0 else common.tail(log),
        "peak_gib": (memory["max"] / (1024 if model is not None else 1)) if memory else None,
    }  # fmt: skip


def table(result: dict) -> str:
    lines = [
        f"# A sweep on one base against job after job ({result['date']}, {result['machine']})", "",
        f"`{result['command']}`", "", f"Sweep: `{result['points']}`, {result['steps']} steps a point, shape {result['shape']}.",
        "", "| arm | repeat | wall s | sequences/s | peak GiB | jobs | final reward per job |", "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in result["runs"]:
        rewards = ", ".join("-" if j["final_reward"] is None else f"{j['final_reward']:.3f}" for j in r["jobs"])
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        lines.append(
            f"| {r['arm']} | {r['repeat']} | {r['wall_s']:.1f} | {r['sequences_per_s']:.1f} | {peak} | {len(r['jobs'])} | {rewards} |"
        )
    if result["ratios"]:
        x = result["ratios"]
        lines += ["", f"Basic over shared wall time per repeat: {', '.join(f'{v:.2f}x' for v in x)}; median "
                  f"{statistics.median(x):.2f}x (min {min(x):.2f}, max {max(x):.2f})."]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--points", default=POINTS, help="the sweep's Hydra choices (default: 2 ranks x 2 learning rates)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds an arm may run")
    ap.add_argument("--cache", default=None)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--keep", default=None, help="keep the sweep folders here (default: a temporary folder)")
    args = ap.parse_args(argv)
    cache = common.cache_dir(args.cache)
    shaped = SHAPES[args.shape][1]
    model = None if shaped is None else common.shaped_model(cache, shaped, device="cuda")
    runs, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="lorarl_sweep_bench_") as scratch:
        tmp = args.keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for repeat in range(1, args.repeats + 1):
            pair = [run_arm(args, shared, repeat, model, cache, Path(tmp)) for shared in (False, True)]
            runs += pair
            if all(r["exit"] == 0 for r in pair):
                ratios.append(pair[0]["wall_s"] / pair[1]["wall_s"])
    gpu = (common.nvidia_smi(("name",)) or {}).get("name")
    result = {
        "date": dt.date.today().isoformat(), "machine": gpu or f"{os.cpu_count()} CPU cores",
        "command": shlex.join(["python", "-m", "bench.sweep_shared_base", *(sys.argv[1:] if argv is None else argv)]),
        "shape": args.shape, "points": args.points, "steps": args.steps, "versions": common.versions(),
        "runs": runs, "ratios": ratios,
    }  # fmt: skip
    stem = Path(args.out) / f"sweep_shared_base_{args.shape}_{result['date']}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    common.write_json(stem.with_suffix(".json"), result)
    stem.with_suffix(".md").write_text(table(result))
    print(table(result))
    return 0 if all(r["exit"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
