"""Rollout tensor parallelism on CPU: two workers share one vLLM engine (TP=2), end to end.

vLLM's CPU build runs an in-process engine per worker with `external_launcher` over the
workers' gloo group; each worker holds half of every attention and MLP projection (and of the
adapter's slices). The run must train and pass both sync checks on both ranks: the exact
fingerprint compares each rank's slice of the adapter, the probe compares log-probs that only
come out right when both ranks send the engine the same requests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_reliability import grpo, steps_on_disk

pytestmark = pytest.mark.slow


def cpu_shm_names() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("*cpushm*")}


def test_two_workers_share_one_engine_with_tensor_parallel_2(run_cache, tmp_path):
    before = cpu_shm_names()
    run = tmp_path / "run"
    out = grpo(
        run,
        run_cache,
        "trainer.n_gpus_per_node=2",
        "rollout.tensor_model_parallel_size=2",
        "actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.total_steps=2",
        "trainer.save_freq=2",
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in [rows[0], *steps]:
        prefix = "init/sync/" if r["step"] == 0 else "sync/"
        # Exact bytes per rank; the semantic check adds both ranks' slices of each module.
        assert r[prefix + "adapter_match"] == 1.0 and r[prefix + "adapter_meaning"] == 1.0, r
    # float32 on both sides: a probe sequence that the two ranks disagreed on read 6.6 here.
    assert all(r["sync/logprob_diff_max"] < 1e-3 for r in steps), [r["sync/logprob_diff_max"] for r in steps]
    assert steps_on_disk(run / "checkpoints") == [2]
    # vLLM's CPU tensor-parallel shared memory leaves no names behind (a second run failed on them).
    assert cpu_shm_names() <= before


def test_merged_sync_over_tensor_parallel_2_passes_the_merged_semantic_check(run_cache, tmp_path):
    """Merged sync into a TP=2 engine: each rank reads its half of every served weight (q/k/v and
    gate/up rows, o_proj/down_proj columns) and the ranks add them up; the merged check passes on
    both ranks, and a missing v_proj delta fails the first sync naming it."""
    run = tmp_path / "run"
    common = (
        "trainer.n_gpus_per_node=2",
        "rollout.tensor_model_parallel_size=2",
        "actor.ppo_micro_batch_size_per_gpu=4",
    )
    out = grpo(run, run_cache, *common, "model.lora.merge=true", "trainer.total_steps=2")
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in [rows[0], *steps]:
        prefix = "init/sync/" if r["step"] == 0 else "sync/"
        assert r[prefix + "weights_match"] == 1.0 and r[prefix + "adapter_meaning"] == 1.0, r
    bad = grpo(tmp_path / "bad", run_cache, *common, "model.lora.merge=true", "+trainer.sync_fault=missing_module")
    assert bad.returncode == 2, bad.stderr[-4000:]
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert errors and "layer 0 self_attn.v_proj" in errors[-1] and "base + delta" in errors[-1], bad.stderr[-3000:]
