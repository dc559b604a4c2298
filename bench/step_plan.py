"""The GPU step bench's plan: which runs, with which algorithm, in which order.

A comparison is a `Pair`: one shape, KL off or on, one rollout correction, the same for lorarl
and TRL, so a ratio never sets one algorithm against another. Each pair repeats as alternating
runs (lorarl, TRL, lorarl, TRL, ...) so drift within a lease (clocks, host load, the order
itself) falls on both systems alike and shows in the spread.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

# The bench's correction names; lorarl_correction_overrides gives lorarl's keys for each and TRL's
# importance-sampling modes map onto them one to one (same ratio, same truncation or mask; lorarl's
# thresholds become TRL's clip_max and clip_min).
CORRECTIONS = ("none", "token_tis", "seq_tis", "token_mask", "seq_mask")
TRL_IS_MODE = {
    "token_tis": "token_truncate",
    "seq_tis": "sequence_truncate",
    "token_mask": "token_mask",
    "seq_mask": "sequence_mask",
}
BACKENDS = ("fsdp", "megatron")
MODES = ("adapter", "merged")
SYSTEMS = ("lorarl", "trl")


@dataclass(frozen=True)
class Shape:
    """How one model size runs: the settings of ../shared/tools/gpu-vllm/step.sh."""

    model: str | None  # key of bench.common.SHAPES; None: the embedded tiny model
    preset: str  # conf/model/<preset>.yaml: its micro-batching and checkpointing are what runs
    gpu_memory_utilization: float | None
    # Wall seconds of one run (start-up included) for the budget, from the 2026-12-02 leases.
    lorarl_wall_s: float
    trl_wall_s: float
    # trainer.check_sync_tolerance (None: the project's default checks by precision).
    check_sync_tolerance: float | None = None


SHAPE_RUNS = {
    "0.5b": Shape("qwen2.5-0.5b", "qwen2_5_0_5b_instruct", 0.4, lorarl_wall_s=125, trl_wall_s=60),
    "7b": Shape("qwen2.5-7b", "qwen2_5_7b_instruct", 0.35, lorarl_wall_s=250, trl_wall_s=135),
    "tiny": Shape(None, "qwen2_tiny", None, lorarl_wall_s=60, trl_wall_s=40),
}


@dataclass(frozen=True)
class Work:
    prompts: int
    n: int
    tokens: int
    steps: int


GPU_WORK = Work(prompts=32, n=8, tokens=128, steps=6)
SMOKE_WORK = Work(prompts=4, n=4, tokens=16, steps=4)


@dataclass(frozen=True)
class Pair:
    """The algorithm both systems run: shape, KL loss, rollout correction."""

    shape: str
    kl: bool
    correction: str

    @property
    def name(self) -> str:
        return f"{self.shape}-kl{'on' if self.kl else 'off'}-{self.correction}"


@dataclass(frozen=True)
class Arm:
    """One way of running a pair: lorarl on a backend and sync mode, or TRL (always merged)."""

    system: str
    backend: str | None = None  # lorarl: fsdp | megatron
    mode: str = "merged"  # lorarl: adapter | merged
    # lorarl: a named setting of how it runs (never what it computes: the pair fixes that), an
    # arm of its own beside the preset's in every repeat (`--variant`).
    variant: str | None = None
    overrides: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        if self.system == "trl":
            return "trl"
        return f"lorarl-{self.backend}-{self.mode}" + (f"-{self.variant}" if self.variant else "")


TRL = Arm("trl")


@dataclass(frozen=True)
class Run:
    arm: Arm
    pair: Pair
    repeat: int  # 1-based within the pair

    @property
    def name(self) -> str:
        return f"{self.arm.name}-{self.pair.name}-r{self.repeat}"


def lorarl_arms(backends: list[str], modes: list[str], variants: dict[str, tuple[str, ...]] | None = None) -> list[Arm]:
    """lorarl's arms, each followed by its variants; Megatron syncs adapters only, so it takes
    no merged arm."""
    return [
        Arm("lorarl", b, m, name, overrides)
        for b in backends
        for m in modes
        if not (b == "megatron" and m == "merged")
        for name, overrides in [(None, ()), *(variants or {}).items()]
    ]


# What a variant may set: how lorarl runs. The pair's algorithm (loss, KL, correction, sampling,
# LoRA, data, steps) is the same for every arm, or the ratio to TRL would compare two algorithms.
VARIANT_PREFIXES = ("backend.", "rollout.", "trainer.", "model.enable_gradient_checkpointing")
VARIANT_KEYS = ("actor.ppo_micro_batch_size_per_gpu", "actor.ppo_max_token_len_per_gpu", "actor.use_dynamic_bsz")
NOT_VARIANT_KEYS = ("rollout.n", "rollout.temperature", "rollout.top_p", "rollout.top_k", "trainer.total_steps")


def override_key(override: str) -> str:
    """The config key a Hydra override sets: `+a.b=1`, `~a.b`, `a.b=1` -> `a.b`."""
    return override.partition("=")[0].lstrip("+~")


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    """`NAME:KEY=VALUE [KEY=VALUE ...]` -> (NAME, overrides); ValueError naming what is wrong."""
    name, _, rest = text.partition(":")
    overrides = tuple(rest.split())
    if not re.fullmatch(r"[a-z0-9_]+", name) or not overrides:
        raise ValueError(f"--variant {text!r}: use NAME:KEY=VALUE [KEY=VALUE ...], NAME of a-z, 0-9 and _")
    for o in overrides:
        key = override_key(o)
        allowed = (key.startswith(VARIANT_PREFIXES) or key in VARIANT_KEYS) and key not in NOT_VARIANT_KEYS
        if "=" not in o or not allowed:
            settable = [p + "*" if p.endswith(".") else p for p in VARIANT_PREFIXES] + list(VARIANT_KEYS)
            raise ValueError(
                f"--variant {name}: {o!r} is not a setting of how lorarl runs; a variant may set "
                f"{', '.join(settable)}, but not {', '.join(NOT_VARIANT_KEYS)}"
            )
    return name, overrides


def plan(pairs: list[Pair], arms: list[Arm], repeats: int, done: dict[str, int] | None = None) -> list[Run]:
    """Every run, pair by pair in the order given, each repeat the arms in order (lorarl's, then
    TRL): L, T, L, T, ... `done[run name without the repeat]` repeats already measured (an
    earlier command of the same lease) shift an arm's repeat numbers, so a pair can grow over
    several commands, also one system at a time."""
    done = done or {}
    return [
        Run(arm, pair, done.get(f"{arm.name}-{pair.name}", 0) + r)
        for pair in pairs
        for r in range(1, repeats + 1)
        for arm in arms
    ]


def select(runs: list[Run], only: str | None) -> list[Run]:
    if not only:
        return runs
    patterns = [p for p in only.split(",") if p]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(r.name, p) for r in runs)]
    if unmatched:
        raise SystemExit(
            f"--only: {', '.join(unmatched)} matches no planned run; planned: {', '.join(r.name for r in runs)}"
        )
    return [r for r in runs if any(fnmatch.fnmatchcase(r.name, p) for p in patterns)]


def estimate_wall_s(run: Run, walls: dict[tuple[str, str], float]) -> float:
    """A run's expected wall seconds: the last one of its arm and shape in this command, else the table."""
    shape = SHAPE_RUNS[run.pair.shape]
    default = shape.trl_wall_s if run.arm.system == "trl" else shape.lorarl_wall_s
    return walls.get((run.arm.name, run.pair.shape), default)


def walls_of(rows: list[dict]) -> dict[tuple[str, str], float]:
    """Per (arm, shape), the wall seconds of the last run that finished among `rows` (step_compare
    rows), without its model build: what estimate_wall_s expects of the next one."""
    walls = {}
    for row in sorted(rows, key=lambda r: r.get("order") or 0):
        if row.get("wall_s") and not row.get("error"):
            walls[(row["arm"], row["shape"])] = row["wall_s"] - (row.get("model_build_s") or 0.0)
    return walls


def repeat_groups(runs: list[Run]) -> list[list[Run]]:
    """The runs cut into (pair, repeat) groups, in order: the budget starts a group only whole."""
    groups: list[list[Run]] = []
    for run in runs:
        if groups and (groups[-1][0].pair, groups[-1][0].repeat) == (run.pair, run.repeat):
            groups[-1].append(run)
        else:
            groups.append([run])
    return groups


def lorarl_correction_overrides(correction: str) -> list[str]:
    """lorarl's `algorithm.rollout_correction` keys for a bench correction: *_tis are truncated
    weights (rollout_is); *_mask are k1 rejection (rollout_rs) with ratios kept in [1/t, t]."""
    rc = "algorithm.rollout_correction."
    rollout_is = {"token_tis": "token", "seq_tis": "sequence"}.get(correction, "null")
    rollout_rs = {"token_mask": "token_k1", "seq_mask": "seq_sum_k1"}.get(correction, "null")
    out = [f"{rc}rollout_is={rollout_is}", f"{rc}rollout_rs={rollout_rs}"]
    if rollout_rs != "null":
        out.append(f"{rc}rollout_rs_threshold=2.0")
    return out


def mask_bounds(rollout_rs_threshold: str) -> tuple[float, float]:
    """[lower, upper] on pi_trainer / pi_rollout from a k1 threshold, which bounds the inverse
    ratio pi_rollout / pi_trainer: `upper` (lower = 1/upper) or `lower_upper`."""
    parts = [float(x) for x in str(rollout_rs_threshold).split("_")]
    lower, upper = (1.0 / parts[0], parts[0]) if len(parts) == 1 else parts
    return 1.0 / upper, 1.0 / lower


def trl_correction_args(correction: str, rc) -> list[str]:
    """TRL worker options for lorarl's correction config `rc` (lorarl.rollout_correction): *_tis
    truncates above rollout_is_threshold only; *_mask keeps ratios inside rollout_rs_threshold's bounds."""
    if correction == "none":
        return ["--vllm-is-correction", "off"]
    args = ["--vllm-is-correction", "on", "--vllm-is-mode", TRL_IS_MODE[correction]]
    if correction.endswith("_mask"):
        lower, upper = mask_bounds(rc.rollout_rs_threshold)
        return [*args, "--vllm-is-clip-max", str(upper), "--vllm-is-clip-min", str(lower)]
    return [*args, "--vllm-is-clip-max", str(rc.rollout_is_threshold)]
