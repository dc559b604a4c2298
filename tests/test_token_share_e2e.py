"""data=token_share from a random-initialised tiny model (no warm-up) through the real entry point
(Ray worker, FSDP2 over gloo, vLLM CPU with the synced adapter): the task gives a model that knows
nothing a learning signal, so rewards differ within groups, gradients are non-zero, the reward
climbs and the adapter moves the probe's log-probs, which trainer and vLLM agree on every step at
the float32 tolerance. For Qwen3 (q/k norms, every projection a LoRA target) the exported adapter
is then loaded by PEFT and by vLLM from its folder, and both generate the same tokens. This is
what random-weight shape runs on a GPU need before their sync checks mean anything
(tests/gpu/moe_step.sh, tests/gpu/dense_step.sh).

Measured for the thresholds (the settings below, trainer.seed 1 and 2; dense Qwen2 / Qwen3-MoE /
Qwen3): reward of the last 3 steps minus the first 3, +0.092, +0.085 / +0.085, +0.078 / +0.074,
+0.091; the dense runs at lr 1e-9 (adapter still), -0.005 and +0.004. Probe
`logprob_ref_diff_mean` first step to last, 4.1x, 2.8x / 5.2x, 3.7x / 6.0x, 5.6x;
`logprob_diff_max` at most 1.4e-6, >= 2.4e5x below the last ref diff.
With data=arith the random Qwen2 scores 0 on every sample of step 1: reward std 0 and grad_norm 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gpu.shape_summary import samples_per_step, step_rows, summarise
from tests.test_grpo_e2e import check_adapter_loads_in_peft_and_vllm, grpo, metrics

pytestmark = pytest.mark.slow

STEPS = 12
# 3.5x the no-learning spread of the statistic, and 2.8x under the smallest rise measured.
MIN_RISE = 0.03
# The adapter's effect on the probe, last step over first step (measured 2.8x and 4.1x).
MIN_REF_GROWTH = 2.0
# The adapter's effect over the trainer-vLLM difference at the last step (measured >= 2.4e5x in float32).
MIN_REF_OVER_SYNC = 1000.0


def learning_failures(rows: list[dict]) -> list[str]:
    """What a run whose adapter learns must show, as failure messages (empty: it learned)."""
    fails = []
    first, last = rows[0], rows[-1]
    if not first["reward/std"] > 0:
        fails.append(f"step 1 rewards are all equal (std {first['reward/std']}): no learning signal")
    if not min(r["actor/grad_norm"] for r in rows) > 0:
        fails.append(f"grad_norm 0 at some step: {[r['actor/grad_norm'] for r in rows]}")
    rewards = [r["reward/mean"] for r in rows]
    rise = sum(rewards[-3:]) / 3 - sum(rewards[:3]) / 3
    if not rise > MIN_RISE:
        fails.append(f"reward rose by {rise:.4f} (last 3 steps vs first 3), not > {MIN_RISE}: {rewards}")
    ref_first, ref_last = first["sync/logprob_ref_diff_mean"], last["sync/logprob_ref_diff_mean"]
    if not ref_last > MIN_REF_GROWTH * ref_first:
        fails.append(f"adapter effect on the probe {ref_first:.4g} -> {ref_last:.4g}, not {MIN_REF_GROWTH}x")
    if not ref_last > MIN_REF_OVER_SYNC * last["sync/logprob_diff_max"]:
        fails.append(
            f"adapter effect {ref_last:.4g} not {MIN_REF_OVER_SYNC}x the probe's trainer-vLLM max "
            f"{last['sync/logprob_diff_max']:.4g}"
        )
    return fails


# arch -> (model preset, what the sync sends and which fingerprint checks it). The MoE syncs merged
# weights on CPU (vLLM's CPU build serves no LoRA on MoE layers, docs/moe.md).
MODELS = {
    "qwen2": ("qwen2_tiny", "adapter", "sync/adapter_match"),
    "qwen3": ("qwen3_tiny", "adapter", "sync/adapter_match"),
    "qwen3_moe": ("qwen3_moe_tiny", "base", "sync/weights_match"),
}


@pytest.fixture(scope="module")
def random_models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("random")


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_random_model_learns_token_share(lorarl_cache, random_models, tmp_path, arch):
    from lorarl.models.tiny import MARKER, ensure_tiny_model

    preset, kind, fingerprint = MODELS[arch]
    model = ensure_tiny_model(random_models / arch, warmup_steps=0, arch=arch)
    assert json.loads((model / MARKER).read_text())["warmup_steps"] == 0  # random weights, never trained
    run = tmp_path / "run"
    out = grpo(
        run,
        lorarl_cache,
        "data=token_share",
        f"model={preset}",
        f"model.path={model}",
        "model.builder=null",
        "trainer.device=cpu",
        f"trainer.total_steps={STEPS}",
        "trainer.check_sync_probe_freq=1",
        f"trainer.test_freq={STEPS}",  # validation scores token ids too
        "actor.optim.lr=2e-3",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8",
    )
    assert out.returncode == 0, out.stderr[-5000:]
    rows = metrics(run)
    assert len(rows) == STEPS and all(r["sync/kind"] == kind and r[fingerprint] == 1.0 for r in rows)
    assert learning_failures(rows) == []
    # Trainer and vLLM both in float32: the probe's default tolerance is 1e-3; measured <= 1.4e-6.
    assert max(r["sync/logprob_diff_max"] for r in rows) < 1e-3
    assert 0.0 <= rows[-1]["val/token_share/reward/mean"] <= 1.0
    # The GPU shape runs' summary reads this run as they will read theirs.
    summary = summarise(step_rows(run / "metrics.jsonl"), samples_per_step(run), out.returncode)
    assert summary["passed"], summary["verdict"]
    assert (lorarl_cache / "data" / "token_share_v1_n1024" / "train.parquet").is_file()  # the generator wrote it
    if arch == "qwen3":
        config = json.loads((run / "final_adapter" / "adapter_config.json").read_text())
        assert sorted(config["target_modules"]) == sorted(
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        )
        check_adapter_loads_in_peft_and_vllm(run / "final_adapter", model)
