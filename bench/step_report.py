"""The GPU step bench's numbers and markdown: each system's steps in one vocabulary, one row
builder for both, the equal-algorithm pairs with their spread, and the report.

A step, whichever system ran it: `step_s` and the phases `gen_s` (sampling), `logp_s` (no-grad
log-prob passes: reference for KL, old log-probs for a correction that needs them), `update_s`
(forward + backward + optimizer), `sync_s` (weights into the engine), `sleep_wake_s` (lorarl's
engine sleep), `other_s` (the rest: rewards, advantages, host work), and `tokens` (real prompt
+ response tokens). The update's MFU: MFU_FORMULA. A lorarl step one step off-policy generates
the next batch beside its update: its `gen_s` is that generation's length and only
`gen_wait_s`, the part the update did not hide, is on the step's path (OVERLAP_FORMULA).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from lorarl import metrics as keys

PEAK_FLOPS = 989e12  # dense bf16, H100/H200 SXM
WARMUP_STEPS = 2  # medians are over steps 3+
# The parts of a sync, and the trainer's start-up stages, by the names the report gives them.
SYNC_PARTS = dict(gather=keys.SYNC_GATHER_SECONDS, transfer=keys.SYNC_TRANSFER_SECONDS, load=keys.SYNC_LOAD_SECONDS)
SYNC_PARTS |= dict(adapter_check=keys.SYNC_ADAPTER_CHECK_SECONDS, meaning_check=keys.SYNC_MEANING_CHECK_SECONDS)
SYNC_PARTS |= dict(weights_check=keys.SYNC_WEIGHTS_CHECK_SECONDS, probe=keys.SYNC_PROBE_SECONDS)
STARTUP = dict(prepare=keys.INIT_TIMING_PREPARE, ray_init=keys.INIT_TIMING_RAY_INIT)
STARTUP |= dict(workers_start=keys.INIT_TIMING_WORKERS_START, rollout_start=keys.INIT_TIMING_ROLLOUT_START)
STARTUP |= dict(engine_build=keys.INIT_TIMING_ENGINE_BUILD, worker_setup=keys.INIT_TIMING_WORKER_SETUP)
PHASES = ("gen_s", "logp_s", "update_s", "sync_s", "sleep_wake_s", "other_s")
# The targets at equal algorithm: step seconds at most, TRL's step over ours and the MFU at least.
TARGETS = {
    "7b": {"step_s": 3.5, "speedup": 2.0, "mfu_update": 0.55},
    "0.5b": {"step_s": 1.4, "speedup": 1.6},
    "30b-a3b": {"speedup": 1 / 0.6},
}
# One step off-policy on one GPU: the step at most this times the longer of generation and update.
OVERLAP_TARGET = 1.15
OVERLAP_FORMULA = (
    "overlap = an off-policy arm's step_s / max(gen_s, update_s) of the same pair's on-policy arm (medians; "
    "each phase measured there alone, not slowed by the other): 1.0 = the step as long as the longer of the two, "
    "everything else hidden; target <= 1.15."
)
MFU_FORMULA = (
    "mfu_update = 4*N*tokens_per_step / (update_s * 989e12): frozen-base LoRA update = forward 2N + "
    "activation-gradient backward 2N per token, no base weight gradients, LoRA matmuls and attention scores "
    "not counted; mfu_update_hw = 6*N*tokens_per_step / (...) also counts the forward recomputed by gradient "
    "checkpointing, for runs that checkpoint (else '-'). N = all parameters from the shape (embedding "
    "included, lm_head again when untied); for a mixture of experts the parameters one token runs through "
    "(attention, router, top-k experts). "
    "update_s: lorarl timing/update (forward+backward+optimizer, no log-prob passes); TRL step minus "
    "_generate_and_score_completions."
)


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _with_other(step: dict) -> dict:
    on_path = {k: step[k] for k in PHASES if k != "other_s"}
    if "gen_wait_s" in step:  # generated beside the update: only the wait is on the step's path
        on_path["gen_s"] = step["gen_wait_s"]
    step["other_s"] = max(0.0, step["step_s"] - sum(on_path.values()))
    return step


def lorarl_steps(metrics: list[dict], prompt_tokens: list[int], completions: int) -> list[dict]:
    """Steps from lorarl's metrics.jsonl rows; tokens = the step's prompt tokens (lorarl's
    loader, x n) + its mean response length x completions."""
    out = []
    for r in metrics:
        step, tokens = r.get(keys.STEP.key, 0), None
        if keys.RESPONSE_LENGTH_MEAN.key in r and 0 < step <= len(prompt_tokens):
            tokens = prompt_tokens[step - 1] + round(r[keys.RESPONSE_LENGTH_MEAN.key] * completions)
        phases = {
            "step_s": r[keys.TIMING_STEP.key],
            "gen_s": r.get(keys.TIMING_GEN.key, 0.0),
            "logp_s": r.get(keys.TIMING_REF_LOGP.key, 0.0) + r.get(keys.TIMING_OLD_LOGP.key, 0.0),
            "update_s": r.get(keys.TIMING_UPDATE.key, 0.0),
            # The driver's sync call includes waking a sleeping rollout, counted below.
            "sync_s": r.get(keys.TIMING_SYNC.key, 0.0) - r.get(keys.TIMING_WAKE.key, 0.0),
            "sleep_wake_s": r.get(keys.TIMING_SLEEP.key, 0.0) + r.get(keys.TIMING_WAKE.key, 0.0),
        }
        if keys.TIMING_GEN_WAIT.key in r:
            phases["gen_wait_s"] = r[keys.TIMING_GEN_WAIT.key]
        out.append(_with_other({**phases, "tokens": tokens}))
    return out


def trl_steps(result: dict) -> list[dict]:
    """Steps from bench.trl_grpo_worker's output (its phases, named as lorarl's)."""
    out = []
    for s in result.get("steps", []):
        tokens = round(s["prompt_tokens"] + s["completion_tokens"]) if "prompt_tokens" in s else None
        phases = {"step_s": s["step_s"], "gen_s": s.get("generation_s", 0.0), "logp_s": s.get("logp_s", 0.0)}
        phases.update(update_s=s.get("update_s", 0.0), sync_s=s.get("sync_s", 0.0), sleep_wake_s=0.0)
        out.append(_with_other({**phases, "tokens": tokens}))
    return out


def lorarl_metrics(path: Path) -> tuple[list[dict], dict]:
    """A lorarl run's metrics.jsonl: the rows with a step time, and where its start-up went (the
    first row that logs it, step 0's, by STARTUP's names)."""
    rows = [json.loads(line) for line in (path.read_text().splitlines() if path.is_file() else []) if line.strip()]
    init = next((r for r in rows if any(m.key in r for m in STARTUP.values())), {})
    return [r for r in rows if keys.TIMING_STEP.key in r], {n: init[m.key] for n, m in STARTUP.items() if m.key in init}


def lorarl_extras(rows: list[dict]) -> dict:
    """What lorarl's metrics say beyond the timing: the sync, the memory, the rollout/trainer mismatch."""
    last, settled = (rows[-1] if rows else {}), rows[WARMUP_STEPS:]
    return {
        "response_length_mean": [r.get(keys.RESPONSE_LENGTH_MEAN.key) for r in rows],
        "staleness": [r.get(keys.ROLLOUT_STALENESS.key) for r in rows],
        "sync_kind": last.get(keys.SYNC_KIND.key),
        "sync_bytes": last.get(keys.SYNC_BYTES.key),
        "sync_logprob_diff_max": max((r.get(keys.SYNC_LOGPROB_DIFF_MAX.key, 0.0) for r in rows), default=None),
        "memory_max_allocated_gib": max((r.get(keys.MEMORY_MAX_ALLOCATED_GIB.key, 0.0) for r in rows), default=None),
        # What the update itself added (the log-prob passes included): what decides the sleep.
        "memory_update_peak_gib": max((r.get(keys.MEMORY_UPDATE_PEAK_GIB.key, 0.0) for r in rows), default=None),
        # The caching allocator freeing its cache to retry an allocation (a device-wide wait) in the update.
        "update_alloc_retries": [r.get(keys.MEMORY_ALLOC_RETRIES.key) for r in rows],
        # vLLM's sampled-token log-probs against the trainer's, bf16 on both sides: k3 KL and the largest ratio.
        "rollout_corr_kl": [r.get(keys.ROLLOUT_CORR_KL.key) for r in rows],
        "rollout_corr_rollout_is_max": [r.get(keys.ROLLOUT_CORR_ROLLOUT_IS_MAX.key) for r in rows],
        # Where the sync went: each part's seconds, median over steps 3+ (None: not logged).
        "sync_parts_s": {p: median([r[m.key] for r in settled if m.key in r]) for p, m in SYNC_PARTS.items()},
    }


def param_count(dims: dict) -> int:
    """All parameters of a Qwen2 with these config.json dims (q/k/v biases, two norms per layer,
    final norm, the LM head once more unless tied): lorarl.rollout.memory's count of the same weights.
    A mixture of experts counts what one token runs through: attention, the router and top-k
    experts' MLPs (the MFU by 4 x active parameters)."""
    from types import SimpleNamespace

    from lorarl.rollout.memory import ModelDims, weight_numel

    experts = dims.get("num_experts") or dims.get("num_local_experts")  # Qwen's name, transformers 5's
    if experts:
        active = dims["num_experts_per_tok"] * dims["moe_intermediate_size"]
        dense = {k: v for k, v in dims.items() if k not in ("num_experts", "num_local_experts")}
        return (
            param_count({**dense, "intermediate_size": active})
            + dims["num_hidden_layers"] * dims["hidden_size"] * experts
        )
    return weight_numel(ModelDims.of(SimpleNamespace(**dims)), tied_head=bool(dims.get("tie_word_embeddings")))


def mfu(n_params: int, tokens: float | None, update_s: float | None, recomputes: bool) -> dict:
    """The update's MFU by 4N, and by 6N when activation checkpointing recomputes the forward
    (without it the GPU does 4N: a 6N figure would count work that never ran)."""
    if not tokens or not update_s:
        return {"mfu_update": None, "mfu_update_hw": None}
    return {
        "mfu_update": 4 * n_params * tokens / (update_s * PEAK_FLOPS),
        "mfu_update_hw": 6 * n_params * tokens / (update_s * PEAK_FLOPS) if recomputes else None,
    }


def step_row(steps: list[dict], n_params: int, recomputes: bool) -> dict:
    """One run's numbers: every step's seconds, and medians over steps 3+ of the step, each
    phase and the tokens, with the update's MFU (`recomputes`: the run checkpoints activations)."""
    measured = steps[WARMUP_STEPS:]
    breakdown = {key: median([s[key] for s in measured]) for key in PHASES} if measured else {}
    tokens = median([s["tokens"] for s in measured])
    overlapped = [s for s in measured if "gen_wait_s" in s]
    if overlapped:
        breakdown["gen_wait_s"] = median([s["gen_wait_s"] for s in overlapped])
    return {
        "overlapped": bool(overlapped),
        "steps_s": [s["step_s"] for s in steps],
        "step_s": median([s["step_s"] for s in measured]),
        "tokens_per_step": tokens,
        "tokens_per_step_each": [s["tokens"] for s in steps],
        "breakdown": breakdown,
        "update_s_each": [s["update_s"] for s in steps],
        **mfu(n_params, tokens, breakdown.get("update_s"), recomputes),
    }


def _spread(xs: list[float]) -> dict | None:
    return {"median": median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def pairs(rows: list[dict]) -> list[dict]:
    """Equal-algorithm comparisons: rows of the same shape, KL and correction, each lorarl arm
    against TRL, with the spread of the step and the update over the repeats and the ratio of
    TRL's step to lorarl's (median of each, and per repeat where both ran)."""
    good = [r for r in rows if not r.get("error") and r.get("step_s")]
    out = []
    for key in sorted({(r["shape"], r["kl"], r["correction"]) for r in good}, key=str):
        same = [r for r in good if (r["shape"], r["kl"], r["correction"]) == key]
        trl = {r["repeat"]: r for r in same if r["system"] == "trl"}
        for arm in sorted({r["arm"] for r in same if r["system"] == "lorarl"}):
            ours = {r["repeat"]: r for r in same if r["arm"] == arm}
            mine, theirs = [ours[k] for k in sorted(ours)], [trl[k] for k in sorted(trl)]
            entry = dict(
                zip(("shape", "kl", "correction"), key), arm=arm, repeats=sorted(ours), trl_repeats=sorted(trl)
            )
            entry.update(
                lorarl_step_s=_spread([r["step_s"] for r in mine]),
                lorarl_step_s_each=[r["step_s"] for r in mine],
                trl_step_s=_spread([r["step_s"] for r in theirs]),
                lorarl_update_s=_spread([r["breakdown"]["update_s"] for r in mine]),
                trl_update_s=_spread([r["breakdown"]["update_s"] for r in theirs]),
                lorarl_gen_s=_spread([r["breakdown"]["gen_s"] for r in mine]),
                lorarl_mfu_update=_spread([r["mfu_update"] for r in mine if r["mfu_update"]]),
                overlapped=any(r.get("overlapped") for r in mine),
                speedup_each=[trl[k]["step_s"] / ours[k]["step_s"] for k in sorted(set(ours) & set(trl))],
            )
            if entry["trl_step_s"]:
                entry["speedup"] = entry["trl_step_s"]["median"] / entry["lorarl_step_s"]["median"]
            out.append(entry)
    for entry in out:
        same = [e for e in out if all(e[k] == entry[k] for k in ("shape", "kl", "correction"))]
        serial = [e for e in same if not e["overlapped"]] if entry["overlapped"] else []
        if serial:  # the longer phase of the on-policy arm, each measured alone
            alone = max(serial[0]["lorarl_gen_s"]["median"], serial[0]["lorarl_update_s"]["median"])
            entry["lorarl_overlap"] = _spread([r / alone for r in entry["lorarl_step_s_each"]])
        entry["targets"] = target_check(entry["shape"], entry)
    return out


def target_check(shape: str, entry: dict) -> dict:
    """Each target of the shape: (wanted, measured median, met)."""
    got = {
        "step_s": entry["lorarl_step_s"]["median"],
        "speedup": entry.get("speedup"),
        "mfu_update": (entry["lorarl_mfu_update"] or {}).get("median"),
    }
    out = {}
    for key, want in TARGETS.get(shape, {}).items():
        met = None if got[key] is None else (got[key] <= want if key == "step_s" else got[key] >= want)
        out[key] = {"want": want, "got": got[key], "met": met}
    if entry.get("lorarl_overlap"):
        got = entry["lorarl_overlap"]["median"]
        out["overlap"] = {"want": OVERLAP_TARGET, "got": got, "met": got <= OVERLAP_TARGET}
    return out


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fmt_spread(s: dict | None, digits: int = 2) -> str:
    if not s:
        return "-"
    if s["n"] == 1:
        return fmt(s["median"], digits)
    return f"{fmt(s['median'], digits)} ({fmt(s['min'], digits)}-{fmt(s['max'], digits)})"


def _table(header: list[str]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]


def _targets(entry: dict) -> str:
    marks = []
    for key, t in entry["targets"].items():
        show = "{:.1%}" if key == "mfu_update" else "{:.2f}"
        got, verdict = "-" if t["got"] is None else show.format(t["got"]), {None: "-", True: "met", False: "not met"}
        marks.append(f"{key} {got} vs {show.format(t['want'])}: {verdict[t['met']]}")
    return "; ".join(marks) or "-"


def pair_lines(entries: list[dict]) -> list[str]:
    lines = _table(
        ["shape", "KL", "correction", "lorarl arm", "lorarl step s", "TRL step s", "TRL / lorarl (each repeat)"]
        + ["lorarl update s", "TRL update s", "lorarl gen s", "overlap", "MFU update", "targets"]
    )
    for e in entries:
        each = " ".join(f"{x:.2f}" for x in e["speedup_each"])
        mfu_cell = "-" if not e["lorarl_mfu_update"] else f"{e['lorarl_mfu_update']['median']:.1%}"
        lines.append(
            f"| {e['shape']} | {'on' if e['kl'] else 'off'} | {e['correction']} | {e['arm']} | "
            f"{fmt_spread(e['lorarl_step_s'])} | {fmt_spread(e['trl_step_s'])} | "
            f"{fmt(e.get('speedup'))}x ({each or '-'}) | {fmt_spread(e['lorarl_update_s'])} | "
            f"{fmt_spread(e['trl_update_s'])} | {fmt_spread(e['lorarl_gen_s'])} | {fmt_spread(e.get('lorarl_overlap'))} | "
            f"{mfu_cell} | {_targets(e)} |"
        )
    return lines


def new_cache_files(row: dict) -> str:
    """'triton +12, vllm +3': files each kernel cache gained during the run (kernels compiled)."""
    before = (row.get("before") or {}).get("kernel_cache_files") or {}
    after = (row.get("after") or {}).get("kernel_cache_files") or {}
    grown = {k: after[k] - before[k] for k in after if k in before and after[k] > before[k]}
    return ", ".join(f"{k} +{n}" for k, n in grown.items())


def _machine(row: dict) -> str:
    before, during = row.get("before") or {}, row.get("during") or {}

    def stat(key: str, part: str, digits: int = 0) -> str:
        return fmt((during.get(key) or {}).get(part), digits)

    return (
        f"{stat('clocks.sm', 'median')} ({stat('clocks.sm', 'min')}) | {stat('temperature.gpu', 'max')} | "
        f"{stat('power.draw', 'median')} | {fmt((before.get('gpu') or {}).get('memory.used'), 0)} | "
        f"{fmt(before.get('loadavg_1m'))} | {fmt(before.get('python_loop_us'), 3)} | {stat('cpu_busy', 'median', 2)} |"
    )


def _in_order(rows: list[dict]) -> list[dict]:
    """The rows in the order they ran; rows without an order last."""
    return sorted(rows, key=lambda r: (r.get("order") is None, r.get("order") or 0))


def _notes(row: dict) -> str:
    """A failure, allocator retries, the update's own peak (and whether the rollout slept for it),
    the sync's parts (medians over steps 3+) and the kernels a run compiled."""
    notes = [row["error"].splitlines()[0][:80]] if row.get("error") else []
    retries = sum(r or 0 for r in row.get("update_alloc_retries") or [])
    if retries:
        notes.append(f"allocator retries in the update: {retries:.0f}")
    if row.get("memory_update_peak_gib"):
        slept = " (rollout asleep)" if ((row.get("breakdown") or {}).get("sleep_wake_s") or 0) > 0 else ""
        notes.append(f"update peak {row['memory_update_peak_gib']:.1f} GiB{slept}")
    if row.get("overlapped"):
        behind = max((v for v in row.get("staleness") or [] if v is not None), default=None)
        wait = (row.get("breakdown") or {}).get("gen_wait_s")
        notes.append(f"generated beside the update (waited {fmt(wait)} s for it, staleness up to {behind})")
    if parts := [f"{k} {v:.3f}" for k, v in (row.get("sync_parts_s") or {}).items() if v is not None]:
        notes.append(f"sync {', '.join(parts)} s;")
    if new_cache_files(row):
        notes.append(f"kernel cache files added: {new_cache_files(row)}")
    return " ".join(notes)


def run_lines(rows: list[dict]) -> list[str]:
    lines = _table(
        ["#", "run", "correction", "step s", "steps s", "gen", "logp", "update", "sync", "sleep+wake", "other"]
        + ["tokens/step", "MFU update (4N / 6N)", "SM MHz median (min)", "temp max C", "power median W"]
        + ["GPU MiB before", "load 1m before", "host loop us before", "CPU busy median", "notes"]
    )
    for row in _in_order(rows):
        b = row.get("breakdown") or {}
        m4, m6 = row.get("mfu_update"), row.get("mfu_update_hw")
        mfu_cell = "-" if m4 is None else f"{m4:.1%} / " + ("-" if m6 is None else f"{m6:.1%}")
        steps = " ".join(f"{s:.1f}" for s in row.get("steps_s") or [])
        phases = " | ".join(fmt(b.get(k)) for k in PHASES)
        lines.append(
            f"| {fmt(row.get('order'), 0)} | {row['run']} | {row['correction']} | {fmt(row.get('step_s'))} | {steps} | "
            f"{phases} | {row.get('tokens_per_step') or '-'} | {mfu_cell} | {_machine(row)} {_notes(row)} |"
        )
    return lines


def startup_lines(rows: list[dict]) -> list[str]:
    """Each run's wall time and, for lorarl, where its start-up went (the trainer's init/timing/*)."""
    lines = _table(
        ["run", "wall s", "model build s", "checks s", "Ray s", "workers placed s", "vLLM start s"]
        + ["training engine s", "steps s", "rest s", "TRL init s"]
    )
    for row in _in_order(rows):
        up = row.get("startup_s") or {}
        steps = sum(row.get("steps_s") or []) or None
        cells = [row.get("wall_s"), row.get("model_build_s")]
        cells += [up.get(k) for k in ("prepare", "ray_init", "workers_start", "rollout_start", "engine_build")]
        # The rest: interpreter and imports, the first sync, the final adapter, plots, shutdown.
        stages = (up.get(k) for k in ("prepare", "ray_init", "workers_start", "worker_setup"))
        known = [row.get("model_build_s"), steps, *stages]
        rest = row["wall_s"] - sum(k for k in known if k) if up and "wall_s" in row else None
        cells += [steps, rest, row.get("init_s")]
        lines.append(f"| {row['run']} | " + " | ".join(fmt(c, 1) for c in cells) + " |")
    return lines


def markdown(result: dict) -> str:
    lines = [
        f"# GPU step: lorarl vs TRL GRPOTrainer at equal algorithm ({result['date']})",
        "",
        *[f"`{command}`  " for command in result["commands"]],
        "",
        f"{result['work']}. Step: median over steps {WARMUP_STEPS + 1}+ of each run; a pair's numbers are the "
        "median (min-max) over its alternating repeats. TRL / lorarl > 1: lorarl is faster. "
        f"{result['mfu_formula']} {OVERLAP_FORMULA}",
        "",
        "## Equal-algorithm pairs",
        "",
        *pair_lines(result["pairs"]),
        "",
        "## Runs, in the order they ran",
        "",
        "SM clock, temperature, power and CPU busy share are sampled every second during the run; GPU memory "
        "and load average are read just before it.",
        "",
        *run_lines(result["step_compare"]),
        "",
        "## Start-up",
        "",
        *startup_lines(result["step_compare"]),
    ]
    if result.get("skipped"):
        lines += ["", f"Not started (the --budget-s would have run out): {', '.join(result['skipped'])}"]
    lines += ["", "Commands:", ""] + [f"- `{r['run']}`: `{r.get('command') or '-'}`" for r in result["step_compare"]]
    return "\n".join(lines) + "\n"


def report_line(row: dict) -> str:
    """One line per finished run on the console."""
    status = f"FAILED ({row['error'].splitlines()[0][:160]})" if row.get("error") else "ok"
    mfu_cell = "-" if row.get("mfu_update") is None else f"{row['mfu_update']:.1%}"
    sm = ((row.get("during") or {}).get("clocks.sm") or {}).get("median")
    return (
        f"[gpu_step] {row['run']}: step {fmt(row.get('step_s'))} s (median of steps {WARMUP_STEPS + 1}+), "
        f"update {fmt((row.get('breakdown') or {}).get('update_s'))} s, tokens/step {row.get('tokens_per_step')}, "
        f"mfu_update {mfu_cell}, SM {fmt(sm, 0)} MHz, wall {row['wall_s']:.0f} s: {status}"
    )
