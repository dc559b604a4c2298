"""A verl launch whose reward is a file (custom_reward_function.path) trains through
`python -m recipes.from_verl --run` on the embedded tiny model and the arithmetic task, and the
rewards it logs are the file's: its compute_score, called as verl calls it, scores 0.25 or 0.75
where the built-in arithmetic reward scores 0 or 1, and writes down every call it gets, so the
test recomputes each step's mean reward from the calls on its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# A reward file in verl's style: the float form under verl's default name, and the dict form.
REWARD_FILE = '''
"""Rewards for the sums task, as a verl user would write them."""
import json
import os
import re

CALLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls.jsonl")


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    numbers = re.findall(r"-?\\d+", solution_str)
    score = 0.75 if numbers and numbers[-1] == str(ground_truth) else 0.25
    with open(CALLS, "a") as out:
        out.write(json.dumps({"data_source": data_source, "solution_str": solution_str,
                              "ground_truth": ground_truth, "extra_info": sorted(extra_info or {})}) + "\\n")
    return score


def compute_score_dict(data_source, solution_str, ground_truth, extra_info=None):
    score = compute_score(data_source, solution_str, ground_truth, extra_info)
    return {"score": score, "acc": score > 0.5}
'''

STEPS, PROMPTS, SAMPLES = 2, 8, 4

LAUNCH = f"""
set -x
DATA=$LORARL_CACHE/data/arith_v3_n1024
python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo \\
    data.train_files=$DATA/train.parquet \\
    data.val_files=$DATA/val.parquet \\
    data.train_batch_size={PROMPTS} \\
    data.max_prompt_length=64 \\
    data.max_response_length=8 \\
    actor_rollout_ref.model.path=$LORARL_CACHE/qwen2_tiny \\
    actor_rollout_ref.model.lora_rank=16 \\
    actor_rollout_ref.model.lora_alpha=32 \\
    actor_rollout_ref.model.enable_gradient_checkpointing=False \\
    actor_rollout_ref.actor.optim.lr=1e-4 \\
    actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS} \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \\
    actor_rollout_ref.rollout.name=vllm \\
    actor_rollout_ref.rollout.n={SAMPLES} \\
    actor_rollout_ref.rollout.dtype=float32 \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \\
    custom_reward_function.path=my_reward.py \\
    trainer.total_training_steps={STEPS} \\
    trainer.n_gpus_per_node=1 \\
    trainer.nnodes=1 \\
    trainer.save_freq=-1 \\
    trainer.test_freq=-1 \\
    trainer.val_before_train=False $@
"""


def expected_score(solution: str, ground_truth: str) -> float:
    """The reward file's rule, written again here: the last integer of the answer against the truth."""
    words = "".join(c if c.isdigit() or c == "-" else " " for c in solution).split()
    answers = [w for w in words if re.fullmatch(r"-?\d+", w)]
    return 0.75 if answers and answers[-1] == ground_truth else 0.25


def test_a_launch_with_a_reward_file_trains_on_the_files_rewards(run_cache, tmp_path):
    work = tmp_path / "verl_project"  # where a verl user keeps the launch and the reward file
    work.mkdir()
    (work / "my_reward.py").write_text(REWARD_FILE)
    (work / "run_grpo.sh").write_text(LAUNCH)
    env = {**os.environ, "LORARL_CACHE": str(run_cache), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "recipes.from_verl", "--run", "--model", "qwen2_tiny", "--data", "arith"]
    cmd += ["run_grpo.sh", "--", "trainer.device=cpu", "trainer.progress_bar=false", f"hydra.run.dir={run_dir}"]
    out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-5000:]
    assert f"data.reward_fn={work}/my_reward.py:compute_score" in out.stderr  # the translation's note

    calls = [json.loads(line) for line in (work / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == STEPS * PROMPTS * SAMPLES, len(calls)
    assert {c["data_source"] for c in calls} == {"arith"} and all("response_ids" in c["extra_info"] for c in calls)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    per_step = PROMPTS * SAMPLES
    want = [
        sum(expected_score(c["solution_str"], c["ground_truth"]) for c in calls[i * per_step : (i + 1) * per_step])
        / per_step
        for i in range(STEPS)
    ]
    assert rewards == pytest.approx(want, abs=1e-9), (rewards, want)
    assert all(0.25 <= r <= 0.75 for r in rewards)  # the built-in reward gives 0 or 1 per sample
