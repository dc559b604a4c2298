"""bench.gpu_step: the run plan, the parameter count behind its MFU, and one real lorarl run of
its --cpu-smoke (tiny model on CPU; the TRL half needs trl, which CI does not install)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_step import param_count, plan, select

ROOT = Path(__file__).resolve().parents[1]


def test_plan_puts_the_most_important_runs_first():
    runs = plan(["0.5b", "7b"], [False, True], ["adapter", "merged"], ["lorarl", "trl"])
    assert [r.name for r in runs] == [
        "lorarl-0.5b-adapter-kloff",
        "trl-0.5b-merged-kloff",
        "lorarl-7b-adapter-kloff",
        "trl-7b-merged-kloff",
        "lorarl-0.5b-adapter-klon",
        "trl-0.5b-merged-klon",
        "lorarl-7b-adapter-klon",
        "trl-7b-merged-klon",
        "lorarl-0.5b-merged-kloff",
        "lorarl-7b-merged-kloff",
        "lorarl-0.5b-merged-klon",
        "lorarl-7b-merged-klon",
    ]
    assert [r.name for r in select(runs, "trl-*-kloff")] == ["trl-0.5b-merged-kloff", "trl-7b-merged-kloff"]
    with pytest.raises(SystemExit, match="matches no planned run"):
        select(runs, "lorarl-3b-*")


def test_param_count_matches_the_saved_model(tiny_model_path):
    from bench.common import model_params

    config = json.loads((tiny_model_path / "config.json").read_text())
    assert param_count(config) == model_params(tiny_model_path)


def test_cpu_smoke_lorarl_run_writes_the_step_compare_row(run_cache, tmp_path):
    name = "lorarl-tiny-adapter-kloff"
    cmd = [sys.executable, "-m", "bench.gpu_step", "--cpu-smoke", "--only", name]
    cmd += ["--cache", str(run_cache), "--out-dir", str(tmp_path), "--stem", "smoke"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"[gpu_step] {name}: step" in proc.stdout
    result = json.loads((tmp_path / "smoke.json").read_text())
    (row,) = result["step_compare"]
    assert (row["system"], row["shape"], row["kl"], row["mode"]) == ("lorarl", "tiny", False, "adapter")
    assert len(row["steps_s"]) == 4 and row["step_s"] > 0
    assert row["step_s"] == pytest.approx(statistics.median(row["steps_s"][2:]))  # steps 3+
    # 4 prompts x 4 samples: prompt tokens from lorarl's loader, responses of at most 16 tokens.
    assert len(row["prompt_tokens_per_step"]) == 4 and all(t > 0 for t in row["prompt_tokens_per_step"])
    prompt = row["prompt_tokens_per_step"]
    assert min(prompt) < row["tokens_per_step"] <= max(prompt) + 16 * 16
    b = row["breakdown"]
    assert {"timing/gen", "timing/update", "timing/sync", "sync/seconds", "timing/old_logp"} <= set(b)
    assert b["timing/old_logp"] == 0.0 and "timing/ref_logp" in b  # absent (on-policy, no KL) reads 0
    assert 0 < row["mfu_update"] < row["mfu_update_hw"]
    assert "recipes.grpo +backend=fsdp" in row["command"] and "actor.use_kl_loss=false" in row["command"]
    assert "error" not in row
    assert (tmp_path / "smoke.md").read_text().count(name) >= 2
