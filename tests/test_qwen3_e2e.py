"""model=qwen3_tiny through the real entry point: the embedded Qwen3 trained with GRPO-LoRA on
CPU (Ray worker, FSDP2 over gloo, vLLM CPU serving Qwen3 with the synced adapter), the parity
probe at the float32 tolerance every step, and the exported adapter loading in PEFT and vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_grpo_e2e import check_adapter_loads_in_peft_and_vllm, grpo, metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(run_cache: Path) -> Path:
    """run_cache with the session's Qwen3 under the name conf/model/qwen3_tiny.yaml expects."""
    from lorarl.models.tiny import default_tiny_model_path, ensure_tiny_model

    built = ensure_tiny_model(default_tiny_model_path(arch="qwen3"), arch="qwen3")
    link = run_cache / "qwen3_tiny"
    if not link.exists():
        link.symlink_to(built, target_is_directory=True)
    return run_cache


def test_qwen3_tiny_reward_rises_with_exact_parity(cache, tmp_path):
    run = tmp_path / "run"
    out = grpo(
        run,
        cache,
        "model=qwen3_tiny",
        # 60 steps: this model's reward rises by about 0.09 over 60 steps, 0.04 over 40.
        "trainer.total_steps=60",
        "trainer.device=cpu",
        "trainer.val_before_train=true",
        "trainer.test_freq=60",
        "trainer.check_sync_probe_freq=1",
    )
    assert out.returncode == 0, out.stderr[-5000:]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = metrics(run)
    assert len(rows) == 60
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.05, f"reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
    # Trainer and vLLM both in float32: the probe's default tolerance is 1e-3; measured ~1e-6.
    assert all(r["sync/kind"] == "adapter" for r in rows)
    assert max(r["sync/logprob_diff_max"] for r in rows) < 1e-3
    vals = [r for r in lines if "val/acc" in r]
    assert [r["step"] for r in vals] == [0, 60] and 0.0 < vals[0]["val/acc"] < 1.0
    config = json.loads((run / "final_adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    check_adapter_loads_in_peft_and_vllm(run / "final_adapter", cache / "qwen3_tiny")
