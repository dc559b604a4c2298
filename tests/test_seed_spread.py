"""scripts/seed_spread.py on real sweep folders (job folders with .hydra/overrides.yaml and
metrics.jsonl as the recipe writes them): points matched across sets without their seed, each
set's mean and spread of the final reward and the last held-out accuracy, a short job listed."""

from __future__ import annotations

import json

from lorarl import metrics as keys
from scripts.seed_spread import main


def _job(folder, name, overrides, rewards, val):
    job = folder / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    step = {keys.TIMING_STEP.key: 1.0, keys.SYNC_SECONDS.key: 0.01}
    rows = [{"step": i + 1, keys.REWARD_MEAN.key: r, **step} for i, r in enumerate(rewards)]
    rows.append({"step": len(rewards), keys.VAL_ACC.key: val})
    (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_points_matched_across_sets_by_their_overrides_less_the_seed(tmp_path, capsys):
    a1, a2, b = tmp_path / "a1", tmp_path / "a2", tmp_path / "b"
    _job(a1, "0", ["model=qwen2_tiny", "model.lora.rank=8"], [0.0] * 5 + [0.5] * 5, 0.5)
    _job(a2, "0", ["model=qwen2_tiny", "model.lora.rank=8", "trainer.seed=2"], [0.0] * 5 + [0.7] * 5, 0.25)
    _job(a2, "1", ["model=qwen2_tiny", "model.lora.rank=8", "trainer.seed=3"], [0.1] * 4, 0.0)  # ended early
    _job(b, "0", ["model=qwen2_tiny", "model.lora.rank=8"], [0.2] * 10, 0.75)
    main(["--a", str(a1), str(a2), "--b", str(b)])
    out = capsys.readouterr().out
    assert "every point: model=qwen2_tiny model.lora.rank=8" in out
    # The last fifth of 10 steps is the last 2: 0.5 and 0.7; their mean 0.6, sd 0.1414.
    assert "| a | 1, 2 (seed 3: 4 steps) | 0.600 (sd 0.141; 0.500, 0.700) | 0.375 (sd 0.177; 0.500, 0.250) |" in out
    assert "| b | 1 | 0.200 (sd nan; 0.200) | 0.750 (sd nan; 0.750) |" in out
