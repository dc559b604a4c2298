"""The measured sleep plan on one GPU: asleep on the estimate's word, awake once an update was measured.

Run on the accelerator machine after ../shared/tools/gpu-vllm/install.sh + install-extra.sh:

    pytest -m gpu tests/gpu/test_sleep_plan_gpu.py -s

The 0.5B shape with vLLM holding 55% of the GPU: lorarl.rollout.memory's estimate of the update at the
preset's 24576-token budget (54 GiB, 70 with its margin) is more than the ~61 GiB left, so the
first update runs with the engine asleep. Its measured peak fits, so from the second step on the
engine stays awake, and the run says so once. LORARL_GPU_LOG_DIR (default
tests/gpu_logs/sleep_plan) keeps the console output and a JSON of the per-step readings;
tests/test_gpu_logs.py applies the same checks to the committed JSON in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
SWITCH = "from the next step the rollout stays awake during the update"


def test_rollout_wakes_for_good_once_a_measured_update_fits(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from bench.common import shaped_model

    cache = Path(os.environ.get("LORARL_CACHE", "/tmp/lcache"))
    model = shaped_model(cache, "qwen2.5-0.5b", device="cuda")
    run = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "recipes.grpo", "+backend=fsdp", "model=qwen2_5_0_5b_instruct",
        f"model.path={model}", "data=arith", "data.max_response_length=128", "data.train_batch_size=32",
        "rollout.n=8", "actor.ppo_mini_batch_size=32", "rollout.gpu_memory_utilization=0.55",
        "rollout.enforce_eager=false", f"trainer.total_steps={STEPS}", "trainer.logger=[console,jsonl]",
        "trainer.progress_bar=false", f"hydra.run.dir={run}",
    ]  # fmt: skip
    env = {
        **os.environ,
        "LORARL_CACHE": str(cache),
        "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}:{os.environ.get('PYTHONPATH', '')}",
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = Path(os.environ.get("LORARL_GPU_LOG_DIR", ROOT / "tests" / "gpu_logs" / "sleep_plan"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "sleep_plan_0.5b.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "rollout/sleeps", "timing/sleep", "timing/wake", "memory/update_peak_gib", "timing/step")
    summary = {
        "switch_lines": [line for line in proc.stdout.splitlines() if SWITCH in line],
        "plans": [line for line in proc.stdout.splitlines() if line.startswith("rollout ")],
        "steps": [{k: s.get(k) for k in keys} for s in steps if s.get("step", 0) >= 1 and "rollout/sleeps" in s],
    }
    (out / "sleep_plan_0.5b.json").write_text(json.dumps(summary, indent=1))
    check_summary(summary)


def check_summary(summary: dict) -> None:
    """Step 1 ran asleep (the estimate), every later step awake with no sleep or wake time, and the
    switch was said once, after step 1."""
    steps = summary["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert any("rollout sleeps during the update" in p for p in summary["plans"]), summary["plans"]
    assert steps[0]["rollout/sleeps"] == 1.0 and steps[0]["timing/sleep"] > 0
    assert all(s["rollout/sleeps"] == 0.0 and s["timing/sleep"] == 0.0 for s in steps[1:])
    assert len(summary["switch_lines"]) == 1 and summary["switch_lines"][0].startswith("step 1:")
    assert all(s["memory/update_peak_gib"] > 0 for s in steps)
