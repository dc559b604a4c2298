"""Which jobs of a sweep can train together as adapters of one base, and why the others cannot.

A LoRA sweep varies what the adapters and their losses see; the base model, the tokenizer, the
data, the batch shapes and the engines stay the same. Jobs whose configs agree on everything but
PER_ADAPTER_KEYS form one group: one vLLM engine with a LoRA slot per job, one training model with
an adapter per job (lorarl.engines.adapter_routing), one step for all. Everything else is shared,
so a job that differs in any other key (model, backend, lengths, batch sizes, world size, ...)
opens a group of its own, and the plan says which key and values made it so.

Some runs train one adapter by construction; their group's jobs run one after another, as the
basic launcher would, and the plan says why (`one_adapter_only`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lorarl.config.run import RunConfig

# Keys that may differ between the jobs of one group: each adapter's LoRA shape, optimizer and
# schedule, loss (clipping, aggregation, KL, entropy, the GRPO variants that change only the loss
# or the advantage), sampling temperature and nucleus, seed, name and the test fault aimed at it.
PER_ADAPTER_KEYS = (
    "model.lora.rank",
    "model.lora.alpha",
    "model.lora.target_modules",
    "actor.optim.lr",
    "actor.optim.weight_decay",
    "actor.optim.betas",
    "actor.optim.warmup_steps",
    "actor.grad_clip",
    "actor.clip_ratio",
    "actor.clip_ratio_low",
    "actor.clip_ratio_high",
    "actor.clip_ratio_c",
    "actor.entropy_coeff",
    "actor.use_kl_loss",
    "actor.kl_loss_coef",
    "actor.kl_loss_type",
    "actor.loss_agg_mode",
    "actor.loss_scale_factor",
    "actor.policy_loss",
    "algorithm.norm_adv_by_std_in_grpo",
    "rollout.temperature",
    "rollout.top_p",
    "trainer.seed",
    "trainer.experiment_name",
    "trainer.sync_fault",
)


def one_adapter_only(run: RunConfig) -> str | None:
    """Why a run cannot share its base with other adapters (None: it can)."""
    if run.backend.strategy != "fsdp2":
        return f"+backend={run.backend.strategy} trains one adapter per run"
    if run.trainer.placement != "colocated":
        return f"trainer.placement={run.trainer.placement} trains one adapter per run"
    if run.trainer.off_policy_steps:
        return "trainer.off_policy_steps>0 generates ahead for one adapter"
    if run.model.lora.merge:
        return "model.lora.merge=true serves merged weights, one policy per engine"
    if run.model.lora.target_parameters:
        return "expert LoRA (model.lora.target_parameters) trains one adapter per run"
    if run.algorithm.filter_groups.enable:
        return "algorithm.filter_groups (dynamic sampling) draws its rounds for one adapter"
    if run.rollout.tensor_model_parallel_size > 1:
        return "rollout.tensor_model_parallel_size>1 serves one adapter per run"
    return None


@dataclass
class Group:
    """Jobs (their indices in the sweep) that run as one: as adapters of one base, unless
    `alone` says why they run one after another."""

    jobs: list[int] = field(default_factory=list)
    alone: str | None = None


@dataclass
class Plan:
    groups: list[Group]
    lines: list[str]  # one per job: its group and why, for the console before anything starts


def flat(run: RunConfig) -> dict[str, Any]:
    """The run's values by dotted key."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = tuple(value) if isinstance(value, list) else value

    walk("", run.to_dict())
    return out


def shared_values(run: RunConfig) -> dict[str, Any]:
    """What must be equal for runs to share one base: every key but PER_ADAPTER_KEYS."""
    return {k: v for k, v in flat(run).items() if k not in PER_ADAPTER_KEYS}


def plan_groups(runs: list[RunConfig | None], labels: list[str], max_adapters: int) -> Plan:
    """Groups of the sweep's jobs (`runs[i]` None: the job's config failed, it runs alone to report
    it), at most `max_adapters` jobs each, and one line per job saying where it went and why."""
    groups: list[Group] = []
    shared: list[dict[str, Any]] = []
    reasons: dict[int, str] = {}
    for i, run in enumerate(runs):
        if run is None:
            groups.append(Group([i], alone="its config did not compose"))
            shared.append({})
            continue
        mine = shared_values(run)
        alone = one_adapter_only(run)
        fits = [
            g
            for g, values in zip(groups, shared, strict=True)
            if values == mine and g.alone == alone and (alone is not None or len(g.jobs) < max_adapters)
        ]
        if fits:
            fits[0].jobs.append(i)
            continue
        if groups and alone is None:
            open_groups = [(n, s) for n, (g, s) in enumerate(zip(groups, shared, strict=True)) if g.alone is None]
            reasons[i] = _why_apart(mine, open_groups)
        groups.append(Group([i], alone=alone))
        shared.append(mine)
    lines = []
    for number, group in enumerate(groups):
        for position, i in enumerate(group.jobs):
            head = f"job {i} ({labels[i]}): group {number}"
            if group.alone is not None:
                lines.append(f"{head}, runs on its own: {group.alone}")
            elif len(group.jobs) == 1:
                lines.append(f"{head}, one adapter" + (f": {reasons[i]}" if i in reasons else ""))
            else:
                why = f"; {reasons[i]}" if position == 0 and i in reasons else ""
                lines.append(f"{head}, adapter {position} of {len(group.jobs)} on one base{why}")
    return Plan(groups, lines)


def _why_apart(mine: dict[str, Any], others: list[tuple[int, dict[str, Any]]]) -> str:
    """Where this job differs from the nearest group before it (number, shared values): up to two
    shared keys with both values, or that group's size limit."""
    best: list[str] | None = None
    for number, values in others:
        keys = sorted(k for k in mine.keys() | values.keys() if mine.get(k) != values.get(k))
        if best is None or len(keys) < len(best):
            best, near, near_number = keys, values, number
    if not best:
        return f"group {near_number} is full (hydra.launcher.max_adapters)"
    said = "; ".join(f"{k}={_show(mine.get(k))} where group {near_number} has {_show(near.get(k))}" for k in best[:2])
    return said + (f" (and {len(best) - 2} more keys)" if len(best) > 2 else "")


def _show(value: Any) -> str:
    return "null" if value is None else str(list(value) if isinstance(value, tuple) else value)
