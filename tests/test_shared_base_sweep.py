"""Sweeps on one base end to end (hydra/launcher=shared_base), on the embedded model and CPU: a job
that diverges ends alone while the others train on, a killed group resumes where it stopped, and
a fault in one job's adapter stops the group at its first sync naming that job and the module.

The folders, files and logged keys of a shared-base sweep against the basic launcher's are in
tests/test_grpo_e2e.py; each adapter's update against its job alone in tests/test_group_update.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SMALL = (
    "trainer.device=cpu", "trainer.progress_bar=false", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=16", "rollout.n=4", "hydra/launcher=shared_base",
)  # fmt: skip


def command(sweep_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "recipes.grpo",
        "-m",
        "+backend=fsdp",
        *SMALL,
        f"hydra.sweep.dir={sweep_dir}",
        *overrides,
    ]


def rows(job: Path) -> list[dict]:
    return [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines()]


def wait_for_checkpoints(folders: list[Path], step: int, proc: subprocess.Popen, limit_s: float = 600) -> None:
    """Until every folder holds a complete checkpoint of `step` (its manifest written last)."""
    deadline = time.monotonic() + limit_s
    while not all((f / "checkpoints" / f"global_step_{step}" / "manifest.json").is_file() for f in folders):
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.5)


def test_a_diverging_job_ends_alone_and_a_killed_group_resumes(run_cache, tmp_path):
    """Three jobs on one base; the third's entropy coefficient is infinite, so its first loss is not
    finite: it ends alone at step 1, its weights untouched, its folder saying why, while the other
    two train on. The group is killed (SIGTERM) once step 2's checkpoints are whole, and relaunched:
    every job resumes at step 2 and the two live jobs finish step 4 with one row per step."""
    env = {**os.environ, "LORARL_CACHE": str(run_cache)}
    points = ("actor.entropy_coeff=0,0.001,inf", "trainer.total_steps=4", "trainer.save_freq=2", "trainer.test_freq=2")
    sweep = tmp_path / "sweep"
    jobs = [sweep / f"{i}_fsdp_qwen2_tiny_r16" for i in range(3)]
    proc = subprocess.Popen(
        command(sweep, *points), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for_checkpoints(jobs, 2, proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-4000:]
    ended = (jobs[2] / "ended.txt").read_text()
    assert ended.startswith("step 1: loss is -inf"), ended
    assert f"error: {ended.strip()}" in (jobs[2] / "grpo.log").read_text()
    assert "adapter 2 of 3 on one base" in out + err

    again = subprocess.run(command(sweep, *points), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-5000:]
    for job in jobs[:2]:
        log = (job / "grpo.log").read_text()
        assert "resumed from" in log and "at step 2" in log
        steps = [r["step"] for r in rows(job) if "reward/mean" in r]
        assert steps == [1, 2, 3, 4]  # the steps an uninterrupted run logs, each once
        assert all(
            r["sync/adapter_meaning"] == 1.0 and r["sync/adapter_match"] == 1.0 for r in rows(job) if "reward/mean" in r
        )
        assert (job / "final_adapter" / "adapter_model.safetensors").is_file()
    assert [r["step"] for r in rows(jobs[2]) if "reward/mean" in r] == []
    assert "ended before" in (jobs[2] / "grpo.log").read_text()
    summary = (sweep / "summary.md").read_text()
    assert "loss is -inf" in summary  # the summary says which job ended and why


def test_a_fault_in_one_jobs_adapter_stops_the_group_naming_the_job(run_cache, tmp_path):
    env = {**os.environ, "LORARL_CACHE": str(run_cache)}
    out = subprocess.run(
        command(tmp_path / "sweep", "trainer.sync_fault=null,scale_x2", "trainer.total_steps=2"),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-4000:]
    line = next(x for x in out.stderr.splitlines() if x.startswith("error:"))
    assert "job 1: " in line and "job 0" not in line, line
    assert "scaling" in line or "the delta vLLM applies is not the trainer's" in line, line
    assert "Traceback" not in out.stderr
    for job in ("0_fsdp_qwen2_tiny_r16", "1_fsdp_qwen2_tiny_r16"):
        assert "error: " in (tmp_path / "sweep" / job / "grpo.log").read_text()
