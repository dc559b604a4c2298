"""The sync checks on a GPU in bf16: no false alarm at 7B, and the mutations still caught.

Run on the accelerator machine after ../shared/tools/gpu-vllm/install.sh + install-extra.sh:

    pytest -m gpu tests/gpu/test_sync_checks_gpu.py -s

LORARL_GPU_LOG_DIR (default tests/gpu_logs/sync_checks) keeps each case's console output and a
JSON of what it read; commit that folder. CPU counterparts: tests/test_sync_checks.py (fingerprint
against real vLLM) and tests/test_sync_probe.py (probe on the real worker, fp32).

- 7B shape (random weights, Qwen2.5-7B's real shape, r=64, adapter mode, CUDA graphs): the recipe
  runs 20 steps with the default checks on; every step's fingerprint matches and the probe stays
  under the bf16 bound (the absolute 0.15 it replaces stopped this run at step 1 on 0.157).
- 0.5B shape in bf16 on the real worker: a correct sync passes both checks; a skipped sync, a
  zeroed adapter and one layer's B left out are each named by the fingerprint, and the probe
  catches the skipped sync and the zeroed adapter once the adapter has moved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lorarl.contract.messages import SyncRequest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
STEPS_7B = 20

# A sync that runs the probe whenever its sequences are set (the run's last step).
PROBING_SYNC = SyncRequest(step=1, last=True)


def log_dir() -> Path:
    out = Path(os.environ.get("LORARL_GPU_LOG_DIR", ROOT / "tests" / "gpu_logs" / "sync_checks"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("LORARL_CACHE", "/tmp/lcache"))


def need_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def need_liger() -> None:
    """The 7B preset runs as users run it: Liger's kernels on (backend.liger_kernel null is on for
    CUDA), so liger-kernel must be installed; said at once, not as the run's exit 2 minutes in."""
    import importlib.util

    assert importlib.util.find_spec("liger_kernel") is not None, (
        "liger-kernel is not installed: the 7B preset's default backend.liger_kernel needs it "
        "(pip install liger-kernel, or on the GPU machine install-extra.sh, which carries 0.8.5)"
    )


def test_7b_adapter_run_keeps_the_default_checks_for_20_steps(tmp_path):
    need_gpu()
    need_liger()
    from bench.common import shaped_model

    model = shaped_model(cache_dir(), "qwen2.5-7b", device="cuda")
    run = tmp_path / "run7b"
    cmd = [
        sys.executable,
        "-m",
        "recipes.grpo",
        "+backend=fsdp",
        "model=qwen2_5_7b_instruct",
        f"model.path={model}",
        "data=arith",
        "data.max_response_length=128",
        "data.train_batch_size=32",
        "rollout.n=8",
        "actor.ppo_mini_batch_size=32",
        "actor.ppo_micro_batch_size_per_gpu=16",
        "rollout.gpu_memory_utilization=0.35",
        "rollout.enforce_eager=false",
        f"trainer.total_steps={STEPS_7B}",
        "trainer.check_sync_probe_freq=1",  # the probe after every one of the 20 syncs
        "trainer.logger=[console,jsonl]",
        "trainer.progress_bar=false",
        f"hydra.run.dir={run}",
    ]
    # The project first, then what the shell had (vLLM, Ray and Hydra may live in a --target folder).
    env = {
        **os.environ,
        "LORARL_CACHE": str(cache_dir()),
        "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}:{os.environ.get('PYTHONPATH', '')}",
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    out = log_dir()
    (out / "grpo_7b_adapter_graphs_20steps.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("step", 0) >= 1 and "sync/adapter_match" in s]
    keys = ("step", "sync/adapter_match", "sync/adapter_check_seconds", "sync/logprob_diff_max")
    keys += ("sync/logprob_diff_mean", "sync/logprob_ref_diff_mean", "sync/seconds", "timing/step")
    summary = [{k: s.get(k) for k in keys} for s in steps]
    (out / "grpo_7b_adapter_graphs_20steps.json").write_text(json.dumps(summary, indent=1))
    check_7b_summary(summary)


def check_7b_summary(summary: list[dict]) -> None:
    """What the 20-step 7B run must show (also applied in CI to the committed log's JSON): the
    fingerprint matched after every sync and the probe, run after every sync, stayed under the
    16-bit bound."""
    from lorarl.sync.probe import HALF_BOUNDS

    assert [s["step"] for s in summary] == list(range(1, STEPS_7B + 1))
    assert all(s["sync/adapter_match"] == 1.0 for s in summary)
    assert all(s["sync/logprob_diff_max"] is not None for s in summary)
    assert max(s["sync/logprob_diff_max"] for s in summary) <= HALF_BOUNDS.max
    assert max(s["sync/logprob_diff_mean"] for s in summary) <= HALF_BOUNDS.mean


@pytest.fixture(scope="module")
def worker():
    """The real Worker on one GPU: FSDP2 (NCCL, world 1) + vLLM with sleep mode, bf16, 0.5B shape."""
    need_gpu()
    from bench.common import shaped_model
    from tests.workers import make_worker

    model = shaped_model(cache_dir(), "qwen2.5-0.5b", device="cuda")
    w = make_worker(
        "model=qwen2_5_0_5b_instruct", f"model.path={model}", "rollout.gpu_memory_utilization=0.4", device="cuda"
    )
    gen = torch.Generator().manual_seed(0)
    w.sync_sessions[0].set_probes([torch.randint(10, 2000, (48,), generator=gen).tolist() for _ in range(4)])
    yield w
    w.shutdown()


def moved_adapter(worker, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lora = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in worker.engine.lora_state().items()}
    worker.engine.load_state(lora, None, None)
    return lora


def apply_mutated(worker, lora: dict, edit) -> None:
    from lorarl.contract.payload import WeightPayload

    sent = {k: v.clone() for k, v in lora.items()}
    edit(sent)
    worker.rollout.apply(WeightPayload.adapter(sent, worker.engine.adapter_config()))


def fingerprint_error(worker, lora: dict) -> str:
    from lorarl.contract.payload import WeightPayload
    from lorarl.errors import SyncError
    from lorarl.sync import transport

    with pytest.raises(SyncError) as err:
        transport.verify_adapter(worker.rollout, WeightPayload.adapter(lora, worker.engine.adapter_config()))
    return str(err.value)


def probe_reading(worker) -> dict:
    from lorarl.sync import probe

    reading = probe.measure_probe(worker.engine, worker.rollout, worker.sync_sessions[0].probe_seqs)
    try:
        probe.judge_probe(reading, worker.sync_sessions[0].probe_bounds)
        verdict = "pass"
    except Exception as err:  # noqa: BLE001 - recorded, asserted by the caller
        verdict = str(err)
    return {**reading.as_metrics(), "verdict": verdict}


def test_bf16_mutations_on_gpu(worker):
    record: dict = {}
    lora = moved_adapter(worker, seed=1)
    out = worker.sync(PROBING_SYNC)[0]
    record["correct"] = {k: v for k, v in out.items() if k.startswith("sync/")}
    assert out["sync/adapter_match"] == 1.0

    stale = moved_adapter(worker, seed=2)  # trained on; the sync is skipped
    record["skipped_sync"] = {"fingerprint": fingerprint_error(worker, stale), "probe": probe_reading(worker)}
    assert "differs from what the trainer sent" in record["skipped_sync"]["fingerprint"]
    assert record["skipped_sync"]["probe"]["verdict"] != "pass"

    lora = stale
    worker.sync(PROBING_SYNC)
    apply_mutated(worker, lora, lambda t: [v.zero_() for v in t.values()])
    record["zeroed"] = {"fingerprint": fingerprint_error(worker, lora), "probe": probe_reading(worker)}
    assert "holds zeros" in record["zeroed"]["fingerprint"]
    assert record["zeroed"]["probe"]["verdict"] != "pass"

    worker.sync(PROBING_SYNC)
    name = "base_model.model.model.layers.11.mlp.down_proj.lora_B.weight"
    apply_mutated(worker, lora, lambda t: t[name].zero_())
    record["one_b_left_out"] = {"fingerprint": fingerprint_error(worker, lora), "probe": probe_reading(worker)}
    assert "lora_B of 'model.layers.11.mlp.down_proj'" in record["one_b_left_out"]["fingerprint"]

    out = worker.sync(PROBING_SYNC)[0]
    record["resynced"] = {k: v for k, v in out.items() if k.startswith("sync/")}
    assert out["sync/adapter_match"] == 1.0
    (log_dir() / "bf16_mutations_0_5b.json").write_text(json.dumps(record, indent=1, default=str))
