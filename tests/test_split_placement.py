"""trainer.placement=split: its keys and what it refuses, one real off-policy run (a training worker
and a vLLM rollout worker as separate Ray actors, FSDP2 over gloo, vLLM's CPU build) whose sync
checks pass every step, and the same run with the send to the rollout dropped, which must stop
at the first sync."""

from __future__ import annotations

import json

import pytest

from lorarl.config.compose import compose
from lorarl.driver.base_plan import plan_base
from lorarl.driver.prepare import rollout_engines
from lorarl.errors import ConfigError

SPLIT = "trainer.placement=split"


def test_default_is_colocated_with_no_rollout_workers_of_their_own():
    run = compose(["+backend=fsdp"])
    assert run.trainer.placement == "colocated" and run.rollout.n_workers is None
    assert rollout_engines(run) == 1
    split = compose(["+backend=fsdp", SPLIT, "rollout.n_workers=2", "trainer.n_gpus_per_node=2"])
    assert rollout_engines(split) == 2  # one vLLM engine per rollout worker, not per training worker
    assert rollout_engines(compose(["+backend=fsdp", SPLIT])) == 1  # null: one


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["trainer.placement=apart"], "trainer.placement='apart'"),
        (["rollout.n_workers=2"], "rollout.n_workers=2"),  # colocated: vLLM is in every training worker
        ([SPLIT, "rollout.n_workers=0"], "rollout.n_workers=0"),
        ([SPLIT, "model.lora.merge=true"], "model.lora.merge=true"),
        ([SPLIT, "backend.share_base=true"], "backend.share_base=true"),
        (
            [SPLIT, "rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"],
            "rollout.tensor_model_parallel_size",
        ),
        ([SPLIT, "trainer.nnodes=2"], "trainer.nnodes=1"),
        ([SPLIT, "rollout.load_format=dummy"], "rollout.load_format"),
        ([SPLIT, "rollout.free_cache_engine=true"], "rollout.free_cache_engine"),
        (["trainer.sync_fault=drop_send"], "trainer.sync_fault=drop_send"),
        (["trainer.sync_fault=stale_send"], "trainer.sync_fault=stale_send"),
    ],
)
def test_what_split_placement_cannot_do_is_refused_by_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        compose(["+backend=fsdp", *overrides])
    assert key in str(err.value) and "\n" not in str(err.value)


def test_megatron_is_refused_on_split_placement():
    with pytest.raises(ConfigError, match="trainer.placement=split runs with \\+backend=fsdp only"):
        compose(["+backend=megatron", SPLIT])


def test_a_shared_base_falls_back_to_two_copies_and_says_why():
    run = compose(["+backend=fsdp", SPLIT, "backend.share_base=auto"])
    plan = plan_base(run, "cuda", "bfloat16", moe=False)
    assert not plan.shared and "trainer.placement=split" in str(plan)


def _rows(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


SMALL = (
    "trainer.device=cpu", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2",
    "actor.ppo_micro_batch_size_per_gpu=8", "trainer.off_policy_steps=1", SPLIT, "trainer.check_sync=true",
    "trainer.check_sync_probe_freq=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
)  # fmt: skip


@pytest.mark.slow
def test_split_off_policy_run_checks_every_sync_and_stays_one_version_behind(run_cache, tmp_path):
    """Three steps: the start-up says what runs where, every batch after the first was sampled
    one adapter version behind the update (0, 1, 1), and every sync's transport and semantic
    checks and the probe pass in the rollout worker at the trainer's version."""
    from tests.test_grpo_e2e import grpo

    run = tmp_path / "run"
    out = grpo(run, run_cache, *SMALL, "trainer.total_steps=3")
    assert out.returncode == 0, out.stderr[-5000:]
    assert "workers: split placement: training engine on 1 worker (CPU), vLLM on 1 rollout worker (CPU)" in out.stdout
    assert "trainer.placement=split puts vLLM on devices of its own" in out.stdout  # the base plan's reason
    steps = [r for r in _rows(run) if "reward/mean" in r]
    assert [r["rollout/staleness"] for r in steps] == [0, 1, 1]
    for r in steps:
        assert r["sync/adapter_match"] == 1.0 and r["sync/adapter_meaning"] == 1.0, r["step"]
        assert r["sync/logprob_diff_max"] < 1e-3, r["step"]  # fp32 on both sides
        assert r["sync/logprob_ref_diff_mean"] > 10 * r["sync/logprob_diff_mean"], r["step"]  # the adapter is on
        assert "rollout_corr/rollout_is_mean" in r and "timing/old_logp" in r
    assert (run / "final_adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, line",
    [
        # Nothing arrives, the self-test's adapter first: vLLM holds none.
        (
            "drop_send",
            "error: rollout worker 0, the first sync's self-test adapter: vLLM holds no adapter after the sync",
        ),
        # Only the first sync's adapter arrives: after step 1's update vLLM still serves version 0.
        ("stale_send", "error: step 1: rollout worker 0, adapter version 1: layer 0 "),
    ],
)
def test_a_rollout_that_never_receives_the_adapter_stops_the_run(run_cache, tmp_path, fault, line):
    """The trainer's bundles reach the rollout worker without the payload (every time, or after
    the first sync). The semantic check's expected side, computed from the trainer's parameters,
    still arrives, and what vLLM holds does not match it: one line, exit code 2, no step logged."""
    from tests.test_grpo_e2e import grpo

    run = tmp_path / "run"
    out = grpo(run, run_cache, *SMALL, "trainer.total_steps=2", f"trainer.sync_fault={fault}")
    assert out.returncode == 2, out.stderr[-5000:]
    errors = [x for x in (out.stdout + out.stderr).splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(line), errors
    if fault == "stale_send":
        assert "the delta vLLM applies is not the trainer's" in errors[0]
    assert not [r for r in _rows(run) if "reward/mean" in r]
