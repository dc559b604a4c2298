"""The committed GPU run satisfies the GPU test's own checks.

tests/gpu/test_grpo_gpu.py runs on the accelerator machine; its checks are applied here to
the JSON that run left under tests/gpu_logs/, so a check tightened past what the GPUs
showed, or a log that no longer shows what the notes quote, fails in CI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gpu.test_grpo_gpu import GPU_CASES, check_result
from tests.gpu.test_sleep_plan_gpu import check_summary as check_sleep_plan
from tests.gpu.test_sync_checks_gpu import check_7b_summary

RUN = Path(__file__).parent / "gpu_logs" / "grpo_loop" / "run3_2026-11-30T1008"
CASES = sorted(RUN.glob("grpo_*.json"))
# GPU cases written after that run and not run on a GPU yet: they have no log to check.
NOT_RUN_YET = {("fsdp", "qwen3_0_6b", 1, False), ("megatron", "qwen3_0_6b", 2, False)}


def test_the_committed_run_covers_every_gpu_case():
    seen = {(r["backend"], r["model"], r["world"], r["merge"]) for r in map(json.loads, map(Path.read_text, CASES))}
    written = {(backend, model, world, merge) for backend, model, world, _, merge in GPU_CASES}
    assert NOT_RUN_YET <= written
    assert seen == written - NOT_RUN_YET


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_committed_gpu_run_passes_the_gpu_checks(path):
    result = json.loads(path.read_text())
    check_result(result, result["model"], result["merge"])


def test_committed_7b_sync_check_run_passes_its_gpu_checks():
    """tests/gpu/test_sync_checks_gpu.py's 20-step 7B run (one H200, bf16, the probe after every
    sync): every fingerprint matched and no probe reading crossed the bound."""
    summary = json.loads(
        (Path(__file__).parent / "gpu_logs" / "sync_checks" / "grpo_7b_adapter_graphs_20steps.json").read_text()
    )
    check_7b_summary(summary)


def test_committed_sleep_plan_run_passes_its_gpu_checks():
    """tests/gpu/test_sleep_plan_gpu.py on one H200 (0.5B shape, vLLM at 55%): asleep for step 1 on
    the estimate (54.1 GiB), awake from step 2 on the measured peak (36.3 GiB)."""
    check_sleep_plan(
        json.loads((Path(__file__).parent / "gpu_logs" / "sleep_plan" / "sleep_plan_0.5b.json").read_text())
    )


@pytest.mark.parametrize(
    ("name", "n_steps"),
    [("dense/dense_step_token_share", 20), ("moe/moe_step_l24_token_share", 20), ("moe/moe_step_l48_h100_routed", 10)],
)
def test_committed_shape_runs_pass_their_verdict_recomputed(name, n_steps):
    """tests/gpu/dense_step.sh (7B shape) and moe_step.sh (30B-A3B shape, 24 and all 48 layers) on one H100:
    the verdict recomputed here from the committed steps, by tests/gpu/shape_summary's rules: the
    reward rose, the semantic and transport checks were 1 on every step, and the adapter's effect
    on the probe is at least 10x the probe's noise."""
    from tests.gpu.shape_summary import adapter_effect, checks_passed, reward_rose

    steps = json.loads((Path(__file__).parent / "gpu_logs" / f"{name}.json").read_text())["steps"]
    assert len(steps) == n_steps
    assert reward_rose(steps, samples_per_step=16 * 8)["passed"]
    assert checks_passed(steps, rc=0)["passed"]
    assert {k for s in steps for k in s["checks"]} == {"sync/adapter_match", "sync/adapter_meaning"}
    assert adapter_effect(steps)["ratio"] >= 10
