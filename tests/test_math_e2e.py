"""The math path end to end on CPU: the shipped MATH-style sample prepared to parquet, trained and
validated through `python -m recipes.grpo ... data=math_sample` with the boxed-answer reward.
The embedded tiny model was warmed up on sums, not LaTeX, so it scores about 0; what is checked is
that every part runs and the validation metrics the README promises are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_grpo_e2e import grpo
from tests.test_prepare_math import SAMPLE, prepare_math

pytestmark = pytest.mark.slow


def test_math_sample_trains_and_validates(run_cache, tmp_path):
    data = tmp_path / "data"
    assert (
        prepare_math.main(
            [
                "--style",
                "math",
                "--train",
                str(SAMPLE / "train.jsonl"),
                "--test",
                str(SAMPLE / "test.jsonl"),
                "--out-dir",
                str(data),
            ]
        )
        == 0
    )
    run_dir = tmp_path / "run"
    out = grpo(
        run_dir,
        run_cache,
        "data=math_sample",
        f"data.train_files=[{data / 'train.parquet'}]",
        f"data.val_files=[{data / 'test.parquet'}]",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "actor.ppo_micro_batch_size_per_gpu=8",
        "rollout.n=2",
        "rollout.val_kwargs.n=2",
        "rollout.val_kwargs.do_sample=true",
        "rollout.val_kwargs.temperature=1.0",
        "trainer.total_steps=2",
        "trainer.device=cpu",
        "trainer.val_before_train=true",
        "trainer.test_freq=2",
        "trainer.logger=[jsonl]",
    )
    assert out.returncode == 0, out.stderr[-5000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 and r["sync/kind"] == "adapter" for r in steps)
    vals = [r for r in lines if "val/acc" in r]
    assert [r["step"] for r in vals] == [0, 2]
    expected = {"val/math/reward/mean", "val/math/acc/mean@2", "val/math/acc/pass@1", "val/math/acc/pass@2", "val/acc"}
    for row in vals:
        assert expected <= row.keys()
        assert all(0.0 <= row[k] <= 1.0 for k in expected)
        assert row["val/math/acc/pass@1"] == pytest.approx(row["val/math/acc/mean@2"])
        assert row["val/math/acc/pass@2"] >= row["val/math/acc/pass@1"]
    assert Path(run_dir / "final_adapter" / "adapter_config.json").is_file()
