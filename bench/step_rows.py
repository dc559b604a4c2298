"""The GPU step bench's rows: each system's steps in one vocabulary, one row builder for both,
the equal-algorithm pairs with their spread, and the markdown.

A step, whichever system ran it: `step_s` and the phases `gen_s` (sampling), `logp_s` (no-grad
log-prob passes: reference for KL, old log-probs for a correction that needs them), `update_s`
(forward + backward + optimizer), `sync_s` (weights into the engine), `sleep_wake_s` (lorarl's
engine sleep), `other_s` (the rest: rewards, advantages, host work), and `tokens` (real prompt
+ response tokens).

    mfu_update    = 4 N tokens / (update_s x 989e12)   frozen-base LoRA: forward 2N + activation backward 2N
    mfu_update_hw = 6 N tokens / (update_s x 989e12)   plus the forward recomputed by checkpointing
                                                       (runs that checkpoint only)
"""

from __future__ import annotations

import statistics

PEAK_FLOPS = 989e12  # dense bf16, H100/H200 SXM
WARMUP_STEPS = 2  # medians are over steps 3+
PHASES = ("gen_s", "logp_s", "update_s", "sync_s", "sleep_wake_s", "other_s")
# The request's targets at equal algorithm: step seconds at most, TRL's step over ours at least.
TARGETS = {"7b": {"step_s": 3.5, "speedup": 1.8, "mfu_update": 0.55}, "0.5b": {"step_s": 1.4, "speedup": 1.6}}
MFU_FORMULA = (
    "mfu_update = 4*N*tokens_per_step / (update_s * 989e12): frozen-base LoRA update = forward 2N + "
    "activation-gradient backward 2N per token, no base weight gradients, LoRA matmuls and attention scores "
    "not counted; mfu_update_hw = 6*N*tokens_per_step / (...) also counts the forward recomputed by gradient "
    "checkpointing, for runs that checkpoint (else '-'). N = all parameters from the shape (embedding "
    "included, lm_head again when untied). "
    "update_s: lorarl timing/update (forward+backward+optimizer, no log-prob passes); TRL step minus "
    "_generate_and_score_completions."
)


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _with_other(step: dict) -> dict:
    step["other_s"] = max(0.0, step["step_s"] - sum(step[k] for k in PHASES if k != "other_s"))
    return step


def lorarl_steps(metrics: list[dict], prompt_tokens: list[int], completions: int) -> list[dict]:
    """Steps from lorarl's metrics.jsonl rows; tokens = the step's prompt tokens (lorarl's
    loader, x n) + its mean response length x completions."""
    out = []
    for r in metrics:
        step = r.get("step", 0)
        tokens = None
        if "response_length/mean" in r and 0 < step <= len(prompt_tokens):
            tokens = prompt_tokens[step - 1] + round(r["response_length/mean"] * completions)
        out.append(
            _with_other(
                {
                    "step_s": r["timing/step"],
                    "gen_s": r.get("timing/gen", 0.0),
                    "logp_s": r.get("timing/ref_logp", 0.0) + r.get("timing/old_logp", 0.0),
                    "update_s": r.get("timing/update", 0.0),
                    # The driver's sync call includes waking a sleeping rollout, counted below.
                    "sync_s": r.get("timing/sync", 0.0) - r.get("timing/wake", 0.0),
                    "sleep_wake_s": r.get("timing/sleep", 0.0) + r.get("timing/wake", 0.0),
                    "tokens": tokens,
                }
            )
        )
    return out


def trl_steps(result: dict) -> list[dict]:
    """Steps from bench.trl_grpo_worker's output (its phases, named as lorarl's)."""
    out = []
    for s in result.get("steps", []):
        tokens = s["prompt_tokens"] + s["completion_tokens"] if "prompt_tokens" in s else None
        out.append(
            _with_other(
                {
                    "step_s": s["step_s"],
                    "gen_s": s.get("generation_s", 0.0),
                    "logp_s": s.get("logp_s", 0.0),
                    "update_s": s.get("update_s", 0.0),
                    "sync_s": s.get("sync_s", 0.0),
                    "sleep_wake_s": 0.0,
                    "tokens": None if tokens is None else round(tokens),
                }
            )
        )
    return out


def param_count(dims: dict) -> int:
    """All parameters of a Qwen2 with these config.json dims (q/k/v biases, two norms per layer,
    final norm, the LM head once more unless tied): lorarl.memory's count of the same weights."""
    from types import SimpleNamespace

    from lorarl.memory import ModelDims, weight_numel

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
    return {
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
    keys = sorted({(r["shape"], r["kl"], r["correction"]) for r in good}, key=str)
    for shape, kl, correction in keys:
        same = [r for r in good if (r["shape"], r["kl"], r["correction"]) == (shape, kl, correction)]
        trl = {r["repeat"]: r for r in same if r["system"] == "trl"}
        for arm in sorted({r["arm"] for r in same if r["system"] == "lorarl"}):
            ours = {r["repeat"]: r for r in same if r["arm"] == arm}
            both = sorted(set(ours) & set(trl))
            entry = {
                "shape": shape,
                "kl": kl,
                "correction": correction,
                "arm": arm,
                "repeats": sorted(ours),
                "trl_repeats": sorted(trl),
                "lorarl_step_s": _spread([ours[k]["step_s"] for k in sorted(ours)]),
                "trl_step_s": _spread([trl[k]["step_s"] for k in sorted(trl)]),
                "lorarl_update_s": _spread([ours[k]["breakdown"]["update_s"] for k in sorted(ours)]),
                "trl_update_s": _spread([trl[k]["breakdown"]["update_s"] for k in sorted(trl)]),
                "lorarl_gen_s": _spread([ours[k]["breakdown"]["gen_s"] for k in sorted(ours)]),
                "lorarl_mfu_update": _spread([ours[k]["mfu_update"] for k in sorted(ours) if ours[k]["mfu_update"]]),
                "speedup_each": [trl[k]["step_s"] / ours[k]["step_s"] for k in both],
            }
            if entry["trl_step_s"]:
                entry["speedup"] = entry["trl_step_s"]["median"] / entry["lorarl_step_s"]["median"]
            entry["variance"] = {"lorarl": variance(list(ours.values())), "trl": variance(list(trl.values()))}
            entry["targets"] = target_check(shape, entry)
            out.append(entry)
    return out


def facts(row: dict) -> dict:
    """What one run's time and machine were: its phases, the GPU while it ran, the host before it."""
    during, before = row.get("during") or {}, row.get("before") or {}
    gpu = before.get("gpu") or {}

    def mid(key: str, part: str = "median") -> float | None:
        return (during.get(key) or {}).get(part)

    return {
        "repeat": row["repeat"],
        "order": row.get("order"),
        "step_s": row["step_s"],
        "update_s": row["breakdown"].get("update_s"),
        "gen_s": row["breakdown"].get("gen_s"),
        "sm_clock_mhz": mid("clocks.sm"),
        "sm_clock_min_mhz": mid("clocks.sm", "min"),
        "temperature_max_c": mid("temperature.gpu", "max"),
        "power_w": mid("power.draw"),
        "cpu_busy": mid("cpu_busy"),
        "loadavg_before": before.get("loadavg_1m"),
        "python_loop_us_before": before.get("python_loop_us"),
        "gpu_mib_before": gpu.get("memory.used"),
        "clock_reasons_before": gpu.get("clock_reasons"),
        # Seconds the driver held the clocks down during the run (power cap, thermal, ...), summed.
        "clocks_slowed_s": sum((row.get("clocks_slowed_s") or {}).values()) if row.get("clocks_slowed_s") else None,
    }


def variance(rows: list[dict]) -> dict | None:
    """The spread of one side's repeats, and the fastest and the slowest run side by side with
    what the machine did meanwhile: where a slow repeat's time went (update or generation) and
    whether the GPU clocked lower, ran hotter, or the host was busier."""
    if not rows:
        return None
    steps = [r["step_s"] for r in rows]
    fast, slow = min(rows, key=lambda r: r["step_s"]), max(rows, key=lambda r: r["step_s"])
    return {"spread_pct": (max(steps) - min(steps)) / median(steps), "fastest": facts(fast), "slowest": facts(slow)}


def target_check(shape: str, entry: dict) -> dict:
    """Each target of the shape: (wanted, measured median, met)."""
    want = TARGETS.get(shape, {})
    got = {
        "step_s": entry["lorarl_step_s"]["median"],
        "speedup": entry.get("speedup"),
        "mfu_update": (entry["lorarl_mfu_update"] or {}).get("median"),
    }
    met = {"step_s": lambda g, w: g <= w, "speedup": lambda g, w: g >= w, "mfu_update": lambda g, w: g >= w}
    return {
        key: {"want": w, "got": got[key], "met": None if got[key] is None else met[key](got[key], w)}
        for key, w in want.items()
    }


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fmt_spread(s: dict | None, digits: int = 2) -> str:
    if not s:
        return "-"
    if s["n"] == 1:
        return fmt(s["median"], digits)
    return f"{fmt(s['median'], digits)} ({fmt(s['min'], digits)}-{fmt(s['max'], digits)})"
