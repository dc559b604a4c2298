"""One GRPO step on one H200, lorarl vs TRL's GRPOTrainer, same work, side by side.

Each run is a subprocess, as users launch it:
  lorarl  `python -m recipes.grpo +backend=fsdp model=<preset> model.path=<shaped model> data=arith
          data.max_response_length=128 data.train_batch_size=32 rollout.n=8 actor.ppo_mini_batch_size=32
          rollout.gpu_memory_utilization=<0.4 | 0.35> rollout.enforce_eager=false trainer.check_sync=true ...`
          (the work of ../shared/tools/gpu-vllm/step.sh; micro-batching and activation checkpointing
          as the model preset sets them), KL loss off/on, adapter or merged sync;
  trl     `python -m torch.distributed.run --standalone --nproc_per_node=1 -m bench.trl_grpo_worker ...`:
          GRPOTrainer, PEFT LoRA, vLLM colocate, the same model, prompts (lorarl's loader order,
          read through lorarl's own loader), batch (32 prompts x 8 completions x 128 tokens, one
          optimizer step per generation in micro-batches of lorarl's size), LoRA rank/alpha, lr,
          gradient checkpointing and vLLM memory share, all read from the composed lorarl config.
Random weights rarely sample EOS; TRL runs with ignore_eos so every completion is 128 tokens
(lorarl's response length is recorded per step to show the same).

Per run: seconds per step (median over steps 3+), the phase breakdown, real (unpadded) prompt
+ response tokens per step, and update MFU:
  mfu_update    = 4 * N * tokens_per_step / (update_s * 989e12)
  mfu_update_hw = 6 * N * tokens_per_step / (update_s * 989e12)   (gradient checkpointing on)
4N per token is a frozen-base LoRA update: forward (2N) + activation-gradient backward (2N);
no weight gradients for the base (the LoRA matmuls, <2% of N at rank 64, are not counted);
_hw adds the forward recomputed by gradient checkpointing (2N). N = all parameters counted from
the shape (embedding included; lm_head once more when untied), attention-score FLOPs are left
out (sequences of ~170 tokens). 989e12 is the dense bf16 peak of an H100/H200 SXM.

    python -m bench.gpu_step                                 # everything, most important first
    python -m bench.gpu_step --shapes 0.5b --kl off --modes adapter
    python -m bench.gpu_step --only lorarl-0.5b-adapter-kloff,trl-0.5b-merged-kloff
    python -m bench.gpu_step --cpu-smoke                     # tiny model on CPU: the code paths, not a result

Writes <out-dir>/<stem>.json (`step_compare`: one object per run) and <stem>.md. With --append,
rows already in that JSON for runs not run now are kept (split a long plan over several
commands). A failed run keeps its log tail as `error`; the exit status is 1 if any run failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import importlib.metadata
import importlib.util
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import ROOT, SHAPES, shaped_model_path, write_json

PEAK_FLOPS = 989e12  # dense bf16, H100/H200 SXM
MFU_FORMULA = (
    "mfu_update = 4*N*tokens_per_step / (update_s * 989e12): frozen-base LoRA update = forward 2N + "
    "activation-gradient backward 2N per token, no base weight gradients, LoRA matmuls and attention scores "
    "not counted; mfu_update_hw = 6*N*tokens_per_step / (...) also counts the forward recomputed by gradient "
    "checkpointing. N = all parameters from the shape (embedding included, lm_head again when untied). "
    "update_s: lorarl timing/update (forward+backward+optimizer, no log-prob passes); TRL step minus "
    "_generate_and_score_completions."
)
KL_COEF = 0.001
WARMUP_STEPS = 2  # medians are over steps 3+
LORARL_PHASES = (
    "timing/gen",
    "timing/ref_logp",
    "timing/old_logp",
    "timing/update",
    "timing/sleep",
    "timing/wake",
    "timing/sync",
    "sync/seconds",
    "timing/train",
    "timing/step",
)
ABSENT_IS_ZERO = {"timing/old_logp", "timing/ref_logp", "timing/sleep", "timing/wake"}
TRL_PHASES = ("generation_s", "sync_s", "logp_s", "score_s", "update_s", "step_s")


@dataclass(frozen=True)
class Shape:
    """How one model size runs: the settings of ../shared/tools/gpu-vllm/step.sh."""

    model: str | None  # key of bench.common.SHAPES; None: the embedded tiny model
    preset: str  # conf/model/<preset>.yaml: its micro-batching and checkpointing are what runs
    gpu_memory_utilization: float | None
    # trainer.check_sync_tolerance (None: the project's default checks by precision).
    check_sync_tolerance: float | None = None


SHAPE_RUNS = {
    "0.5b": Shape("qwen2.5-0.5b", "qwen2_5_0_5b_instruct", 0.4),
    "7b": Shape("qwen2.5-7b", "qwen2_5_7b_instruct", 0.35),
    "tiny": Shape(None, "qwen2_tiny", None),
}
SMOKE_MICRO = 4  # the tiny smoke run: 4 micro-batches per step, so it takes the accumulation path


@dataclass(frozen=True)
class Work:
    prompts: int
    n: int
    tokens: int
    steps: int


GPU_WORK = Work(prompts=32, n=8, tokens=128, steps=6)
SMOKE_WORK = Work(prompts=4, n=4, tokens=16, steps=4)


@dataclass(frozen=True)
class Run:
    system: str  # lorarl | trl
    shape: str
    kl: bool
    mode: str  # adapter | merged (TRL merges LoRA and pushes every weight: always merged)

    @property
    def name(self) -> str:
        return f"{self.system}-{self.shape}-{self.mode}-kl{'on' if self.kl else 'off'}"


def plan(shapes: list[str], kls: list[bool], modes: list[str], systems: list[str]) -> list[Run]:
    """Every requested run, most important first: adapter lorarl and TRL without KL (0.5B, then
    7B), the same with KL, then lorarl merged without and with KL."""
    runs = []
    for kl in kls:
        for shape in shapes:
            for system in systems:
                if system == "trl":
                    runs.append(Run("trl", shape, kl, "merged"))
                else:
                    runs += [Run("lorarl", shape, kl, mode) for mode in modes]

    return sorted(runs, key=lambda run: priority(run, shapes, systems))


def priority(run: Run, shapes: list[str], systems: list[str]) -> tuple:
    tier = (2 if run.system == "lorarl" and run.mode == "merged" else 0) + int(run.kl)
    return (tier, shapes.index(run.shape), systems.index(run.system))


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


def param_count(dims: dict) -> int:
    """All parameters of a Qwen2 with these dims (q/k/v biases, two norms per layer, final norm)."""
    d, inter, layers, vocab = (
        dims["hidden_size"],
        dims["intermediate_size"],
        dims["num_hidden_layers"],
        dims["vocab_size"],
    )
    head_dim = dims.get("head_dim") or d // dims["num_attention_heads"]
    q, kv = dims["num_attention_heads"] * head_dim, dims["num_key_value_heads"] * head_dim
    attn = d * q + q + 2 * (d * kv + kv) + q * d
    per_layer = attn + 3 * d * inter + 2 * d
    embed = vocab * d
    return embed + layers * per_layer + d + (0 if dims.get("tie_word_embeddings") else embed)


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def tail(text: str, lines: int = 40, chars: int = 4000) -> str:
    return "\n".join(text.splitlines()[-lines:])[-chars:]


def child_env(cache: Path, extra: dict | None = None) -> dict:
    path = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
        "LORARL_CACHE": str(cache),
        "PYTHONUNBUFFERED": "1",
        "PYTHONWARNINGS": "ignore",
        "TOKENIZERS_PARALLELISM": "false",
        **(extra or {}),
    }


def run_logged(cmd: list[str], env: dict, timeout: int, log: Path) -> tuple[int | None, str]:
    """Run `cmd` in its own process group with stdout+stderr into `log`; on timeout the whole
    group gets SIGTERM (lorarl shuts vLLM and Ray down on it), then SIGKILL after 30 s, so no
    engine is left holding GPU memory for the next run. Returns (exit code or None, log text)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
            for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
    return code, log.read_text(errors="replace")


def gpu_memory_used_mib() -> int | None:
    """GPU memory in use before a run (nvidia-smi, so this process never holds a CUDA context)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return int(out.stdout.split()[0]) if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def wait_for_free_gpu(limit_mib: int = 2048, timeout_s: float = 180.0) -> tuple[int | None, float]:
    """(GPU memory in use, seconds waited) once at most `limit_mib` is in use or after `timeout_s`.

    A process of the run before (a TRL worker outliving its killed launcher) can still be
    releasing memory, and vLLM refuses to start when free memory grows during its profile."""
    t0 = time.perf_counter()
    used = gpu_memory_used_mib()
    while used is not None and used > limit_mib and time.perf_counter() - t0 < timeout_s:
        time.sleep(2.0)
        used = gpu_memory_used_mib()
    return used, time.perf_counter() - t0


def build_model(shape: Shape, cache: Path, device: str, timeout: int) -> tuple[Path, float]:
    """The shaped random model (built once under <cache>/bench/, in a subprocess so this process
    never holds GPU memory), or the embedded tiny model."""
    t0 = time.perf_counter()
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


# ---- lorarl ----------------------------------------------------------------------------------


def lorarl_overrides(run: Run, shape: Shape, work: Work, model: Path, cpu: bool, tolerance: float | None) -> list[str]:
    """The Hydra overrides of the run (no run folder): also composed here to read the settings TRL copies."""
    out = [
        f"model={shape.preset}",
        f"model.path={model}",
        "data=arith",
        f"data.max_response_length={work.tokens}",
        f"data.train_batch_size={work.prompts}",
        f"rollout.n={work.n}",
        f"actor.ppo_mini_batch_size={work.prompts}",
        f"trainer.total_steps={work.steps}",
        f"actor.use_kl_loss={str(run.kl).lower()}",
        f"actor.kl_loss_coef={KL_COEF}",
        f"model.lora.merge={str(run.mode == 'merged').lower()}",
        "trainer.check_sync=true",
        "trainer.logger=[console,jsonl]",
        "trainer.progress_bar=false",
    ]
    if cpu:
        out += ["trainer.device=cpu", f"actor.ppo_micro_batch_size_per_gpu={SMOKE_MICRO}"]
    else:
        out += [f"rollout.gpu_memory_utilization={shape.gpu_memory_utilization}", "rollout.enforce_eager=false"]
    if tolerance is not None:
        out.append(f"trainer.check_sync_tolerance={tolerance}")
    return out


def compose_run(overrides: list[str], cache: Path):
    """The RunConfig `python -m recipes.grpo +backend=fsdp <overrides>` runs (lorarl's own composer)."""
    os.environ["LORARL_CACHE"] = str(cache)  # ${lorarl_cache:} in conf/data/arith.yaml reads it
    from lorarl.config import compose

    return compose(["+backend=fsdp", *overrides])


def prompt_batches(run_cfg, steps: int) -> tuple[list[list], list[dict]]:
    """The prompt batches lorarl's loader yields for `steps` steps (its own code, same seed), and
    the raw rows in that order, plus one more batch so TRL's sampler never runs short."""
    from lorarl.data.dataset import PromptLoader, build_prompts, load_rows
    from lorarl.preflight import load_tokenizer
    from lorarl.trainer import prepare_data

    prepare_data(run_cfg)  # writes the arith parquet if this cache has none yet
    d = run_cfg.data
    rows = load_rows(d.train_files)
    items, _ = build_prompts(
        rows, load_tokenizer(run_cfg), d.max_prompt_length, d.filter_overlong_prompts, d.truncation
    )
    loader = PromptLoader(items, d.train_batch_size, shuffle=d.shuffle, seed=run_cfg.trainer.seed)
    batches = [loader.next_batch() for _ in range(steps + 1)]
    ordered = [rows[item.index] for batch in batches for item in batch]
    return batches[:steps], ordered


def run_lorarl(run: Run, overrides: list[str], cache: Path, tmp: Path, timeout: int, log: Path) -> dict:
    run_dir = tmp / run.name
    cmd = [sys.executable, "-m", "recipes.grpo", "+backend=fsdp", *overrides, f"hydra.run.dir={run_dir}"]
    code, text = run_logged(cmd, child_env(cache), timeout, log)
    metrics = run_dir / "metrics.jsonl"
    rows = (
        [json.loads(line) for line in metrics.read_text().splitlines() if '"timing/step"' in line]
        if metrics.is_file()
        else []
    )
    out = {"command": shlex.join(["python", *cmd[1:]]), "exit_code": code, "rows": rows, "log": text}
    if code != 0 or len(rows) < int(overrides_value(overrides, "trainer.total_steps")):
        why = "timed out" if code is None else f"exit {code}"
        out["error"] = f"{why} after {len(rows)} steps; log tail:\n{tail(text)}"
    return out


def overrides_value(overrides: list[str], key: str) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith(key + "="))


def lorarl_row(result: dict, prompt_tokens: list[int], completions: int, n_params: int) -> dict:
    """Medians over steps 3+ of metrics.jsonl; tokens per step = the step's prompt tokens
    (from lorarl's loader) x n + its mean response length x completions."""
    rows = result["rows"]
    measured = rows[WARMUP_STEPS:]
    breakdown = {}
    for key in LORARL_PHASES:
        values = [r.get(key, 0.0 if key in ABSENT_IS_ZERO else None) for r in measured]
        if values and all(v is not None for v in values):
            breakdown[key] = median(values)
    tokens = [
        prompt_tokens[r["step"] - 1] + round(r["response_length/mean"] * completions)
        for r in rows
        if "response_length/mean" in r and 0 < r.get("step", 0) <= len(prompt_tokens)
    ]
    step_tokens = median(tokens[WARMUP_STEPS:]) if len(tokens) > WARMUP_STEPS else None
    out = {
        "steps_s": [r["timing/step"] for r in rows],
        "step_s": median([r["timing/step"] for r in measured]),
        "tokens_per_step": step_tokens,
        "tokens_per_step_each": tokens,
        "breakdown": breakdown,
        "response_length_mean": [r.get("response_length/mean") for r in rows],
        "sync_kind": rows[-1].get("sync/kind") if rows else None,
        "sync_bytes": rows[-1].get("sync/bytes") if rows else None,
        "sync_logprob_diff_max": max((r.get("sync/logprob_diff_max", 0.0) for r in rows), default=None),
        "memory_max_allocated_gib": max((r.get("memory/max_allocated_gib", 0.0) for r in rows), default=None),
        # The rollout/trainer mismatch the update sees (vLLM's sampled-token log-probs against
        # the trainer's, bf16 on both sides): k3 KL and the largest ratio, per step.
        "rollout_corr_kl": [r.get("rollout_corr/kl") for r in rows],
        "rollout_corr_ratio_max": [r.get("rollout_corr/ratio_max") for r in rows],
    }
    out.update(mfu(n_params, step_tokens, breakdown.get("timing/update")))
    return out


# ---- TRL -------------------------------------------------------------------------------------


def trl_command(launch: str, args: list[str]) -> list[str]:
    if launch == "torchrun":
        # Sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, which vLLM's external_launcher
        # (TRL's colocate mode) reads.
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m"]
    else:
        head = [sys.executable, "-m"]
    return [*head, "bench.trl_grpo_worker", *args]


def trl_micro_batch(run_cfg, work: Work) -> int:
    """TRL's per_device_train_batch_size for lorarl's micro-batching: its row count, or for a
    token budget the rows of the longest sequences that fit it, rounded down to a power of two
    (TRL needs it to divide the 256 completions of a step)."""
    a, d = run_cfg.actor, run_cfg.data
    rows = (
        a.ppo_max_token_len_per_gpu // (d.max_prompt_length + d.max_response_length)
        if a.use_dynamic_bsz
        else a.ppo_micro_batch_size_per_gpu
    )
    rows = max(1, min(rows, work.prompts * work.n))
    return 1 << (rows.bit_length() - 1)


def trl_args(run: Run, run_cfg, work: Work, shape: Shape, model: Path, data: Path, out: Path, cpu: bool, is_corr: str):
    r, d, m = run_cfg.rollout, run_cfg.data, run_cfg.model
    args = [
        "--model", str(model),
        "--train-parquet", str(data),
        "--keep-order",
        "--ignore-eos",
        "--steps", str(work.steps),
        "--prompts", str(work.prompts),
        "--samples", str(work.n),
        "--max-tokens", str(work.tokens),
        "--out", str(out),
        "--workdir", str(out.with_suffix(".trl_out")),
        "--device", "cpu" if cpu else "cuda",
        "--dtype", m.dtype,
        "--rank", str(m.lora.rank),
        "--alpha", str(m.lora.alpha),
        "--lr", str(run_cfg.actor.optim.lr),
        "--beta", str(KL_COEF if run.kl else 0.0),
        "--micro-batch", str(trl_micro_batch(run_cfg, work)),
        "--gradient-checkpointing", "on" if m.enable_gradient_checkpointing else "off",
        "--max-model-len", str(r.max_model_len or d.max_prompt_length + d.max_response_length),
        "--temperature", str(r.temperature),
        "--vllm-is-correction", is_corr,
    ]  # fmt: skip
    if cpu:
        args += ["--threads", "1"]  # see bench.peer_trl: one process sharing two cores with vLLM
    else:
        args += ["--vllm-gpu-memory-utilization", str(r.gpu_memory_utilization)]
    return args


def run_trl(
    run: Run,
    args: list[str],
    launches: list[str],
    cache: Path,
    out: Path,
    timeout: int,
    log: Path,
    trl_path: str | None,
) -> dict:
    """TRL under the first launcher that gets through a step; the next one only runs when the
    previous stopped before its first step (a launch problem, not a measurement)."""
    attempts = []
    for launch in launches:
        out.unlink(missing_ok=True)
        cmd = trl_command(launch, args)
        extra = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"} if "--threads" in args else {}
        env = child_env(cache, extra)
        if trl_path:
            env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], trl_path])
        code, text = run_logged(cmd, env, timeout, log)
        result = json.loads(out.read_text()) if out.is_file() else {}
        steps = result.get("steps", [])
        attempt = {"command": shlex.join(["python", *cmd[1:]]), "exit_code": code, "launch": launch}
        if code != 0 or len(steps) < int(args[args.index("--steps") + 1]):
            why = "timed out" if code is None else f"exit {code}"
            attempt["error"] = f"{why} after {len(steps)} steps; log tail:\n{tail(text)}"
        attempts.append(attempt)
        if "error" not in attempt or steps:
            return {**attempt, "result": result, "log": text, "earlier_attempts": attempts[:-1]}
    return {**attempts[-1], "result": {}, "log": text, "earlier_attempts": attempts[:-1]}


def trl_row(result: dict, n_params: int) -> dict:
    steps = result.get("steps", [])
    measured = steps[WARMUP_STEPS:]
    breakdown = {
        key: median([s.get(key, 0.0) for s in measured]) for key in TRL_PHASES if measured and key in measured[-1]
    }
    tokens = [round(s["prompt_tokens"] + s["completion_tokens"]) for s in steps if "prompt_tokens" in s]
    step_tokens = median(tokens[WARMUP_STEPS:]) if len(tokens) > WARMUP_STEPS else None
    out = {
        "steps_s": [s["step_s"] for s in steps],
        "step_s": median([s["step_s"] for s in measured]),
        "tokens_per_step": step_tokens,
        "tokens_per_step_each": tokens,
        "breakdown": breakdown,
        "response_length_mean": [s["completion_tokens"] / s["completions"] for s in steps if s.get("completions")],
        "init_s": result.get("init_s"),
        "sync_errors": [s["error"] for s in result.get("syncs", []) if "error" in s],
        "trl_config": result.get("config"),
    }
    out.update(mfu(n_params, step_tokens, breakdown.get("update_s")))
    return out


# ---- results ---------------------------------------------------------------------------------


def mfu(n_params: int, tokens: float | None, update_s: float | None) -> dict:
    if not tokens or not update_s:
        return {"mfu_update": None, "mfu_update_hw": None}
    return {
        "mfu_update": 4 * n_params * tokens / (update_s * PEAK_FLOPS),
        "mfu_update_hw": 6 * n_params * tokens / (update_s * PEAK_FLOPS),
    }


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "vllm", "transformers", "peft", "accelerate", "trl", "ray"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        out["gpu"] = gpu.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        out["gpu"] = None
    return out


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(result: dict) -> str:
    lines = [
        f"# GPU step: lorarl vs TRL GRPOTrainer ({result['date']})",
        "",
        f"`{result['command']}`",
        "",
        f"{result['work']}. Step: median over steps {WARMUP_STEPS + 1}+. {result['mfu_formula']}",
        "",
        "| run | system | shape | KL | mode | step s | steps s | tokens/step | gen | logp | update | sync | "
        "sleep+wake | MFU update (4N / 6N) | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["step_compare"]:
        b = row.get("breakdown") or {}
        if row["system"] == "lorarl":
            gen, sync = b.get("timing/gen"), b.get("timing/sync")
            logp = (b.get("timing/ref_logp") or 0.0) + (b.get("timing/old_logp") or 0.0) if b else None
            update = b.get("timing/update")
            sleep = (b.get("timing/sleep") or 0.0) + (b.get("timing/wake") or 0.0) if b else None
        else:
            gen, sync, logp, update, sleep = (
                b.get("generation_s"),
                b.get("sync_s"),
                b.get("logp_s"),
                b.get("update_s"),
                None,
            )
        m4, m6 = row.get("mfu_update"), row.get("mfu_update_hw")
        mfu_text = "-" if m4 is None else f"{m4:.1%} / {m6:.1%}"
        note = row.get("error", "").splitlines()[0][:80] if row.get("error") else ""
        steps = " ".join(f"{s:.1f}" for s in row.get("steps_s") or [])
        lines.append(
            f"| {row['run']} | {row['system']} | {row['shape']} | {'on' if row['kl'] else 'off'} | {row['mode']} | "
            f"{fmt_s(row.get('step_s'))} | {steps} | {row.get('tokens_per_step') or '-'} | {fmt_s(gen)} | "
            f"{fmt_s(logp)} | {fmt_s(update)} | {fmt_s(sync)} | {fmt_s(sleep)} | {mfu_text} | {note} |"
        )
    lines += ["", "Commands:", ""] + [
        f"- `{row['run']}`: `{row.get('command', '-')}`" for row in result["step_compare"]
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=None, help="comma list of 0.5b,7b (default both; tiny with --cpu-smoke)")
    ap.add_argument("--kl", default="off,on", help="comma list of off,on")
    ap.add_argument("--modes", default="adapter,merged", help="lorarl sync modes: comma list of adapter,merged")
    ap.add_argument("--systems", default="lorarl,trl")
    ap.add_argument("--only", default=None, help="comma list of run names or globs, e.g. 'lorarl-0.5b-*'")
    ap.add_argument("--steps", type=int, default=None, help=f"steps per run (default {GPU_WORK.steps})")
    ap.add_argument("--run-timeout", type=int, default=420, help="seconds per run")
    ap.add_argument("--logs", default=None, help="folder for each run's full log (default: only tails, in the JSON)")
    ap.add_argument("--cache", default=None, help="model cache (default $LORARL_CACHE or ~/.cache/lorarl)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--stem", default=None, help="file name stem (default gpu_step_<date>)")
    ap.add_argument("--append", action="store_true", help="keep the rows of runs not run now from an existing JSON")
    ap.add_argument("--trl-launch", default="torchrun,python", help="launchers to try in order: torchrun,python")
    ap.add_argument(
        "--trl-pythonpath", default=None, help="appended to the TRL run's PYTHONPATH only (trl installed apart)"
    )
    ap.add_argument("--trl-is-correction", choices=["on", "off"], default="on", help="TRL's vLLM IS correction")
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        help="extra Hydra override for every run (TRL copies what it shares, e.g. gradient checkpointing)",
    )
    ap.add_argument("--check-sync-tolerance", type=float, default=None, help="lorarl parity tolerance for every shape")
    ap.add_argument("--list", action="store_true", help="print the planned runs and stop")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model, fp32, CPU, 4x4x16 tokens: a smoke run")
    args = ap.parse_args(argv)

    if importlib.util.find_spec("lorarl") is None:
        sys.path.insert(0, str(ROOT / "src"))
    from bench.common import cache_dir

    work = SMOKE_WORK if args.cpu_smoke else GPU_WORK
    if args.steps is not None:
        if args.steps <= WARMUP_STEPS:
            raise SystemExit(f"--steps must be > {WARMUP_STEPS} (medians are over steps {WARMUP_STEPS + 1}+)")
        work = Work(work.prompts, work.n, work.tokens, args.steps)
    shapes = (args.shapes or ("tiny" if args.cpu_smoke else "0.5b,7b")).split(",")
    bad = [s for s in shapes if s not in SHAPE_RUNS or (s == "tiny") != args.cpu_smoke]
    if bad:
        raise SystemExit(f"--shapes: {', '.join(bad)} unknown here; use 0.5b,7b (tiny only with --cpu-smoke)")
    kls = []
    for k in args.kl.split(","):
        if k not in ("off", "on"):
            raise SystemExit(f"--kl: {k!r} is not off or on")
        kls.append(k == "on")
    modes = args.modes.split(",")
    systems = args.systems.split(",")
    launches = args.trl_launch.split(",")
    for key, values, allowed in (
        ("--modes", modes, ("adapter", "merged")),
        ("--systems", systems, ("lorarl", "trl")),
        ("--trl-launch", launches, ("torchrun", "python")),
    ):
        if not values or any(v not in allowed for v in values):
            raise SystemExit(f"{key}: use a comma list of {', '.join(allowed)}")
    runs = select(plan(shapes, kls, modes, systems), args.only)
    if args.list:
        print("\n".join(r.name for r in runs))
        return 0

    cache = cache_dir(args.cache)
    date = dt.date.today().isoformat()
    stem = args.stem or (f"gpu_step_cpu-smoke_{date}" if args.cpu_smoke else f"gpu_step_{date}")
    out_dir = Path(args.out_dir)
    js = out_dir / f"{stem}.json"
    logs = Path(args.logs) if args.logs else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.gpu_step " + shlex.join(argv if argv is not None else sys.argv[1:])
    kept = []
    if args.append and js.is_file():
        names = {r.name for r in runs}
        kept = [row for row in json.loads(js.read_text()).get("step_compare", []) if row.get("run") not in names]
    result = {
        "date": date,
        "command": command,
        "cpu_smoke": args.cpu_smoke,
        "work": f"{work.prompts} prompts x {work.n} samples x {work.tokens} new tokens per step, {work.steps} steps",
        "mfu_formula": MFU_FORMULA,
        "peak_flops": PEAK_FLOPS,
        "versions": versions(),
        "step_compare": list(kept),
    }
    print(f"[gpu_step] {len(runs)} runs: {', '.join(r.name for r in runs)}", flush=True)
    models: dict[str, tuple[Path, float]] = {}
    device = "cpu" if args.cpu_smoke else "cuda"
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_step_") as tmp_name:
        tmp = Path(tmp_name)
        for run in runs:
            shape = SHAPE_RUNS[run.shape]
            tolerance = (
                args.check_sync_tolerance if args.check_sync_tolerance is not None else shape.check_sync_tolerance
            )
            row = {"run": run.name, "system": run.system, "shape": run.shape, "kl": run.kl, "mode": run.mode}
            # Every row has the fixed keys, also when the run fails before it measures anything.
            row.update(step_s=None, tokens_per_step=None, steps_s=[], breakdown={}, mfu_update=None, command=None)
            used, waited = (None, 0.0) if args.cpu_smoke else wait_for_free_gpu()
            row.update(gpu_memory_used_mib_before=used, gpu_wait_s=waited)
            log = (logs or tmp) / f"{run.name}.log"
            t0 = time.perf_counter()
            try:
                if run.shape not in models:
                    models[run.shape] = build_model(shape, cache, device, timeout=1800)
                model, build_s = models[run.shape]
                row["model"] = str(model)
                row["model_build_s"] = build_s
                n_params = param_count(model_dims(shape, model))
                row["n_params"] = n_params
                overrides = lorarl_overrides(run, shape, work, model, args.cpu_smoke, tolerance) + args.override
                run_cfg = compose_run(overrides, cache)
                batches, ordered = prompt_batches(run_cfg, work.steps)
                prompt_tokens = [sum(len(item.prompt_ids) for item in batch) * work.n for batch in batches]
                if run.system == "lorarl":
                    res = run_lorarl(run, overrides, cache, tmp, args.run_timeout, log)
                    row["command"] = f"LORARL_CACHE={cache} {res['command']}"
                    row.update(lorarl_row(res, prompt_tokens, work.prompts * work.n, n_params))
                else:
                    from lorarl.data.dataset import write_parquet

                    data = write_parquet(ordered, tmp / f"{run.name}.prompts.parquet")
                    targs = trl_args(
                        run, run_cfg, work, shape, model, data, tmp / f"{run.name}.json", args.cpu_smoke,
                        args.trl_is_correction,
                    )  # fmt: skip
                    res = run_trl(
                        run,
                        targs,
                        launches,
                        cache,
                        tmp / f"{run.name}.json",
                        args.run_timeout,
                        log,
                        args.trl_pythonpath,
                    )
                    row["command"] = f"LORARL_CACHE={cache} {res['command']}"
                    row["launch"] = res["launch"]
                    if res["earlier_attempts"]:
                        row["earlier_attempts"] = res["earlier_attempts"]
                    row.update(trl_row(res["result"], n_params))
                row["prompt_tokens_per_step"] = prompt_tokens
                if "error" in res:
                    row["error"] = res["error"]
                elif not logs:
                    row["log_tail"] = tail(res["log"], lines=15, chars=1500)
            except Exception as exc:  # noqa: BLE001 - one failed run must not lose the others
                row["error"] = f"{type(exc).__name__}: {exc}"[-4000:]
            row["wall_s"] = time.perf_counter() - t0
            result["step_compare"].append(row)
            status = f"FAILED ({row['error'].splitlines()[0][:160]})" if row.get("error") else "ok"
            mfu_text = "-" if row.get("mfu_update") is None else f"{row['mfu_update']:.1%}"
            print(
                f"[gpu_step] {run.name}: step {fmt_s(row.get('step_s'))} s (median of steps {WARMUP_STEPS + 1}+), "
                f"tokens/step {row.get('tokens_per_step')}, mfu_update {mfu_text}, wall {row['wall_s']:.0f} s: {status}",
                flush=True,
            )
            # Written after every run: a later crash or a killed command keeps the finished ones.
            result["wall_s"] = time.perf_counter() - t_start
            result["step_compare"].sort(
                key=lambda r: priority(
                    Run(r["system"], r["shape"], r["kl"], r["mode"]), list(SHAPE_RUNS), ["lorarl", "trl"]
                )
            )
            write_json(js, result)
            (out_dir / f"{stem}.md").write_text(markdown(result))
    print(f"[gpu_step] wrote {js} and {out_dir / f'{stem}.md'} ({time.perf_counter() - t_start:.0f} s)", flush=True)
    ran = {r.name for r in runs}  # rows kept by --append were judged by their own command
    return 1 if any(row.get("error") for row in result["step_compare"] if row["run"] in ran) else 0


if __name__ == "__main__":
    sys.exit(main())
