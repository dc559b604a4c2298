"""bench.sweep_shared_base: the commands it times are the sweep a user types (either launcher), and
its report reads job folders as the recipe writes them. The timing itself is the benchmark's, not a test's."""

from __future__ import annotations

import json
from pathlib import Path

from bench import sweep_shared_base as bench
from lorarl import metrics as keys


def test_both_arms_run_the_same_sweep_and_differ_only_in_the_launcher(tmp_path):
    basic = bench.sweep_command("tiny", bench.POINTS, 10, tmp_path / "b", shared=False, model=None)
    shared = bench.sweep_command("tiny", bench.POINTS, 10, tmp_path / "b", shared=True, model=None)
    assert shared[: len(basic)] == basic and shared[len(basic) :] == ["hydra/launcher=shared_base"]
    assert basic[2:5] == ["recipes.grpo", "-m", "+backend=fsdp"]
    assert {"model.lora.rank=8,16", "actor.optim.lr=1e-3,5e-4", "trainer.total_steps=10"} <= set(basic)
    gpu = bench.sweep_command("0.5b", bench.POINTS, 6, tmp_path / "g", shared=True, model=Path("/m"))
    assert {"model.path=/m", "model.builder=null", "rollout.gpu_memory_utilization=0.5"} <= set(gpu)
    assert bench.sequences_per_step(basic, tmp_path) == 16 * 8  # the default run's 16 prompts x 8 samples


def test_the_report_reads_each_job_folder(tmp_path):
    for name, rewards in (("0_fsdp_qwen2_tiny_r8", [0.1, 0.2, 0.3, 0.4, 0.5]), ("1_fsdp_qwen2_tiny_r16", [0.2] * 5)):
        job = tmp_path / name
        job.mkdir()
        rows = [{"step": 0, keys.VAL_ACC.key: 0.1}] + [
            {"step": i + 1, keys.REWARD_MEAN.key: r} for i, r in enumerate(rewards)
        ]
        (job / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    jobs = bench.jobs_of(tmp_path)
    assert [j["job"] for j in jobs] == ["0_fsdp_qwen2_tiny_r8", "1_fsdp_qwen2_tiny_r16"]
    assert jobs[0]["steps"] == 5 and jobs[0]["final_reward"] == 0.5 and jobs[0]["val_acc"] == 0.1
    run = {"arm": "shared", "repeat": 1, "wall_s": 40.0, "sequences_per_s": 12.8, "peak_gib": 3.0, "jobs": jobs}
    result = {"date": "d", "machine": "m", "command": "c", "points": "p", "steps": 5, "shape": "tiny",
              "runs": [{**run, "arm": "basic", "wall_s": 100.0}, run], "ratios": [2.5]}  # fmt: skip
    table = bench.table(result)
    assert "| shared | 1 | 40.0 | 12.8 | 3.0 | 2 | 0.500, 0.200 |" in table
    assert "median 2.50x" in table
