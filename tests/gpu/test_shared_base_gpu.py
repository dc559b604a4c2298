"""backend.share_base on a GPU: what vLLM's CPU build cannot show.

Run on the accelerator machine after ../shared/tools/gpu-vllm/install.sh:

    pytest -m gpu tests/gpu/test_shared_base_gpu.py -s

- 0.5B shape, bf16, the rollout asleep during every update (rollout.free_cache_engine=true): the
  sleep frees the KV cache and leaves every shared weight where it is (same storage spans, same
  values, read in place), the update runs on vLLM's own weights, the wake brings the cache back,
  and the semantic check and the log-prob probe pass after each sync.
- Tiny Qwen3-MoE, adapter sync: the expert stacks are vLLM's fused-MoE w13/w2 themselves (vLLM's
  GPU build keeps its loaded layout), their values the checkpoint's, and a sync passes the checks.
CPU counterparts: tests/test_shared_base.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lorarl.contract.messages import SyncRequest
from tests.test_shared_base import differ_from_checkpoint, train_step, unshared
from tests.workers import make_worker

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    return Path(os.environ.get("LORARL_CACHE", "/tmp/lcache"))


def gpu_worker(model_path: Path, *overrides: str):
    # liger's kernels are beside the point here (which storage the weights live in)
    return make_worker(
        f"model.path={model_path}",
        "rollout.gpu_memory_utilization=0.4",
        "backend.liger_kernel=false",
        *overrides,
        device="cuda",
    )


def run_alone(check: str) -> None:
    """`check` of this module in a fresh process: vLLM's sleep-mode allocator (CuMem) serves one
    engine per process, so a second engine in the process of a first one fails at load."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    code = f"from tests.gpu.test_shared_base_gpu import {check}; {check}()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


def test_sleep_frees_only_the_kv_cache_and_the_shared_weights_stay():
    run_alone("sleep_frees_only_the_kv_cache")


def test_moe_expert_stacks_are_vllms_fused_moe_weights():
    run_alone("moe_expert_stacks_are_vllms")


def sleep_frees_only_the_kv_cache() -> None:
    from bench.common import shaped_model

    model = shaped_model(cache_dir(), "qwen2.5-0.5b", device="cuda")
    w = gpu_worker(model, "model=qwen2_5_0_5b_instruct", "rollout.free_cache_engine=true")
    try:
        assert w.spec.base_plan.shared and w.sleep.sleeps, (w.spec.base_plan, w.sleep.plan)
        assert unshared(w) == [] and differ_from_checkpoint(w) == []
        gen = torch.Generator().manual_seed(0)
        w.sync_sessions[0].set_probes([torch.randint(10, 2000, (48,), generator=gen).tolist() for _ in range(4)])
        first = w.sync(SyncRequest(step=0, last=False))[0]
        assert first.kind == "adapter" and first.adapter_meaning == 1.0
        for step in (1, 2):
            torch.cuda.synchronize()
            free_awake = torch.cuda.mem_get_info()[0]
            w.sleep.sleep()  # what the worker's update does first
            torch.cuda.synchronize()
            freed = torch.cuda.mem_get_info()[0] - free_awake
            assert freed > 1 << 30, f"the sleep freed only {freed / 2**30:.2f} GiB"
            assert w.rollout.base_loaded and unshared(w) == []
            assert differ_from_checkpoint(w) == []  # read in place while asleep: never unmapped
            report = train_step(w, step)  # updates on vLLM's weights, then wakes and syncs
            w.sync_sessions[0].probe_if_due(SyncRequest(step=step, last=True), report)
            assert report.kind == "adapter" and report.adapter_meaning == 1.0
            assert report.logprob_diff_max is not None
            assert unshared(w) == [] and differ_from_checkpoint(w) == []
    finally:
        w.shutdown()


def moe_expert_stacks_are_vllms() -> None:
    from lorarl.models.tiny import default_tiny_model_path, ensure_tiny_model

    model = ensure_tiny_model(default_tiny_model_path(arch="qwen3_moe"), arch="qwen3_moe")
    w = gpu_worker(model, "model=qwen3_moe_tiny", "model.lora.merge=false", "model.dtype=bfloat16")
    try:
        assert w.spec.base_plan.shared, w.spec.base_plan
        assert unshared(w) == [] and differ_from_checkpoint(w) == []
        experts = [n for n, p in w.engine.model.named_parameters() if not p.requires_grad and ".experts." in n]
        assert experts, "no expert stack was bound"
        report = w.sync(SyncRequest(step=0, last=False))[0]
        assert report.kind == "adapter" and report.adapter_meaning == 1.0
    finally:
        w.shutdown()
