"""trainer.off_policy_steps: its checks, the rollout correction it turns on, the staleness bound,
and one short real run (Ray workers, FSDP2 over gloo, vLLM CPU) stopped and resumed."""

from __future__ import annotations

import json
import shutil

import pytest

from lorarl.algorithms.ppo import Correction, needs_old_logp
from lorarl.algorithms.rollout_correction import resolve_is_level
from lorarl.config.compose import compose
from lorarl.driver.off_policy import overlap_plan, staleness
from lorarl.errors import ConfigError, TrainingError

RC = "algorithm.rollout_correction"


@pytest.mark.parametrize("value", [-1, 2, 3])
def test_off_policy_steps_other_than_0_or_1_are_refused(value):
    with pytest.raises(ConfigError, match=f"trainer.off_policy_steps={value}"):
        compose(["+backend=fsdp", f"trainer.off_policy_steps={value}"])


def test_off_policy_with_dynamic_sampling_is_refused():
    with pytest.raises(ConfigError, match="algorithm.filter_groups.enable"):
        compose(["+backend=fsdp", "algorithm=dapo", "trainer.off_policy_steps=1"])


def test_default_is_on_policy():
    assert compose(["+backend=fsdp"]).trainer.off_policy_steps == 0


def test_rollout_correction_follows_the_setting_and_an_explicit_choice_wins():
    # auto: token weights off-policy on any device; on CPU on-policy, none (the default run unchanged)
    assert resolve_is_level("auto", "cpu", bypass_mode=False, off_policy=True) == "token"
    assert resolve_is_level("auto", "cpu", bypass_mode=False, off_policy=False) is None
    assert resolve_is_level("auto", "cpu", bypass_mode=True, off_policy=True) is None
    assert resolve_is_level(None, "cpu", bypass_mode=False, off_policy=True) is None
    assert resolve_is_level("sequence", "cpu", bypass_mode=False, off_policy=True) == "sequence"
    run = compose(["+backend=fsdp", "trainer.off_policy_steps=1"])
    assert Correction.of(run.algorithm.rollout_correction, "cpu", off_policy=True).level == "token"
    explicit = compose(["+backend=fsdp", "trainer.off_policy_steps=1", f"{RC}.rollout_is=null"])
    assert Correction.of(explicit.algorithm.rollout_correction, "cpu", off_policy=True).level is None


def test_a_stale_batch_gets_old_log_probs_of_the_current_adapter():
    """One epoch over one mini-batch is on-policy only when the batch was sampled by the adapter
    the update starts from; a batch one version behind needs pi_old from its own pass."""
    run = compose(["+backend=fsdp"])
    a, size = run.actor, run.data.train_batch_size
    plain = Correction.of(run.algorithm.rollout_correction, "cpu")
    assert not needs_old_logp(a, size, plain)
    assert needs_old_logp(a, size, plain, stale_rollout=True)
    bypass = compose(["+backend=fsdp", f"{RC}.bypass_mode=true"]).algorithm.rollout_correction
    assert not needs_old_logp(a, size, Correction.of(bypass, "cpu", off_policy=True), stale_rollout=True)


def test_staleness_is_bounded():
    assert staleness(step=1, version=0, bound=1) == 0
    assert staleness(step=5, version=3, bound=1) == 1
    with pytest.raises(TrainingError, match="2 behind"):
        staleness(step=5, version=2, bound=1)
    with pytest.raises(TrainingError, match="allows 0"):
        staleness(step=5, version=3, bound=0)
    with pytest.raises(TrainingError, match="-1 behind"):  # sampled by an adapter newer than the update's
        staleness(step=5, version=5, bound=1)


def test_the_overlap_waits_for_an_awake_rollout_and_starts_when_a_measured_update_wakes_it():
    # At start-up the estimate may have vLLM sleep (on an H100 the 7B update was estimated at
    # 35.1 GiB beside 36.3 free and measured at 27.2): on-policy, said once.
    overlap, line = overlap_plan(1, rollout_sleeps=True, step=0)
    assert not overlap and "vLLM sleeps during the update" in line and "on-policy while it sleeps" in line
    # The sync of step 1 changes the plan to awake: step 2 generates first, step 3's batch beside step 2's update.
    overlap, line = overlap_plan(1, rollout_sleeps=False, step=1)
    assert overlap and "vLLM stays awake from step 2, so step 3's batch is generated during step 2's update" in line


@pytest.mark.slow
def test_off_policy_run_is_one_version_behind_checks_its_syncs_and_resumes(run_cache, tmp_path):
    """Three off-policy steps, checkpoint at step 2, stopped before step 3's: every batch after the
    first is one adapter version behind, the sync checks pass each step (vLLM and the trainer at
    the same version), and the relaunch says it generates the in-flight batch again, logs step 3
    at staleness 0, step 4 at 1, and rows continue step for step."""
    from tests.test_grpo_e2e import grpo

    small = (
        "trainer.device=cpu", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=2",
        "actor.ppo_micro_batch_size_per_gpu=8", "trainer.save_freq=2", "trainer.off_policy_steps=1",
        "trainer.check_sync=true", "trainer.check_sync_probe_freq=1",
    )  # fmt: skip
    run = tmp_path / "run"
    first = grpo(run, run_cache, *small, "trainer.total_steps=3")
    assert first.returncode == 0, first.stderr[-5000:]

    def rows() -> list[dict]:
        return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]

    steps = [r for r in rows() if "reward/mean" in r]
    assert [r["rollout/staleness"] for r in steps] == [0, 1, 1]
    # Steps 1 and 2 generate the next batch beside their update; the last has none to generate.
    assert ["timing/gen_wait" in r for r in steps] == [True, True, False]
    for r in steps:
        assert r["sync/adapter_match"] == 1.0 and r["sync/adapter_meaning"] == 1.0, r["step"]
        assert r["sync/logprob_diff_max"] < 1e-3, r["step"]
        assert "timing/old_logp" in r and "rollout_corr/rollout_is_mean" in r  # pi_old recomputed, weights on

    shutil.rmtree(run / "checkpoints" / "global_step_3")  # stopped before its checkpoint
    again = grpo(run, run_cache, *small, "trainer.total_steps=4")
    assert again.returncode == 0, again.stderr[-5000:]
    assert "off-policy resume: the batch that was in flight at the checkpoint is generated again" in again.stdout
    steps = [r for r in rows() if "reward/mean" in r]
    assert [r["step"] for r in rows()] == [0, 0, 1, 2, 3, 4]  # start-up, validation before training, steps
    assert [r["rollout/staleness"] for r in steps] == [0, 1, 0, 1]
    assert max(r["rollout/staleness"] for r in steps) <= 1
