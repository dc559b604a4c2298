"""How the GPU step bench launches each system, as users launch it, with the same work.

lorarl: `python -m recipes.grpo +backend=<fsdp|megatron> model=<preset> model.path=<shaped model>
data=arith ...` (the work of ../shared/tools/gpu-vllm/step.sh: 32 prompts x 8 samples x 128 tokens;
micro-batching and checkpointing as the model preset sets them; KL loss and rollout correction
as the pair says). TRL: `python -m torch.distributed.run --standalone --nproc_per_node=1 -m
bench.trl_grpo_worker ...` with every setting it shares read from the composed lorarl config, and
the prompts lorarl's own loader yields, in its order.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from bench.common import ROOT
from bench.host_state import run_logged
from bench.step_plan import Run, Shape, Work, lorarl_correction_overrides, override_key, trl_correction_args
from lorarl.stall_report import STACKS_GLOB

KL_COEF = 0.001
SMOKE_MICRO = 4  # the tiny smoke run: 4 micro-batches per step, so it takes the accumulation path
STALL_REPORT_S = 180  # GPU runs: trainer.stall_report_s


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


def lorarl_overrides(run: Run, shape: Shape, work: Work, model: Path, cpu: bool, tolerance: float | None) -> list[str]:
    """The run's Hydra overrides after `+backend=...` (no run folder); also composed here to
    read the settings TRL copies."""
    correction = run.pair.correction
    out = [
        f"model={shape.preset}",
        f"model.path={model}",
        "data=arith",
        f"data.max_response_length={work.tokens}",
        f"data.train_batch_size={work.prompts}",
        f"rollout.n={work.n}",
        f"actor.ppo_mini_batch_size={work.prompts}",
        f"trainer.total_steps={work.steps}",
        f"actor.use_kl_loss={str(run.pair.kl).lower()}",
        f"actor.kl_loss_coef={KL_COEF}",
        *lorarl_correction_overrides(correction),
        f"model.lora.merge={str(run.arm.mode == 'merged').lower()}",
        "trainer.check_sync=true",
        "trainer.logger=[console,jsonl]",
        "trainer.progress_bar=false",
    ]
    if cpu:
        out += ["trainer.device=cpu", f"actor.ppo_micro_batch_size_per_gpu={SMOKE_MICRO}"]
    else:
        out += [
            f"rollout.gpu_memory_utilization={shape.gpu_memory_utilization}",
            "rollout.enforce_eager=false",
            # A hung call's stacks reach the run's log before --run-timeout ends it (set-up took
            # at most ~140 s cold, a step well under a minute).
            f"trainer.stall_report_s={STALL_REPORT_S}",
        ]
    if tolerance is not None:
        out.append(f"trainer.check_sync_tolerance={tolerance}")
    return out


def last_setting_wins(overrides: list[str]) -> list[str]:
    """Hydra overrides with each key once, at its last setting (an --override or a variant over
    the bench's own), so the recorded command says what ran."""
    last = {override_key(o): i for i, o in enumerate(overrides)}
    return [o for i, o in enumerate(overrides) if last[override_key(o)] == i]


def compose_run(backend: str, overrides: list[str], cache: Path):
    """The RunConfig `python -m recipes.grpo +backend=<backend> <overrides>` runs (lorarl's own composer)."""
    os.environ["LORARL_CACHE"] = str(cache)  # ${lorarl_cache:} in conf/data/arith.yaml reads it
    from lorarl.config import compose

    return compose([f"+backend={backend}", *overrides])


def prompt_batches(run_cfg, steps: int) -> tuple[list[list], list[dict]]:
    """The prompt batches the trainer's loader yields for `steps` steps (lorarl.data.batches,
    the trainer's own seam), and the raw rows in that order with one batch more, so TRL's
    sampler, reading them in file order, never runs short."""
    from lorarl.data.batches import prompt_batches as trainer_batches
    from lorarl.data.dataset import load_rows
    from lorarl.preflight import load_tokenizer
    from lorarl.trainer import prepare_data

    prepare_data(run_cfg)  # writes the arith parquet if this cache has none yet
    loader, _, _ = trainer_batches(run_cfg.data, load_tokenizer(run_cfg), run_cfg.trainer.seed, validation=False)
    batches = [loader.next_batch() for _ in range(steps + 1)]
    rows = load_rows(run_cfg.data.train_files)
    return batches[:steps], [rows[item.index] for batch in batches for item in batch]


def run_lorarl(run: Run, overrides: list[str], cache: Path, tmp: Path, timeout: int, log: Path, steps: int) -> dict:
    """(command, exit code, metrics rows with a step time, log text, error if any)."""
    run_dir = tmp / run.name
    cmd = [sys.executable, "-m", "recipes.grpo", f"+backend={run.arm.backend}", *overrides, f"hydra.run.dir={run_dir}"]
    code, text = run_logged(cmd, ROOT, child_env(cache), timeout, log)
    # A worker's unexpected error in full (lorarl.worker_group); where a stalled call waited.
    reports = [run_dir / "worker_traceback.txt", *sorted(run_dir.glob(STACKS_GLOB))]
    reports = [r for r in reports if r.is_file()]
    if reports:
        text += "".join(f"\n{r.name}:\n{r.read_text(errors='replace')}" for r in reports)
        log.write_text(text)
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    rows = [json.loads(line) for line in lines if '"timing/step"' in line]
    # Step 0's row: where the start-up went (init/timing/*).
    init = next((json.loads(line) for line in lines if '"init/timing/' in line), {})
    startup = {k.removeprefix("init/timing/"): v for k, v in init.items() if k.startswith("init/timing/")}
    out = {
        "command": shlex.join(["python", *cmd[1:]]),
        "exit_code": code,
        "rows": rows,
        "log": text,
        "startup": startup,
    }
    if code != 0 or len(rows) < steps:
        why = "timed out" if code is None else f"exit {code}"
        out["error"] = f"{why} after {len(rows)} steps; log tail:\n{tail(text)}"
    return out


def lorarl_extras(rows: list[dict]) -> dict:
    """What lorarl's metrics say beyond the timing: the sync and the rollout/trainer mismatch."""
    return {
        "response_length_mean": [r.get("response_length/mean") for r in rows],
        "sync_kind": rows[-1].get("sync/kind") if rows else None,
        "sync_bytes": rows[-1].get("sync/bytes") if rows else None,
        "sync_logprob_diff_max": max((r.get("sync/logprob_diff_max", 0.0) for r in rows), default=None),
        "memory_max_allocated_gib": max((r.get("memory/max_allocated_gib", 0.0) for r in rows), default=None),
        # What the update itself added (the log-prob passes included): what decides the sleep.
        "memory_update_peak_gib": max((r.get("memory/update_peak_gib", 0.0) for r in rows), default=None),
        # The caching allocator freeing its cache to retry an allocation (a device-wide wait) in the update.
        "update_alloc_retries": [r.get("memory/alloc_retries") for r in rows],
        # vLLM's sampled-token log-probs against the trainer's, bf16 on both sides: k3 KL and the largest ratio.
        "rollout_corr_kl": [r.get("rollout_corr/kl") for r in rows],
        "rollout_corr_rollout_is_max": [r.get("rollout_corr/rollout_is_max") for r in rows],
    }


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


def trl_args(run: Run, run_cfg, work: Work, model: Path, data: Path, out: Path, cpu: bool) -> list[str]:
    """bench.trl_grpo_worker's options: the same work and every shared setting from lorarl's config."""
    r, d, m = run_cfg.rollout, run_cfg.data, run_cfg.model
    rc = run_cfg.algorithm.rollout_correction
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
        "--beta", str(KL_COEF if run.pair.kl else 0.0),
        "--micro-batch", str(trl_micro_batch(run_cfg, work)),
        "--gradient-checkpointing", "on" if m.enable_gradient_checkpointing else "off",
        "--max-model-len", str(r.max_model_len or d.max_prompt_length + d.max_response_length),
        "--temperature", str(r.temperature),
        *trl_correction_args(run.pair.correction, rc),
    ]  # fmt: skip
    if cpu:
        args += ["--threads", "1"]  # see bench.peer_trl: one process sharing two cores with vLLM
    else:
        args += ["--vllm-gpu-memory-utilization", str(r.gpu_memory_utilization)]
    return args


def trl_command(launch: str, args: list[str]) -> list[str]:
    if launch == "torchrun":
        # Sets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, which vLLM's external_launcher
        # (TRL's colocate mode) reads.
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m"]
    else:
        head = [sys.executable, "-m"]
    return [*head, "bench.trl_grpo_worker", *args]


def run_trl(args: list[str], launches: list[str], env: dict, out: Path, timeout: int, log: Path, steps: int) -> dict:
    """TRL under the first launcher that gets through a step; the next one only runs when the
    previous stopped before its first step (a launch problem, not a measurement)."""
    attempts, text = [], ""
    for launch in launches:
        out.unlink(missing_ok=True)
        cmd = trl_command(launch, args)
        code, text = run_logged(cmd, ROOT, env, timeout, log)
        result = json.loads(out.read_text()) if out.is_file() else {}
        attempt = {"command": shlex.join(["python", *cmd[1:]]), "exit_code": code, "launch": launch}
        done = len(result.get("steps", []))
        if code != 0 or done < steps:
            attempt["error"] = (
                f"{'timed out' if code is None else f'exit {code}'} after {done} steps; log tail:\n{tail(text)}"
            )
        attempts.append(attempt)
        if "error" not in attempt or done:
            return {**attempt, "result": result, "log": text, "earlier_attempts": attempts[:-1]}
    return {**attempts[-1], "result": {}, "log": text, "earlier_attempts": attempts[:-1]}
