"""trainer.off_policy_steps=1 on one GPU (colocated: the update and vLLM's generation on one
device, vLLM awake) and its fallback to on-policy when vLLM must sleep.

Run on the accelerator machine: `pytest -m gpu tests/gpu/test_off_policy_gpu.py -s` (CUDA torch and
vLLM's CUDA build needed). The real entry point with the embedded tiny model and the default task.
"""

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


def grpo(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "recipes.grpo", "+backend=fsdp", "trainer.device=cuda", "trainer.progress_bar=false",
        "trainer.total_steps=8", "trainer.off_policy_steps=1", "trainer.check_sync_probe_freq=1",
        f"hydra.run.dir={run_dir}", *overrides,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=1800)


def steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward/mean" in r]


def test_generation_overlaps_the_update_with_vllm_awake(tmp_path):
    """vLLM stays awake (rollout.free_cache_engine=false), the batch of step k+1 is generated
    during step k's update: staleness 0 then 1, the sync checks pass at the same version, and
    a step takes less than its generation plus its update."""
    if gpus() < 1:
        pytest.skip("needs a GPU")
    out = grpo(tmp_path / "run", "rollout.free_cache_engine=false")
    assert out.returncode == 0, out.stderr[-5000:]
    rows = steps(tmp_path / "run")
    assert [r["rollout/staleness"] for r in rows] == [0] + [1] * 7
    assert all(r["rollout/sleeps"] == 0.0 for r in rows)
    for r in rows:
        assert r["sync/adapter_match"] == 1.0 and r["sync/adapter_meaning"] == 1.0, r["step"]
        assert r["rollout_corr/rollout_is_mean"] > 0  # token weights on (auto, off-policy)
    overlapped = rows[1:-1]  # step 1 generates first; the last step starts no generation
    serial = sum(r["timing/gen"] + r["timing/train"] for r in overlapped)
    assert sum(r["timing/step"] for r in overlapped) < serial


def test_a_sleeping_rollout_keeps_the_run_on_policy_and_says_why(tmp_path):
    if gpus() < 1:
        pytest.skip("needs a GPU")
    out = grpo(tmp_path / "run", "rollout.free_cache_engine=true")
    assert out.returncode == 0, out.stderr[-5000:]
    assert "vLLM sleeps during the update (the plan above), so generation cannot run beside it" in out.stdout
    assert [r["rollout/staleness"] for r in steps(tmp_path / "run")] == [0] * 8
