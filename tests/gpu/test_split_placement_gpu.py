"""trainer.placement=split on two GPUs: the training engine on one, vLLM on the other, with
trainer.off_policy_steps=1 (the next batch generated while the update runs, on separate devices).

Run on a machine with two GPUs: `pytest -m gpu tests/gpu/test_split_placement_gpu.py -s` (CUDA
torch, vLLM's CUDA build, Ray and Hydra needed). The real entry point with the embedded tiny model
and the default task; the step, generation and update times of every step are printed and
written beside the run (split_timing.json).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
STEPS = 8


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_split_off_policy_on_two_gpus_checks_every_sync_and_overlaps(tmp_path):
    if gpus() < 2:
        pytest.skip("needs two GPUs")
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "recipes.grpo", "+backend=fsdp", "trainer.device=cuda", "trainer.progress_bar=false",
        f"trainer.total_steps={STEPS}", "trainer.off_policy_steps=1", "trainer.placement=split",
        "trainer.check_sync_probe_freq=1", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-5000:]
    # One GPU each: the start-up line names the trainer's and the rollout's, and they differ.
    line = re.search(r"training engine on 1 worker \(GPU (\S+)\), vLLM on 1 rollout worker \(GPU (\S+)\)", out.stdout)
    assert line is not None, out.stdout[-3000:]
    assert line[1] != line[2]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["rollout/staleness"] for r in steps] == [0] + [1] * (STEPS - 1)
    for r in steps:
        assert r["sync/adapter_match"] == 1.0 and r["sync/adapter_meaning"] == 1.0, r["step"]
        assert r["sync/logprob_diff_max"] <= 0.5, r["step"]  # the 16-bit probe bound
        assert r["rollout/sleeps"] == 0.0
    timing = [
        {k: r[f"timing/{k}"] for k in ("step", "gen", "train", "sync")} | {"step_index": r["step"]} for r in steps
    ]
    (run_dir / "split_timing.json").write_text(json.dumps(timing, indent=1))
    for t in timing:
        print(
            f"step {t['step_index']}: step {t['step']:.3f} s, gen {t['gen']:.3f} s, update {t['train']:.3f} s, "
            f"sync {t['sync']:.3f} s"
        )
    # Step 1 generates first; the last step starts no generation. Outside the sync (which follows
    # both), an overlapped step takes less than its generation and its update one after the other.
    overlapped = steps[1:-1]
    serial = sum(r["timing/gen"] + r["timing/train"] for r in overlapped)
    assert sum(r["timing/step"] - r["timing/sync"] for r in overlapped) < serial
