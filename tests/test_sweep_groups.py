"""Which sweep jobs share a base (lorarl.driver.groups): real configs composed from conf/."""

from __future__ import annotations

import pytest

from lorarl.config.compose import compose
from lorarl.driver.groups import PER_ADAPTER_KEYS, flat, plan_groups


def _runs(*jobs: list[str]):
    return [compose(["+backend=fsdp", *job]) for job in jobs]


def test_what_a_lora_sweep_varies_shares_one_base():
    jobs = [
        ["model.lora.rank=8", "actor.optim.lr=1e-3"],
        ["model.lora.rank=16", "actor.optim.lr=5e-4", "model.lora.alpha=8"],
        ["algorithm=dr_grpo", "trainer.seed=2"],
        ["algorithm=gspo", "rollout.temperature=0.6", "rollout.top_p=0.9"],
        ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.01", "actor.optim.warmup_steps=3", "actor.grad_clip=0.5"],
    ]
    plan = plan_groups(_runs(*jobs), [" ".join(j) for j in jobs], max_adapters=8)
    assert [g.jobs for g in plan.groups] == [[0, 1, 2, 3, 4]] and plan.groups[0].alone is None
    assert (
        plan.lines[1]
        == "job 1 (model.lora.rank=16 actor.optim.lr=5e-4 model.lora.alpha=8): group 0, adapter 1 of 5 on one base"
    )


def test_a_job_that_changes_what_is_shared_opens_a_group_and_says_which_key():
    jobs = [["model.lora.rank=8"], ["model.lora.rank=16"], ["data.max_response_length=12"], ["model=qwen3_tiny"]]
    plan = plan_groups(_runs(*jobs), [" ".join(j) for j in jobs], max_adapters=8)
    assert [g.jobs for g in plan.groups] == [[0, 1], [2], [3]]
    assert (
        plan.lines[2]
        == "job 2 (data.max_response_length=12): group 1, one adapter: data.max_response_length=12 where group 0 has 8"
    )
    assert "model.path=" in plan.lines[3] or "model.builder=" in plan.lines[3]


def test_runs_that_train_one_adapter_run_one_after_another_and_say_why():
    jobs = [["model.lora.merge=true"], ["model.lora.merge=true", "model.lora.rank=16"], ["trainer.off_policy_steps=1"]]
    plan = plan_groups(_runs(*jobs), ["a", "b", "c"], max_adapters=8)
    assert [(g.jobs, g.alone is not None) for g in plan.groups] == [([0, 1], True), ([2], True)]
    assert plan.lines[0].endswith("runs on its own: model.lora.merge=true serves merged weights, one policy per engine")


def test_groups_hold_at_most_max_adapters_and_a_failed_config_runs_alone():
    runs = _runs(*[[f"trainer.seed={s}"] for s in range(5)])
    plan = plan_groups([*runs, None], [str(i) for i in range(6)], max_adapters=2)
    assert [g.jobs for g in plan.groups] == [[0, 1], [2, 3], [4], [5]]
    assert plan.lines[2].endswith("group 0 is full (hydra.launcher.max_adapters)")
    assert plan.groups[-1].alone == "its config did not compose"


def test_every_per_adapter_key_is_a_key_of_the_config():
    keys = flat(compose(["+backend=fsdp"]))
    assert [k for k in PER_ADAPTER_KEYS if k not in keys] == []


@pytest.mark.parametrize("key", ["model.lora.rank", "actor.optim.lr", "trainer.seed"])
def test_the_plan_is_the_same_whatever_order_the_jobs_come_in(key):
    values = {"model.lora.rank": (8, 32), "actor.optim.lr": (1e-3, 1e-4), "trainer.seed": (1, 7)}[key]
    jobs = [[f"{key}={values[0]}"], ["data.max_response_length=12"], [f"{key}={values[1]}"]]
    plan = plan_groups(_runs(*jobs), ["a", "b", "c"], max_adapters=8)
    assert [g.jobs for g in plan.groups] == [[0, 2], [1]]
