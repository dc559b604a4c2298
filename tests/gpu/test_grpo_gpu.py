"""GRPO-LoRA on GPUs (issue: FSDP2 over NCCL + vLLM on CUDA with sleep mode). Run on the
accelerator machine: `pytest -m gpu tests/gpu/test_grpo_gpu.py -s` (vLLM, CUDA torch needed).
Each case runs tests/gpu/grpo_gpu_steps.py under torchrun and checks its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("model,world", [("tiny", 1), ("qwen2_5_0_5b", 1), ("qwen2_5_0_5b", 2)])
def test_grpo_steps_on_gpu(model, world, tmp_path):
    if gpus() < world:
        pytest.skip(f"needs {world} GPUs")
    out = Path(os.environ.get("LORARL_GPU_LOG_DIR", tmp_path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(ROOT / "tests/gpu/grpo_gpu_steps.py"), "--model", model, "--steps", "4", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads((out / f"grpo_{model}_{world}gpu.json").read_text())
    steps = result["steps"]
    assert all(s["sync/kind"] == "adapter" and s["sync/num_adapters"] == 1 for s in steps)
    tol = 0.1 if model == "tiny" else 0.25
    assert max(s["sync/logprob_diff_max"] for s in steps) <= tol
    peak = [s["memory/max_allocated_gib"] for s in steps]
    assert max(peak[1:]) <= peak[1] * 1.05 + 0.1, f"GPU memory grows across steps: {peak}"
    sw = result["sleep_wake"]
    assert sw["level1_generation_unchanged"]
    assert sw["base_loaded_after_level2_sleep"] is False
    assert sw["sync_after_level2"] == "base+adapter"
    assert sw["level2_resend_generation_unchanged"]
