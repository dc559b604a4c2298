"""One GRPO step on one H200, lorarl vs TRL's GRPOTrainer, at equal algorithm, side by side.

A comparison is a pair (shape, KL off/on, rollout correction; bench.step_plan) run as
alternating repeats in one command: lorarl, TRL, lorarl, TRL, ... Each run is a subprocess, as
users launch it (bench.step_launch): lorarl `python -m recipes.grpo +backend=fsdp|megatron ...`
with `algorithm.rollout_correction` set to the pair's correction; TRL through
bench/trl_grpo_worker.py with the same model, prompts (the trainer's own batches, in order),
batch (32 prompts x 8 completions x 128 tokens, ignore_eos), LoRA, lr, micro-batching,
checkpointing, vLLM memory share and the same correction (TRL's importance-sampling mode of
the same arithmetic, or none). Random weights rarely sample EOS, so every completion is 128 tokens.

Per run: seconds per step (median over steps 3+), the phases, real tokens per step and the
update's MFU (bench.step_rows), plus what the machine did (bench.host_state): GPU clocks,
temperature, power, memory and host load before the run and sampled every second during it,
and its place in the order. Per pair: the median and min-max of each side over the repeats,
TRL's step over lorarl's (of the medians and per repeat), and the request's targets.

    python -m bench.gpu_step --list                                   # the plan, nothing run
    python -m bench.gpu_step --shapes 0.5b --kl off --corrections none --repeats 3 --budget-s 520
    python -m bench.gpu_step --shapes 7b --kl off --corrections none --repeats 1 --append
    python -m bench.gpu_step --cpu-smoke                              # tiny model on CPU: code paths, not a result

Writes <out-dir>/<stem>.json (`step_compare`: one object per run; `pairs`) and <stem>.md after
every run. With --append the rows already in that JSON are kept and each pair's repeats go on
from the last one there. A failed run keeps its log tail as `error`; the exit status is 1 if
any run of this command failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, SHAPED_MODEL_DONE, SHAPES, shaped_model_path, write_json
from bench.host_state import Sampler, host_state, slowdown_s, wait_for_free_gpu
from bench.step_launch import (
    child_env,
    compose_run,
    last_setting_wins,
    lorarl_extras,
    lorarl_overrides,
    prompt_batches,
    run_lorarl,
    run_trl,
    tail,
    trl_args,
)
from bench.step_plan import (
    BACKENDS,
    CORRECTIONS,
    GPU_WORK,
    MODES,
    SHAPE_RUNS,
    SMOKE_WORK,
    SYSTEMS,
    TRL,
    Pair,
    Run,
    Shape,
    Work,
    estimate_wall_s,
    lorarl_arms,
    parse_variant,
    plan,
    repeat_groups,
    select,
    walls_of,
)
from bench.step_report import markdown
from bench.step_rows import (
    MFU_FORMULA,
    PEAK_FLOPS,
    WARMUP_STEPS,
    fmt,
    lorarl_steps,
    pairs,
    param_count,
    step_row,
    trl_steps,
)


def build_model(shape: Shape, cache: Path, device: str, timeout: int) -> tuple[Path, float]:
    """The shaped random model (built once under <cache>/bench/, in a subprocess so this process
    never holds GPU memory), or the embedded tiny model."""
    t0 = time.perf_counter()
    if shape.model is not None and (shaped_model_path(cache, shape.model) / SHAPED_MODEL_DONE).is_file():
        return shaped_model_path(cache, shape.model), 0.0  # built by an earlier command: no torch import
    if shape.model is None:
        code = f"from pathlib import Path; from bench.common import tiny_model; print(tiny_model(Path({str(cache)!r})))"
    else:
        code = (
            "from pathlib import Path; from bench.common import shaped_model; "
            f"print(shaped_model(Path({str(cache)!r}), {shape.model!r}, device={device!r}))"
        )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=child_env(cache), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building the {shape.model or 'tiny'} model failed: {tail(proc.stderr or proc.stdout)}")
    path = Path(proc.stdout.strip().splitlines()[-1])
    if shape.model is not None and path != shaped_model_path(cache, shape.model):
        raise RuntimeError(f"shaped model at {path}, expected {shaped_model_path(cache, shape.model)}")
    return path, time.perf_counter() - t0


def model_dims(shape: Shape, model: Path) -> dict:
    if shape.model is not None:
        return SHAPES[shape.model]
    return json.loads((model / "config.json").read_text())


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "vllm", "transformers", "peft", "accelerate", "trl", "ray", "megatron-core"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        out["gpu"] = gpu.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        out["gpu"] = None
    return out


def comma_list(ap: argparse.ArgumentParser, key: str, value: str, allowed: tuple[str, ...]) -> list[str]:
    items = [v for v in value.split(",") if v]
    if not items or any(v not in allowed for v in items):
        ap.error(f"{key}={value!r}: use a comma list of {', '.join(allowed)}")
    return items


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=None, help="comma list of 0.5b,7b (default both; tiny with --cpu-smoke)")
    ap.add_argument("--kl", default="off,on", help="comma list of off,on")
    ap.add_argument("--corrections", default="none,token_tis", help=f"comma list of {','.join(CORRECTIONS)}")
    ap.add_argument("--repeats", type=int, default=3, help="alternating lorarl/TRL repeats per pair")
    ap.add_argument("--backends", default="fsdp", help="lorarl backends: comma list of fsdp,megatron")
    ap.add_argument("--modes", default="adapter", help="lorarl sync modes: comma list of adapter,merged")
    ap.add_argument("--systems", default="lorarl,trl")
    ap.add_argument("--only", default=None, help="comma list of run names or globs, e.g. 'trl-*-r1'")
    ap.add_argument("--steps", type=int, default=None, help=f"steps per run (default {GPU_WORK.steps})")
    ap.add_argument("--run-timeout", type=int, default=420, help="seconds per run")
    ap.add_argument(
        "--budget-s", type=float, default=None,
        help="wall seconds for the whole command: a repeat (lorarl and TRL) starts only if its expected "
        "time (the last run of each arm here, else the shape's table) still fits",
    )  # fmt: skip
    ap.add_argument("--logs", default=None, help="folder for each run's full log (default: only tails, in the JSON)")
    ap.add_argument("--cache", default=None, help="model cache (default $LORARL_CACHE or ~/.cache/lorarl)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--stem", default=None, help="file name stem (default gpu_step_<date>)")
    ap.add_argument("--append", action="store_true", help="keep an existing JSON's rows; repeats go on from them")
    ap.add_argument("--trl-launch", default="torchrun,python", help="launchers to try in order: torchrun,python")
    ap.add_argument("--trl-pythonpath", default=None, help="appended to the TRL run's PYTHONPATH (trl installed apart)")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override for every lorarl run")
    ap.add_argument(
        "--variant", action="append", default=[],
        help="NAME:KEY=VALUE [KEY=VALUE ...]: one more lorarl arm per backend and mode, run with these settings "
        "beside the preset in every repeat (how lorarl runs only, e.g. 'keep:backend.reshard_after_forward=false')",
    )  # fmt: skip
    ap.add_argument("--check-sync-tolerance", type=float, default=None, help="lorarl parity tolerance for every shape")
    ap.add_argument("--list", action="store_true", help="print the planned runs and stop")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model, fp32, CPU, 4x4x16 tokens: a smoke run")
    args = ap.parse_args(argv)
    args.shapes = comma_list(
        ap, "--shapes", args.shapes or ("tiny" if args.cpu_smoke else "0.5b,7b"), tuple(SHAPE_RUNS)
    )
    if any((s == "tiny") != args.cpu_smoke for s in args.shapes):
        ap.error("--shapes: 0.5b and 7b run on the GPU; tiny only with --cpu-smoke")
    args.kl = [k == "on" for k in comma_list(ap, "--kl", args.kl, ("off", "on"))]
    args.corrections = comma_list(ap, "--corrections", args.corrections, CORRECTIONS)
    args.backends = comma_list(ap, "--backends", args.backends, BACKENDS)
    if args.cpu_smoke and "megatron" in args.backends:
        ap.error("--backends megatron needs CUDA (Megatron's forward does); leave it out of --cpu-smoke")
    args.modes = comma_list(ap, "--modes", args.modes, MODES)
    args.systems = comma_list(ap, "--systems", args.systems, SYSTEMS)
    args.trl_launch = comma_list(ap, "--trl-launch", args.trl_launch, ("torchrun", "python"))
    try:
        args.variants = dict(parse_variant(v) for v in args.variant)
    except ValueError as exc:
        ap.error(str(exc))
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    args.work = SMOKE_WORK if args.cpu_smoke else GPU_WORK
    if args.steps is not None:
        if args.steps <= WARMUP_STEPS:
            ap.error(f"--steps must be > {WARMUP_STEPS} (medians are over steps {WARMUP_STEPS + 1}+)")
        args.work = Work(args.work.prompts, args.work.n, args.work.tokens, args.steps)
    return args


def planned(args: argparse.Namespace, kept: list[dict]) -> list[Run]:
    pair_list = [Pair(s, kl, c) for kl in args.kl for s in args.shapes for c in args.corrections]
    arms = (lorarl_arms(args.backends, args.modes, args.variants) if "lorarl" in args.systems else []) + (
        [TRL] if "trl" in args.systems else []
    )
    done: dict[str, int] = {}
    for row in kept:
        key = row["run"].rsplit("-r", 1)[0]
        done[key] = max(done.get(key, 0), row["repeat"])
    return select(plan(pair_list, arms, args.repeats, done), args.only)


class Bench:
    """One command's runs: models built once, rows written after every run."""

    def __init__(self, args: argparse.Namespace, result: dict, cache: Path, tmp: Path, js: Path):
        self.args, self.result, self.cache, self.tmp, self.js = args, result, cache, tmp, js
        self.models: dict[str, tuple[Path, float]] = {}
        self.logs = Path(args.logs) if args.logs else None
        if self.logs:
            self.logs.mkdir(parents=True, exist_ok=True)
        self.walls: dict[tuple[str, str], float] = {}

    def measure(self, run: Run, order: int) -> dict:
        """Run one system once and return its row; the fixed keys are there also when it fails."""
        args, shape = self.args, SHAPE_RUNS[run.pair.shape]
        row = {"run": run.name, "system": run.arm.system, "arm": run.arm.name, "backend": run.arm.backend}
        row.update(shape=run.pair.shape, kl=run.pair.kl, correction=run.pair.correction, mode=run.arm.mode)
        row.update(variant=run.arm.variant, variant_overrides=list(run.arm.overrides))
        row.update(repeat=run.repeat, order=order, step_s=None, tokens_per_step=None, steps_s=[], breakdown={})
        row.update(mfu_update=None, command=None)
        used, waited = (None, 0.0) if args.cpu_smoke else wait_for_free_gpu()
        row.update(gpu_memory_used_mib_before=used, gpu_wait_s=waited, before=host_state())
        t0 = time.perf_counter()
        try:
            with Sampler(gpu=not args.cpu_smoke) as sampler:
                res = self.launch(run, shape, row)
            row["during"] = sampler.summary()
            if "error" in res:
                row["error"] = res["error"]
            elif not self.logs:
                row["log_tail"] = tail(res["log"], lines=15, chars=1500)
        except Exception as exc:  # noqa: BLE001 - one failed run must not lose the others
            row["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
        row["after"] = host_state()
        row["clocks_slowed_s"] = slowdown_s(row["before"], row["after"])
        row["wall_s"] = time.perf_counter() - t0
        self.walls[(run.arm.name, run.pair.shape)] = row["wall_s"] - row.get("model_build_s", 0.0)
        return row

    def launch(self, run: Run, shape: Shape, row: dict) -> dict:
        args, work = self.args, self.args.work
        built = run.pair.shape not in self.models
        if built:
            self.models[run.pair.shape] = build_model(shape, self.cache, "cpu" if args.cpu_smoke else "cuda", 1800)
        model, build_s = self.models[run.pair.shape]
        row.update(model=str(model), model_build_s=build_s if built else 0.0)
        row["n_params"] = param_count(model_dims(shape, model))
        tolerance = args.check_sync_tolerance if args.check_sync_tolerance is not None else shape.check_sync_tolerance
        overrides = last_setting_wins(
            [*lorarl_overrides(run, shape, work, model, args.cpu_smoke, tolerance), *args.override, *run.arm.overrides]
        )
        run_cfg = compose_run(run.arm.backend or "fsdp", overrides, self.cache)
        recomputes = run_cfg.model.enable_gradient_checkpointing  # TRL runs the same setting
        batches, ordered = prompt_batches(run_cfg, work.steps)
        row["prompt_tokens_per_step"] = [sum(len(i.prompt_ids) for i in batch) * work.n for batch in batches]
        log = (self.logs or self.tmp) / f"{run.name}.log"
        if run.arm.system == "lorarl":
            res = run_lorarl(run, overrides, self.cache, self.tmp, args.run_timeout, log, work.steps)
            steps = lorarl_steps(res["rows"], row["prompt_tokens_per_step"], work.prompts * work.n)
            row.update(
                step_row(steps, row["n_params"], recomputes), **lorarl_extras(res["rows"]), startup_s=res["startup"]
            )
        else:
            from lorarl.data.dataset import write_parquet

            data = write_parquet(ordered, self.tmp / f"{run.name}.prompts.parquet")
            out = self.tmp / f"{run.name}.json"
            targs = trl_args(run, run_cfg, work, model, data, out, args.cpu_smoke)
            env = child_env(
                self.cache, {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"} if args.cpu_smoke else None
            )
            if args.trl_pythonpath:
                env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], args.trl_pythonpath])
            res = run_trl(targs, args.trl_launch, env, out, args.run_timeout, log, work.steps)
            row.update(
                launch=res["launch"], earlier_attempts=res["earlier_attempts"], init_s=res["result"].get("init_s")
            )
            row.update(
                step_row(trl_steps(res["result"]), row["n_params"], recomputes), trl_config=res["result"].get("config")
            )
            row["sync_errors"] = [s["error"] for s in res["result"].get("syncs", []) if "error" in s]
        row["command"] = f"LORARL_CACHE={self.cache} {res['command']}"
        return res

    def write(self, t_start: float) -> None:
        self.result["wall_s"] = time.perf_counter() - t_start
        self.result["pairs"] = pairs(self.result["step_compare"])
        write_json(self.js, self.result)
        self.js.with_suffix(".md").write_text(markdown(self.result))


def report_line(row: dict) -> str:
    status = f"FAILED ({row['error'].splitlines()[0][:160]})" if row.get("error") else "ok"
    mfu = "-" if row.get("mfu_update") is None else f"{row['mfu_update']:.1%}"
    sm = ((row.get("during") or {}).get("clocks.sm") or {}).get("median")
    return (
        f"[gpu_step] {row['run']}: step {fmt(row.get('step_s'))} s (median of steps {WARMUP_STEPS + 1}+), "
        f"update {fmt((row.get('breakdown') or {}).get('update_s'))} s, tokens/step {row.get('tokens_per_step')}, "
        f"mfu_update {mfu}, SM {fmt(sm, 0)} MHz, wall {row['wall_s']:.0f} s: {status}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("lorarl") is None:
        sys.path.insert(0, str(ROOT / "src"))
    from bench.common import cache_dir

    date = dt.date.today().isoformat()
    stem = args.stem or (f"gpu_step_cpu-smoke_{date}" if args.cpu_smoke else f"gpu_step_{date}")
    js = Path(args.out_dir) / f"{stem}.json"
    kept = json.loads(js.read_text()).get("step_compare", []) if args.append and js.is_file() else []
    kept = [row for row in kept if "correction" in row and "repeat" in row]  # rows of the pair format only
    runs = planned(args, kept)
    if args.list:
        print("\n".join(r.name for r in runs))
        return 0
    cache = cache_dir(args.cache)
    work = args.work
    result = {
        "date": date,
        "command": "python -m bench.gpu_step " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "cpu_smoke": args.cpu_smoke,
        "work": f"{work.prompts} prompts x {work.n} samples x {work.tokens} new tokens per step, {work.steps} steps",
        "mfu_formula": MFU_FORMULA,
        "peak_flops": PEAK_FLOPS,
        "versions": versions(),
        "step_compare": list(kept),
        "skipped": [],
    }
    print(f"[gpu_step] {len(runs)} runs: {', '.join(r.name for r in runs)}", flush=True)
    t_start = time.perf_counter()
    order = max((row.get("order") or 0 for row in kept), default=0)
    with tempfile.TemporaryDirectory(prefix="gpu_step_") as tmp_name:
        bench = Bench(args, result, cache, Path(tmp_name), js)
        # A lease's later commands size their budget from its warm runs, not the cold defaults.
        bench.walls.update(walls_of(kept))
        for group in repeat_groups(runs):
            expected = sum(estimate_wall_s(run, bench.walls) for run in group)
            if args.budget_s is not None and time.perf_counter() - t_start + expected > args.budget_s:
                result["skipped"] += [run.name for run in group]
                print(f"[gpu_step] not started, {expected:.0f} s would pass --budget-s: {group[0].pair.name}")
                continue
            for run in group:
                order += 1
                row = bench.measure(run, order)
                result["step_compare"].append(row)
                print(report_line(row), flush=True)
                bench.write(t_start)  # after every run: a later crash or a killed command keeps the finished ones
    bench.write(t_start)
    print(f"[gpu_step] wrote {js} and {js.with_suffix('.md')} ({time.perf_counter() - t_start:.0f} s)", flush=True)
    ran = {r.name for r in runs}  # rows kept by --append were judged by their own command
    return 1 if any(row.get("error") for row in result["step_compare"] if row["run"] in ran) else 0


if __name__ == "__main__":
    sys.exit(main())
