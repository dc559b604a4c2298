"""The JSON summary of a random-weight shape run (tests/gpu/moe_step.sh, tests/gpu/dense_step.sh).

    python -m tests.gpu.shape_summary RUN_DIR OUT.json [--log RUN.log] [--rc N] [--model-info FILE]

Per step: reward mean/std, grad_norm, every sync check the step logged (`sync/*_match`, and the
semantic check `sync/*_meaning`), the probe's three numbers, the step's timings (the checks' own
seconds among them) and peak device memory. At the end, whether
  (a) the reward rose: the last 3 steps' mean reward over the first 3's by more than
      RISE_IN_STANDARD_ERRORS standard errors of that difference (each step's mean has standard
      error reward/std / sqrt(samples per step));
  (b) every sync check passed: the run exited 0 and every step logged the semantic check and
      every other check it ran, all 1;
  (c) the adapter's effect on the probe (`logprob_ref_diff_mean`, trainer with vs without the
      adapter) is at least PROBE_EFFECT_OVER_NOISE times the probe's own noise
      (`logprob_diff_mean`, trainer vs vLLM) at the last step.
A run stopped by a check (exit 2) keeps its steps, its exit code and the log's `error:` line.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

RISE_IN_STANDARD_ERRORS = 3.0
PROBE_EFFECT_OVER_NOISE = 10.0
CHECK_SUFFIXES = ("_match", "_meaning")
PROBE_KEYS = ("sync/logprob_diff_max", "sync/logprob_diff_mean", "sync/logprob_ref_diff_mean")


def step_rows(metrics_jsonl: Path) -> list[dict]:
    """The training steps' rows of a run's metrics.jsonl (step 0 holds start-up values, no reward)."""
    if not metrics_jsonl.is_file():
        return []
    rows = [json.loads(line) for line in metrics_jsonl.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]


def step_summary(row: dict) -> dict:
    return {
        "step": row["step"],
        "reward_mean": row["reward/mean"],
        "reward_std": row["reward/std"],
        "grad_norm": row.get("actor/grad_norm"),
        "sync_kind": row.get("sync/kind"),
        "checks": {k: v for k, v in row.items() if k.startswith("sync/") and k.endswith(CHECK_SUFFIXES)},
        "probe": {k.removeprefix("sync/"): row.get(k) for k in PROBE_KEYS},
        "timing": {
            **{k.removeprefix("timing/"): v for k, v in row.items() if k.startswith("timing/")},
            **{k: v for k, v in row.items() if k.startswith("sync/") and k.endswith("_seconds")},
        },
        "memory": {k.removeprefix("memory/"): v for k, v in row.items() if k.startswith("memory/")},
    }


def reward_rose(steps: list[dict], samples_per_step: int) -> dict:
    if len(steps) < 6:
        return {"passed": False, "why": f"{len(steps)} steps; the comparison needs 6"}
    first, last = steps[:3], steps[-3:]
    rise = sum(s["reward_mean"] for s in last) / 3 - sum(s["reward_mean"] for s in first) / 3
    # Variance of a 3-step mean is the sum of the steps' variances over 9.
    var = sum(s["reward_std"] ** 2 / samples_per_step for s in first + last) / 9
    needed = RISE_IN_STANDARD_ERRORS * math.sqrt(var)
    return {"rise": rise, "needed": needed, "passed": rise > needed}


def checks_passed(steps: list[dict], rc: int) -> dict:
    values = [v for s in steps for v in s["checks"].values()]
    unchecked = [s["step"] for s in steps if not any(k.endswith("_meaning") for k in s["checks"])]
    ok = rc == 0 and bool(steps) and not unchecked and all(v == 1.0 for v in values)
    return {"rc": rc, "checks_logged": len(values), "steps_without_check": unchecked, "passed": ok}


def adapter_effect(steps: list[dict]) -> dict:
    if not steps or steps[-1]["probe"]["logprob_ref_diff_mean"] is None:
        return {"passed": False, "why": "the last step ran no probe (set trainer.check_sync_probe_freq=1)"}
    probe = steps[-1]["probe"]
    effect, noise = probe["logprob_ref_diff_mean"], probe["logprob_diff_mean"]
    ratio = effect / noise if noise > 0 else math.inf
    return {"effect": effect, "noise": noise, "ratio": ratio, "passed": ratio >= PROBE_EFFECT_OVER_NOISE}


def summarise(rows: list[dict], samples_per_step: int, rc: int) -> dict:
    steps = [step_summary(r) for r in rows]
    verdict = {
        "reward_rose": reward_rose(steps, samples_per_step),
        "sync_checks_passed": checks_passed(steps, rc),
        "adapter_effect_over_probe_noise": adapter_effect(steps),
    }
    return {"steps": steps, "verdict": verdict, "passed": all(v["passed"] for v in verdict.values())}


def samples_per_step(run_dir: Path) -> int:
    """data.train_batch_size x rollout.n from the run's own Hydra record."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    return int(cfg.data.train_batch_size) * int(cfg.rollout.n)


def error_line(log: Path | None) -> str | None:
    if log is None or not log.is_file():
        return None
    errors = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("error:")]
    return errors[-1] if errors else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--log", type=Path, default=None)
    ap.add_argument("--rc", type=int, default=0)
    ap.add_argument("--model-info", type=Path, default=None)
    args = ap.parse_args()
    rows = step_rows(args.run_dir / "metrics.jsonl")
    out = summarise(rows, samples_per_step(args.run_dir), args.rc) if rows else {"steps": [], "passed": False}
    out["error"] = error_line(args.log)
    if args.model_info is not None and args.model_info.is_file():
        out["model"] = json.loads(args.model_info.read_text())
    args.out.write_text(json.dumps(out, indent=1))
    for s in out["steps"]:
        print(
            f"step {s['step']}: reward {s['reward_mean']:.4f} (std {s['reward_std']:.4f}) grad_norm {s['grad_norm']} "
            f"checks {s['checks']} probe {s['probe']}"
        )
    print(json.dumps({"verdict": out.get("verdict"), "passed": out["passed"], "error": out["error"]}, indent=1))


if __name__ == "__main__":
    main()
