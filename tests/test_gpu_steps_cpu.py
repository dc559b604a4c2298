"""The GPU loop script (tests/gpu/grpo_gpu_steps.py) run on CPU, so CI keeps it working.

Same code path as on the H200s minus sleep mode (the CPU vLLM build has none): torchrun with
two ranks, each a Worker with FSDP2 over gloo and its own vLLM engine, three GRPO steps, an
adapter sync + parity probe after each, rollout speed with and without the adapter, then a
base + adapter resend compared with the engine's state before it, tensor by tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.grpo_gpu_steps import run_name

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("ranks,merge", [(2, False), (1, True)], ids=["adapter-2ranks", "merged-1rank"])
def test_gpu_steps_script_runs_on_cpu(tiny_model_path, tmp_path, ranks, merge):  # the fixture builds the model once
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        str(ROOT / "tests/gpu/grpo_gpu_steps.py"),
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--steps",
        "3",
        "--batch",
        "4",
        "--out",
        str(tmp_path),
    ] + (["--merge"] if merge else [])
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "LORARL_GPU_HANG_S": "500"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / f"{run_name('fsdp', 'tiny', ranks, merge, cuda=False)}.json").read_text())
    kind = "base" if merge else "adapter"
    assert [s["sync/kind"] for s in result["steps"]] == [kind] * 3
    assert all(s["sync/num_adapters"] == (0 if merge else 1) for s in result["steps"])
    assert max(s["sync/logprob_diff_max"] for s in result["steps"]) < 1e-4
    assert all(v > 0 for v in result["rollout_tokens_per_s"].values())
    # No sleep mode on CPU: the base is marked gone instead, and the resend (base + adapter, or
    # the merged base) must leave every engine tensor as it was.
    resend = result["sleep_wake"]
    assert resend["sync_after_resend"] == ("base" if merge else "base+adapter")
    assert resend["resend_tensor_changes"]["changed"] == 0, resend
    assert resend["resend_tensor_changes"]["tensors"] > 0
    assert resend["resend_logprob_diff"] == 0.0 and resend["resend_greedy_unchanged"]
