"""A sweep group's update equals each job's update alone, given the same rollouts.

One FSDP engine holds three adapters over one tiny Qwen2 (float32, gloo, world 1), each with its
own LoRA shape, optimizer, schedule, clipping and loss (token-mean GRPO; Dr. GRPO with KL and
weight decay at its own temperature and warm-up; GSPO with an entropy bonus and a grad clip that
bites), all with token TIS. Beside it, one solo engine per job, built from that job's own config,
with the same starting factors. Every engine runs the worker's update on the same rows (its own
only, for a solo engine) for two steps of two mini-batches each, micro-batches cut by a token
budget, which mix adapters in the group. The expected side is each solo engine through PEFT's own
forward; nothing of the group's routing or per-adapter bookkeeping is on it.

Tolerances. The two sides differ only in float32 summation order (grouped GEMMs against PEFT's
linear; other micro-batch compositions, so sums and gradient accumulations add in other orders).
- The first gradient, from identical factors: 2e-5 of each tensor's largest value (measured
  <= 2e-6: ~1e-7 per op over a few hundred accumulated terms).
- After an optimizer step: Adam divides each gradient element by its own magnitude, so an element
  whose gradient is at the rounding noise's level moves by up to the learning rate on one side and
  not the other; later gradients then differ more (measured <= 4e-4 at lr 1e-2): 2e-3.
- Each adapter's total update (factors now minus at the start): 1e-4 of its norm (measured <= 2e-5),
  and its grad norm and learning rate: 1e-3.
Any wrong row, scaling, normaliser or optimizer setting moves these by orders more (the fault
tests below: a pooled normaliser changes every gradient by tens of percent).
Metrics that are means over micro-batches depend on how rows fall into micro-batches, in a run
alone too; they are compared where each side has one micro-batch per mini-batch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from lorarl.algorithms.ppo import AdapterPlan, Correction, needs_old_logp, ppo_update
from lorarl.config.compose import compose
from lorarl.contract.engine import build_batch
from lorarl.driver.jobs import sampling_of
from lorarl.driver.prepare import engine_spec, group_worker_spec, prepare_model

# What the micro-batches looked like (padding, tokens, count): the group's hold every job's rows.
SHAPE_KEYS = ("actor/padding_frac", "actor/micro_batch_tokens_max", "actor/micro_batches")
COMMON = [
    "+backend=fsdp",
    "model.dtype=float32",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "rollout.n=4",
    "actor.use_dynamic_bsz=true",
    "actor.ppo_max_token_len_per_gpu=70",
    "trainer.device=cpu",
]
JOBS = [
    ["model.lora.rank=8", "model.lora.alpha=16", "actor.optim.lr=1e-2", "trainer.seed=1",
     "algorithm.rollout_correction.rollout_is=token"],
    ["algorithm=dr_grpo", "model.lora.rank=4", "model.lora.alpha=32", "actor.optim.lr=5e-3",
     "actor.optim.weight_decay=0.1", "actor.optim.warmup_steps=3", "actor.use_kl_loss=true",
     "actor.kl_loss_coef=0.1", "rollout.temperature=0.7", "trainer.seed=2",
     "algorithm.rollout_correction.rollout_is=token"],
    ["algorithm=gspo", "model.lora.rank=16", "model.lora.alpha=8", "actor.entropy_coeff=0.01",
     "actor.grad_clip=0.05", "trainer.seed=3", "algorithm.rollout_correction.rollout_is=token"],
]  # fmt: skip


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(run_cache, process_group):
    mp = pytest.MonkeyPatch()
    mp.setenv("LORARL_CACHE", str(run_cache))
    out = [compose([*COMMON, *job]) for job in JOBS]
    for run in out:
        prepare_model(run)
    yield out
    mp.undo()


def _factors(engine, adapter: int, seed: int) -> None:
    """Seeded random A and B into an adapter (B non-zero: a fresh adapter's zero B gives A no gradient)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in engine.lora_parameters(adapter):
            _local(p).copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself (FSDP's shard of a world of one is the whole tensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _rows(job: int, pad: int):
    """A job's 16 rollouts: its prompts, responses, advantages and sampler log-probs."""
    gen = torch.Generator().manual_seed(10 + job)
    prompts = [
        torch.randint(3, 200, (int(n),), generator=gen).tolist() for n in torch.randint(3, 9, (16,), generator=gen)
    ]
    responses = [
        torch.randint(3, 200, (int(n),), generator=gen).tolist() for n in torch.randint(2, 12, (16,), generator=gen)
    ]
    adv = torch.randn(16, generator=gen).tolist()
    logps = [(-torch.rand(len(r), generator=gen) * 3).tolist() for r in responses]
    return prompts, responses, adv, logps


def _update(engine, spec, runs, rows, adapters, step: int, grads: list):
    """The worker's update (lorarl.workers.worker.Worker._update) on `rows`, recording the gradients each
    optimizer step is about to apply."""
    prompts, responses, adv, logps = rows
    batch = build_batch(prompts, responses, engine.pad_token_id, adv, engine.left_pad_prompts, logps, adapters)
    plans = [
        AdapterPlan(a.actor, sampling_of(run), Correction.of(run.algorithm.rollout_correction, "cpu"))
        for a, run in zip(spec.adapters, runs, strict=True)
    ]
    temperature = plans[0].sampling.temperature if len(plans) == 1 else [p.sampling.temperature for p in plans]
    if needs_old_logp(runs[0].actor, runs[0].data.train_batch_size, plans[0].correction):
        batch.old_logp = engine.log_probs(batch, temperature=temperature)
    if any(p.actor.use_kl_loss for p in plans):
        batch.ref_logp = engine.log_probs(batch, temperature=temperature, reference=True)
    step_fn = engine.optimizer_step

    def recorded(n, skip=()):
        grads.append([[_local(p.grad).clone() for p in params] for params in engine.trainable])
        return step_fn(n, skip)

    engine.optimizer_step = recorded
    try:
        return ppo_update(engine, batch, step, plans)
    finally:
        engine.optimizer_step = step_fn


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-12))


def _factors_now(engine, adapter: int) -> torch.Tensor:
    return torch.cat([_local(p).detach().flatten() for p in engine.lora_parameters(adapter)])


def _group_and_solos(runs):
    from lorarl.engines.fsdp import FSDPEngine

    group_spec = group_worker_spec(runs, [f"job {i}" for i in range(len(runs))], "cpu").engine
    group = FSDPEngine(group_spec, torch.device("cpu"))
    solos = [FSDPEngine(engine_spec(run, "cpu"), torch.device("cpu")) for run in runs]
    for i, solo in enumerate(solos):
        _factors(group, i, seed=100 + i)
        _factors(solo, 0, seed=100 + i)
    return group_spec, group, solos


def _compare(runs, group_spec, group, solos, steps=(1, 2, 3), all_metrics=False):
    """(what differs beyond its tolerance, the worst relative differences seen)."""
    rows = [_rows(i, group.pad_token_id) for i in range(len(runs))]
    merged = tuple(sum((list(r[k]) for r in rows), []) for k in range(4))
    adapters = [i for i in range(len(runs)) for _ in range(16)]
    start = [_factors_now(group, i) for i in range(len(runs))]
    bad, worst = [], {}

    def check(what: str, value: float, bound: float, where) -> None:
        worst[what] = max(worst.get(what, 0.0), value)
        if not value <= bound:
            bad.append((*where, what, value))

    for step in steps:
        group_grads: list = []
        stats = _update(group, group_spec, runs, merged, adapters, step, group_grads)
        for i, (run, solo) in enumerate(zip(runs, solos, strict=True)):
            solo_grads: list = []
            (want,) = _update(solo, engine_spec(run, "cpu"), [run], rows[i], None, step, solo_grads)
            got = stats[i]
            for mini, (g_all, s_all) in enumerate(zip(group_grads, solo_grads, strict=True)):
                first = step == steps[0] and mini == 0
                for g, s in zip(g_all[i], s_all[0], strict=True):
                    check(
                        "first gradient" if first else "gradient", _relative(g, s), 2e-5 if first else 2e-3, (step, i)
                    )
            check("grad norm", abs(got.grad_norm / want.grad_norm - 1), 1e-3, (step, i))
            check("lr", abs(got.lr / want.lr - 1), 1e-3, (step, i))
            moved_g, moved_s = _factors_now(group, i) - start[i], _factors_now(solo, 0) - start[i]
            check("update", float((moved_g - moved_s).norm() / moved_s.norm()), 1e-4, (step, i))
            if all_metrics:
                for key, value in want.metrics().items():
                    if key in SHAPE_KEYS:
                        continue
                    check(key, abs(got.metrics()[key] - value) / max(abs(value), 1e-6), 2e-5, (step, i))
    return bad, worst


def test_each_adapter_of_a_group_updates_as_its_job_alone(runs):
    bad, worst = _compare(runs, *_group_and_solos(runs), steps=(1, 2))
    assert bad == [], (bad[:5], worst)


def test_with_one_micro_batch_a_side_every_metric_is_the_jobs_alone(runs):
    """A token budget that holds a whole mini-batch: each side computes its metrics on the same rows."""
    wide = [dataclasses.replace(r, actor=dataclasses.replace(r.actor, ppo_max_token_len_per_gpu=4096)) for r in runs]
    bad, worst = _compare(wide, *_group_and_solos(wide), steps=(1,), all_metrics=True)
    assert bad == [], (bad[:5], worst)


def test_the_comparison_sees_a_loss_normalised_over_the_whole_group(runs, monkeypatch):
    """A group that divided each adapter's loss by every adapter's counts (one pooled normaliser)
    trains each adapter on a smaller gradient: the comparison above fails on it."""
    import lorarl.algorithms.ppo as ppo

    real = ppo.loss_denominators

    def pooled(engine, minibatch, plans):
        if len(plans) == 1:
            return real(engine, minibatch, plans)
        return [sum(real(engine, minibatch, plans))] * len(plans)

    monkeypatch.setattr(ppo, "loss_denominators", pooled)
    bad, _ = _compare(runs, *_group_and_solos(runs), steps=(1,))
    assert {what for *_, what, _ in bad} >= {"first gradient", "grad norm"}, bad[:5]


def test_the_comparison_sees_rows_trained_through_another_adapter(runs, monkeypatch):
    """Rows of job 1 routed through job 2's adapter (and back): the gradients are not the jobs'."""
    from lorarl.engines import adapter_routing

    real = adapter_routing.Segments.of.__func__

    def swapped(cls, adapter_of_row, names):
        names = list(names)
        if len(names) == 3:
            names[1], names[2] = names[2], names[1]
        return real(cls, adapter_of_row, names)

    monkeypatch.setattr(adapter_routing.Segments, "of", classmethod(swapped))
    bad, _ = _compare(runs, *_group_and_solos(runs), steps=(1,))
    assert {i for _, i, what, _ in bad if what == "first gradient"} >= {1, 2}, bad[:5]
