"""One GRPO step on one H200, lorarl vs TRL's GRPOTrainer, at equal algorithm, side by side.

A comparison is a `Pair` (shape, KL off/on, rollout correction), the same for both systems, run
as alternating repeats in one command (lorarl, TRL, lorarl, TRL, ...) so drift within a lease
falls on both alike. Each run is a subprocess, as users launch it: lorarl `python -m recipes.grpo
+backend=fsdp|megatron ...`; TRL through bench.trl_grpo_worker with every setting it shares read
from the composed lorarl config and the prompts in the trainer's own order. Each run's row has
its steps, phases, tokens and MFU (bench.step_report) and what the machine did before, during and
after it (bench.common.host_state, Sampler); each pair, both sides' spread over the repeats and
TRL's step over lorarl's. bench/README.md has the commands and what every column means.

    python -m bench.gpu_step --list --shapes 0.5b          # the plan, nothing run
    python -m bench.gpu_step --shapes 0.5b --kl off --corrections none --repeats 3 --budget-s 520
    python -m bench.gpu_step --cpu-smoke                   # tiny model on CPU: code paths, not a result
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import importlib.util
import itertools
import json
import os
import re
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import common, trl_grpo_worker
from bench import step_report as report

# The bench's correction names: lorarl_correction_overrides gives lorarl's keys for each, and
# bench.trl_grpo_worker.TRL_IS_MODE the TRL mode of the same arithmetic.
CORRECTIONS = ("none", *trl_grpo_worker.TRL_IS_MODE)
BACKENDS, MODES, SYSTEMS = ("fsdp", "megatron"), ("adapter", "merged"), ("lorarl", "trl")
KL_COEF = 0.001
SMOKE_MICRO = 4  # the tiny smoke run: 4 micro-batches per step, so it takes the accumulation path
STALL_REPORT_S = 180  # GPU runs: a hung call's stacks reach the log before --run-timeout ends it


@dataclass(frozen=True)
class Shape:
    model: str | None  # key of bench.common.SHAPES; None: the embedded tiny model
    preset: str  # conf/model/<preset>.yaml: its micro-batching and checkpointing are what runs
    gpu_memory_utilization: float | None
    lorarl_wall_s: float  # one run's wall seconds, start-up included, for --budget-s (2026-12-02 leases)
    trl_wall_s: float


SHAPE_RUNS = {
    "0.5b": Shape("qwen2.5-0.5b", "qwen2_5_0_5b_instruct", 0.4, lorarl_wall_s=125, trl_wall_s=60),
    "7b": Shape("qwen2.5-7b", "qwen2_5_7b_instruct", 0.35, lorarl_wall_s=250, trl_wall_s=135),
    "30b-a3b": Shape("qwen3-30b-a3b", "qwen3_30b_a3b", 0.5, lorarl_wall_s=180, trl_wall_s=150),  # 16 layers, H100
    "tiny": Shape(None, "qwen2_tiny", None, lorarl_wall_s=60, trl_wall_s=40),
}


@dataclass(frozen=True)
class Work:
    prompts: int
    n: int
    tokens: int
    steps: int


GPU_WORK = Work(prompts=32, n=8, tokens=128, steps=6)
SMOKE_WORK = Work(prompts=4, n=4, tokens=16, steps=4)


@dataclass(frozen=True)
class Pair:
    """The algorithm both systems run: shape, KL loss, rollout correction."""

    shape: str
    kl: bool
    correction: str

    @property
    def name(self) -> str:
        return f"{self.shape}-kl{'on' if self.kl else 'off'}-{self.correction}"


@dataclass(frozen=True)
class Arm:
    """One way of running a pair: lorarl on a backend and sync mode (and a named `--variant` of
    how it runs, never of what it computes), or TRL (always merged)."""

    system: str
    backend: str | None = None
    mode: str = "merged"
    variant: str | None = None
    overrides: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        if self.system == "trl":
            return "trl"
        return f"lorarl-{self.backend}-{self.mode}" + (f"-{self.variant}" if self.variant else "")


TRL = Arm("trl")


@dataclass(frozen=True)
class Run:
    arm: Arm
    pair: Pair
    repeat: int  # 1-based within the pair

    @property
    def name(self) -> str:
        return f"{self.arm.name}-{self.pair.name}-r{self.repeat}"


def lorarl_arms(backends: list[str], modes: list[str], variants: dict[str, tuple[str, ...]] | None = None) -> list[Arm]:
    """lorarl's arms, each followed by its variants; Megatron syncs adapters only."""
    return [
        Arm("lorarl", b, m, name, overrides)
        for b in backends
        for m in modes
        if not (b == "megatron" and m == "merged")
        for name, overrides in [(None, ()), *(variants or {}).items()]
    ]


# What a variant may set: how lorarl runs. The pair's algorithm (loss, KL, correction, sampling,
# LoRA, data, steps) is the same for every arm, or the ratio to TRL would compare two algorithms.
VARIANT_PREFIXES = ("backend.", "rollout.", "trainer.", "model.enable_gradient_checkpointing")
VARIANT_KEYS = ("actor.ppo_micro_batch_size_per_gpu", "actor.ppo_max_token_len_per_gpu", "actor.use_dynamic_bsz")
NOT_VARIANT_KEYS = ("rollout.n", "rollout.temperature", "rollout.top_p", "rollout.top_k", "trainer.total_steps")


def override_key(override: str) -> str:
    """The config key a Hydra override sets: `+a.b=1`, `~a.b`, `a.b=1` -> `a.b`."""
    return override.partition("=")[0].lstrip("+~")


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    """`NAME:KEY=VALUE [KEY=VALUE ...]` -> (NAME, overrides); ValueError naming what is wrong."""
    name, _, rest = text.partition(":")
    overrides = tuple(rest.split())
    if not re.fullmatch(r"[a-z0-9_]+", name) or not overrides:
        raise ValueError(f"--variant {text!r}: use NAME:KEY=VALUE [KEY=VALUE ...], NAME of a-z, 0-9 and _")
    for o in overrides:
        key = override_key(o)
        if "=" not in o or not (key.startswith(VARIANT_PREFIXES) or key in VARIANT_KEYS) or key in NOT_VARIANT_KEYS:
            settable = [p + "*" if p.endswith(".") else p for p in VARIANT_PREFIXES] + list(VARIANT_KEYS)
            raise ValueError(
                f"--variant {name}: {o!r} is not a setting of how lorarl runs; a variant may set "
                f"{', '.join(settable)}, but not {', '.join(NOT_VARIANT_KEYS)}"
            )
    return name, overrides


def plan(pairs: list[Pair], arms: list[Arm], repeats: int, done: dict[str, int] | None = None) -> list[Run]:
    """Every run, pair by pair, each repeat the arms in order (lorarl's, then TRL): L, T, L, T, ...
    `done[run name without the repeat]` repeats already measured (an earlier command of the lease)
    shift an arm's repeat numbers, so a pair can grow over several commands."""
    done = done or {}
    return [
        Run(a, p, done.get(f"{a.name}-{p.name}", 0) + r) for p in pairs for r in range(1, repeats + 1) for a in arms
    ]


def select(runs: list[Run], only: str | None) -> list[Run]:
    if not only:
        return runs
    patterns = [p for p in only.split(",") if p]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(r.name, p) for r in runs)]
    if unmatched:
        raise SystemExit(
            f"--only: {', '.join(unmatched)} matches no planned run; planned: {', '.join(r.name for r in runs)}"
        )
    return [r for r in runs if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)]


def estimate_wall_s(run: Run, walls: dict[tuple[str, str], float]) -> float:
    """A run's expected wall seconds: the last one of its arm and shape in this command, else the table."""
    shape = SHAPE_RUNS[run.pair.shape]
    return walls.get(
        (run.arm.name, run.pair.shape), shape.trl_wall_s if run.arm.system == "trl" else shape.lorarl_wall_s
    )


def walls_of(rows: list[dict]) -> dict[tuple[str, str], float]:
    """Per (arm, shape), the wall seconds of the last finished run among step_compare `rows`,
    without its model build: what estimate_wall_s expects of the next one."""
    walls = {}
    for row in sorted(rows, key=lambda r: r.get("order") or 0):
        if row.get("wall_s") and not row.get("error"):
            walls[(row["arm"], row["shape"])] = row["wall_s"] - (row.get("model_build_s") or 0.0)
    return walls


def repeat_groups(runs: list[Run]) -> list[list[Run]]:
    """The runs cut into (pair, repeat) groups, in order: the budget starts a group only whole."""
    return [list(group) for _, group in itertools.groupby(runs, key=lambda r: (r.pair, r.repeat))]


def lorarl_correction_overrides(correction: str) -> list[str]:
    """lorarl's keys for a bench correction: *_tis are truncated weights (rollout_is); *_mask are
    k1 rejection (rollout_rs) with ratios kept in [1/t, t]."""
    rc = "algorithm.rollout_correction."
    rollout_is = {"token_tis": "token", "seq_tis": "sequence"}.get(correction, "null")
    rollout_rs = {"token_mask": "token_k1", "seq_mask": "seq_sum_k1"}.get(correction, "null")
    out = [f"{rc}rollout_is={rollout_is}", f"{rc}rollout_rs={rollout_rs}"]
    return out + ([f"{rc}rollout_rs_threshold=2.0"] if rollout_rs != "null" else [])


def lorarl_overrides(run: Run, shape: Shape, work: Work, model: Path, cpu: bool) -> list[str]:
    """The run's Hydra overrides after `+backend=...` (no run folder); also composed here to
    read the settings TRL copies."""
    out = [f"model={shape.preset}", f"model.path={model}", "data=arith", f"data.max_response_length={work.tokens}"]
    out += [f"data.train_batch_size={work.prompts}", f"rollout.n={work.n}", f"actor.ppo_mini_batch_size={work.prompts}"]
    out += [f"trainer.total_steps={work.steps}", f"actor.use_kl_loss={str(run.pair.kl).lower()}"]
    out += [f"actor.kl_loss_coef={KL_COEF}", *lorarl_correction_overrides(run.pair.correction)]
    out += [f"model.lora.merge={str(run.arm.mode == 'merged').lower()}", "trainer.check_sync=true"]
    out += ["trainer.logger=[console,jsonl]", "trainer.progress_bar=false"]
    if cpu:
        out += ["trainer.device=cpu", f"actor.ppo_micro_batch_size_per_gpu={SMOKE_MICRO}"]
    else:
        out += [f"rollout.gpu_memory_utilization={shape.gpu_memory_utilization}", "rollout.enforce_eager=false"]
        out += [f"trainer.stall_report_s={STALL_REPORT_S}"]
    return out


def last_setting_wins(overrides: list[str]) -> list[str]:
    """Hydra overrides with each key once, at its last setting (an --override or a variant over
    the bench's own), so the recorded command says what ran."""
    last = {override_key(o): i for i, o in enumerate(overrides)}
    return [o for i, o in enumerate(overrides) if last[override_key(o)] == i]


def compose_run(backend: str, overrides: list[str], cache: Path):
    """The RunConfig `python -m recipes.grpo +backend=<backend> <overrides>` runs (lorarl's own composer)."""
    os.environ["LORARL_CACHE"] = str(cache)  # ${lorarl_cache:} in conf/data/arith.yaml reads it
    from lorarl.config.compose import compose

    return compose([f"+backend={backend}", *overrides])


def prompt_batches(run_cfg, steps: int) -> tuple[list[list], list[dict]]:
    """The prompt batches the trainer's loader yields for `steps` steps, and the raw rows in that
    order with one batch more, so TRL's sampler, reading them in file order, never runs short."""
    from lorarl.data.batches import prompt_batches as trainer_batches
    from lorarl.data.dataset import load_rows
    from lorarl.driver.preflight import load_tokenizer
    from lorarl.driver.prepare import prepare_data

    prepare_data(run_cfg)  # writes the arith parquet if this cache has none yet
    loader, _, _ = trainer_batches(run_cfg.data, load_tokenizer(run_cfg), run_cfg.trainer.seed, validation=False)
    batches = [loader.next_batch() for _ in range(steps + 1)]
    rows = load_rows(run_cfg.data.train_files)
    return batches[:steps], [rows[item.index] for batch in batches for item in batch]


def run_lorarl(run: Run, overrides: list[str], cache: Path, tmp: Path, timeout: int, log: Path, steps: int) -> dict:
    """One lorarl run: its command, metrics rows with a step time, start-up timings (step 0's
    init/timing/*), log, and error if it stopped short. A worker's traceback and a stalled call's
    stacks (written into the run folder) are appended to the log."""
    from lorarl.workers.stall_report import STACKS_GLOB

    run_dir = tmp / run.name
    cmd = [sys.executable, "-m", "recipes.grpo", f"+backend={run.arm.backend}", *overrides, f"hydra.run.dir={run_dir}"]
    code, text = common.run_logged(cmd, common.child_env(cache), timeout, log)
    reports = [r for r in [run_dir / "worker_traceback.txt", *sorted(run_dir.glob(STACKS_GLOB))] if r.is_file()]
    if reports:
        text += "".join(f"\n{r.name}:\n{r.read_text(errors='replace')}" for r in reports)
        log.write_text(text)
    rows, startup = report.lorarl_metrics(run_dir / "metrics.jsonl")
    out = dict(command=shlex.join(["python", *cmd[1:]]), exit_code=code, rows=rows, log=text, startup=startup)
    return {**out, **stopped_short(code, len(rows), steps, text)}


def stopped_short(code: int | None, done: int, steps: int, log: str) -> dict:
    """{"error": why and the log's tail} for a run that failed or ran fewer than `steps` steps."""
    if code == 0 and done >= steps:
        return {}
    return {
        "error": f"{'timed out' if code is None else f'exit {code}'} after {done} steps; log tail:\n{common.tail(log)}"
    }


def run_trl(run: Run, run_cfg, model: Path, data: Path, env: dict, timeout: int, log: Path, cpu: bool) -> dict:
    """TRL on the same model and prompts with the run config's settings, under torchrun (which sets
    the RANK/WORLD_SIZE/MASTER_* that vLLM's external_launcher, TRL's colocate mode, reads)."""
    out, steps = data.with_suffix(".json"), run_cfg.trainer.total_steps
    args = ["--model", str(model), "--train-parquet", str(data), "--keep-order", "--ignore-eos", "--out", str(out)]
    args += ["--workdir", str(out.with_suffix(".trl_out"))]
    args += trl_grpo_worker.lorarl_options(run_cfg, run.pair.correction, cpu)
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd = [*head, "-m", "bench.trl_grpo_worker", *args]
    out.unlink(missing_ok=True)
    code, text = common.run_logged(cmd, env, timeout, log)
    result = json.loads(out.read_text()) if out.is_file() else {}
    res = {"command": shlex.join(["python", *cmd[1:]]), "exit_code": code, "result": result, "log": text}
    return {**res, **stopped_short(code, len(result.get("steps", [])), steps, text)}


# --- The command.
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    lists = {  # comma-list options: (default, allowed)
        "shapes": (None, tuple(SHAPE_RUNS)),
        "kl": ("off,on", ("off", "on")),
        "corrections": ("none,token_tis", CORRECTIONS),
        "backends": ("fsdp", BACKENDS),
        "modes": ("adapter", MODES),
        "systems": ("lorarl,trl", SYSTEMS),
    }
    for key, (default, allowed) in lists.items():
        ap.add_argument(f"--{key}", default=default, help=f"comma list of {','.join(allowed)}")
    ap.add_argument("--repeats", type=int, default=3, help="alternating lorarl/TRL repeats per pair")
    ap.add_argument("--only", default=None, help="comma list of run names or globs, e.g. 'trl-*-r1'")
    ap.add_argument("--steps", type=int, default=None, help=f"steps per run (default {GPU_WORK.steps})")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of every shape (default: all; 30b-a3b "
                    "on an H100: 24, with --override rollout.gpu_memory_utilization=0.55)")  # fmt: skip
    ap.add_argument("--run-timeout", type=int, default=420, help="seconds per run")
    ap.add_argument("--budget-s", type=float, default=None, help="wall seconds for the command: a repeat starts "
                    "only if its expected time (this arm's last run here, else the shape's table) still fits")  # fmt: skip
    ap.add_argument("--logs", default=None, help="folder for each run's full log (default: only tails, in the JSON)")
    ap.add_argument("--cache", default=None, help="model cache (default $LORARL_CACHE or ~/.cache/lorarl)")
    ap.add_argument("--out-dir", default=str(common.ROOT / "bench" / "results"))
    ap.add_argument("--stem", default=None, help="file name stem (default gpu_step_<date>)")
    ap.add_argument("--append", action="store_true", help="keep an existing JSON's rows; repeats go on from them")
    ap.add_argument("--trl-pythonpath", default=None, help="appended to the TRL run's PYTHONPATH (trl installed apart)")
    ap.add_argument("--override", action="append", default=[], help="extra Hydra override for every lorarl run")
    ap.add_argument("--variant", action="append", default=[], help="NAME:KEY=VALUE [KEY=VALUE ...]: one more lorarl "
                    "arm per backend and mode with these settings of how it runs ('keep:backend.reshard_after_forward=false')")  # fmt: skip
    ap.add_argument("--list", action="store_true", help="print the planned runs and stop")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model, fp32, CPU, 4x4x16 tokens: a smoke run")
    args = ap.parse_args(argv)
    args.shapes = args.shapes or ("tiny" if args.cpu_smoke else "0.5b,7b")
    for key, (_, allowed) in lists.items():
        items = [v for v in getattr(args, key).split(",") if v]
        if not items or any(v not in allowed for v in items):
            ap.error(f"--{key}={getattr(args, key)!r}: use a comma list of {', '.join(allowed)}")
        setattr(args, key, items)
    args.kl = [k == "on" for k in args.kl]
    if any((s == "tiny") != args.cpu_smoke for s in args.shapes):
        ap.error("--shapes: 0.5b, 7b and 30b-a3b run on the GPU; tiny only with --cpu-smoke")
    if args.cpu_smoke and "megatron" in args.backends:
        ap.error("--backends megatron needs CUDA (Megatron's forward does); leave it out of --cpu-smoke")
    try:
        args.variants = dict(parse_variant(v) for v in args.variant)
    except ValueError as exc:
        ap.error(str(exc))
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.steps is not None and args.steps <= report.WARMUP_STEPS:
        ap.error(f"--steps must be > {report.WARMUP_STEPS} (medians are over steps {report.WARMUP_STEPS + 1}+)")
    work = SMOKE_WORK if args.cpu_smoke else GPU_WORK
    args.work = Work(work.prompts, work.n, work.tokens, args.steps or work.steps)
    return args


def planned(args: argparse.Namespace, kept: list[dict]) -> list[Run]:
    """This command's runs; `kept` rows (--append) say how many repeats each arm already has."""
    pair_list = [Pair(s, kl, c) for kl in args.kl for s in args.shapes for c in args.corrections]
    arms = lorarl_arms(args.backends, args.modes, args.variants) if "lorarl" in args.systems else []
    done: dict[str, int] = {}
    for row in kept:
        key = row["run"].rsplit("-r", 1)[0]
        done[key] = max(done.get(key, 0), row["repeat"])
    return select(plan(pair_list, arms + ([TRL] if "trl" in args.systems else []), args.repeats, done), args.only)


def launch(args: argparse.Namespace, run: Run, model: Path, cache: Path, tmp: Path, row: dict) -> dict:
    """Run one system once and fill its `row` with the step numbers; the launch's result."""
    work, shape = args.work, SHAPE_RUNS[run.pair.shape]
    overrides = last_setting_wins(
        [*lorarl_overrides(run, shape, work, model, args.cpu_smoke), *args.override, *run.arm.overrides]
    )
    run_cfg = compose_run(run.arm.backend or "fsdp", overrides, cache)
    recomputes = run_cfg.model.enable_gradient_checkpointing  # TRL runs the same setting
    batches, ordered = prompt_batches(run_cfg, work.steps)
    row["prompt_tokens_per_step"] = [sum(len(i.prompt_ids) for i in batch) * work.n for batch in batches]
    log = Path(args.logs or tmp) / f"{run.name}.log"
    if run.arm.system == "lorarl":
        res = run_lorarl(run, overrides, cache, tmp, args.run_timeout, log, work.steps)
        steps = report.lorarl_steps(res["rows"], row["prompt_tokens_per_step"], work.prompts * work.n)
        row.update(
            report.step_row(steps, row["n_params"], recomputes),
            **report.lorarl_extras(res["rows"]),
            startup_s=res["startup"],
        )
    else:
        from lorarl.data.dataset import write_parquet

        data = write_parquet(ordered, tmp / f"{run.name}.prompts.parquet")
        env = common.child_env(
            cache, {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"} if args.cpu_smoke else None
        )
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env["PYTHONPATH"], args.trl_pythonpath) if p)
        res = run_trl(run, run_cfg, model, data, env, args.run_timeout, log, args.cpu_smoke)
        row.update(
            report.step_row(report.trl_steps(res["result"]), row["n_params"], recomputes),
            init_s=res["result"].get("init_s"),
        )
        row["trl_config"] = res["result"].get("config")
        row["sync_errors"] = [s["error"] for s in res["result"].get("syncs", []) if "error" in s]
    row["command"] = f"LORARL_CACHE={cache} {res['command']}"
    return res


def measure(args: argparse.Namespace, run: Run, order: int, models: dict, cache: Path, tmp: Path) -> dict:
    """One run's row, with what the machine did before, during and after; the fixed keys are
    there also when it fails. `models` holds each shape's model once built."""
    row = {"run": run.name, "system": run.arm.system, "arm": run.arm.name, "backend": run.arm.backend}
    row.update(shape=run.pair.shape, kl=run.pair.kl, correction=run.pair.correction, mode=run.arm.mode)
    row.update(variant=run.arm.variant, variant_overrides=list(run.arm.overrides), repeat=run.repeat, order=order)
    row.update(step_s=None, tokens_per_step=None, steps_s=[], breakdown={}, mfu_update=None, command=None)
    used, waited = (None, 0.0) if args.cpu_smoke else common.wait_for_free_gpu()
    row.update(gpu_memory_used_mib_before=used, gpu_wait_s=waited, before=common.host_state())
    t0 = time.perf_counter()
    try:
        shape, built, on = SHAPE_RUNS[run.pair.shape], run.pair.shape not in models, "cpu" if args.cpu_smoke else "cuda"
        if built:
            models[run.pair.shape] = common.model_in_subprocess(shape.model, cache, on, args.layers)
        model, build_s = models[run.pair.shape]
        dims = json.loads((model / "config.json").read_text())
        row.update(model=str(model), model_build_s=build_s if built else 0.0, n_params=report.param_count(dims))
        with common.Sampler(gpu=not args.cpu_smoke) as sampler:
            res = launch(args, run, model, cache, tmp, row)
        row["during"] = sampler.summary()
        if "error" in res:
            row["error"] = res["error"]
        elif not args.logs:
            row["log_tail"] = common.tail(res["log"], lines=15, chars=1500)
    except Exception as exc:  # noqa: BLE001 - one failed run must not lose the others
        row["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
    row["after"] = common.host_state()
    row["clocks_slowed_s"] = common.slowdown_s(row["before"], row["after"])
    row["wall_s"] = time.perf_counter() - t0
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if importlib.util.find_spec("lorarl") is None:  # a checkout without lorarl installed
        sys.path.insert(0, str(common.ROOT / "src"))
    date = dt.date.today().isoformat()
    js = Path(args.out_dir) / f"{args.stem or ('gpu_step_cpu-smoke_' if args.cpu_smoke else 'gpu_step_') + date}.json"
    earlier = json.loads(js.read_text()) if args.append and js.is_file() else {}  # its rows and commands go on
    kept = [row for row in earlier.get("step_compare", []) if "correction" in row and "repeat" in row]  # pair rows
    runs = planned(args, kept)
    if args.list:
        print("\n".join(r.name for r in runs))
        return 0
    cache, work = common.cache_dir(args.cache), args.work
    result = {
        "date": date,
        "commands": [*earlier.get("commands", []), "python -m bench.gpu_step " + shlex.join(argv or sys.argv[1:])],
        "cpu_smoke": args.cpu_smoke,
        "work": f"{work.prompts} prompts x {work.n} samples x {work.tokens} new tokens per step, {work.steps} steps",
        "mfu_formula": report.MFU_FORMULA,
        "peak_flops": report.PEAK_FLOPS,
        "versions": common.versions(),
        "step_compare": list(kept),
        "skipped": [],
    }
    print(f"[gpu_step] {len(runs)} runs: {', '.join(r.name for r in runs)}", flush=True)

    def write() -> None:
        result.update(wall_s=time.perf_counter() - t_start, pairs=report.pairs(result["step_compare"]))
        common.write_json(js, result)
        js.with_suffix(".md").write_text(report.markdown(result))

    t_start, models = time.perf_counter(), {}
    order = max((row.get("order") or 0 for row in kept), default=0)
    walls = walls_of(kept)  # a lease's later commands size their budget from its warm runs
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_step_") as tmp:
        for group in repeat_groups(runs):
            expected = sum(estimate_wall_s(run, walls) for run in group)
            if args.budget_s is not None and time.perf_counter() - t_start + expected > args.budget_s:
                result["skipped"] += [run.name for run in group]
                print(f"[gpu_step] not started, {expected:.0f} s would pass --budget-s: {group[0].pair.name}")
                continue
            for run in group:
                order += 1
                row = measure(args, run, order, models, cache, Path(tmp))
                walls[(run.arm.name, run.pair.shape)] = row["wall_s"] - row.get("model_build_s", 0.0)
                result["step_compare"].append(row)
                print(report.report_line(row), flush=True)
                write()  # after every run: a later crash or a killed command keeps the finished ones
    write()
    print(f"[gpu_step] wrote {js} and {js.with_suffix('.md')} ({time.perf_counter() - t_start:.0f} s)", flush=True)
    ran = {r.name for r in runs}  # rows kept by --append were judged by their own command
    return 1 if any(row.get("error") for row in result["step_compare"] if row["run"] in ran) else 0


if __name__ == "__main__":
    sys.exit(main())
