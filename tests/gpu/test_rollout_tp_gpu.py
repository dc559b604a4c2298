"""Rollout tensor parallelism on 2 GPUs: the recipe with rollout.tensor_model_parallel_size=2.

Not run yet (it needs a machine with 2 GPUs). Run on the accelerator machine with:

    pytest -m gpu tests/gpu/test_rollout_tp_gpu.py -s

Two workers, one GPU each, share one vLLM engine (external_launcher over the workers' NCCL
group; each process sees only its own GPU, so vLLM's local rank is 0). The 0.5B shape in bf16,
adapter mode with sleep mode and CUDA graphs: every step's fingerprint of each rank's adapter
slice must match and the probe stay under the bf16 bound. The CPU counterpart
(tests/test_rollout_tp.py) runs the same path with gloo.
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


def test_recipe_with_rollout_tensor_parallel_2_on_2_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    from bench.common import shaped_model
    from lorarl.sync.probe import HALF_BOUNDS

    cache = Path(os.environ.get("LORARL_CACHE", "/tmp/lcache"))
    model = shaped_model(cache, "qwen2.5-0.5b", device="cuda")
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "recipes.grpo",
        "+backend=fsdp",
        "model=qwen2_5_0_5b_instruct",
        f"model.path={model}",
        "data=arith",
        "data.max_response_length=128",
        "data.train_batch_size=16",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=16",
        "actor.ppo_micro_batch_size_per_gpu=16",
        "trainer.n_gpus_per_node=2",
        "rollout.tensor_model_parallel_size=2",
        "rollout.gpu_memory_utilization=0.3",
        "trainer.total_steps=5",
        "trainer.progress_bar=false",
        f"hydra.run.dir={run}",
    ]
    env = {**os.environ, "LORARL_CACHE": str(cache), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "NCCL_NVLS_ENABLE": "0"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/mean" in s]
    assert len(steps) == 5
    assert all(s["sync/adapter_match"] == 1.0 for s in steps)
    assert max(s["sync/logprob_diff_max"] for s in steps) <= HALF_BOUNDS.max
