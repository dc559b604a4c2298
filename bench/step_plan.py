"""The GPU step bench's plan: which runs, with which algorithm, in which order.

A comparison is a `Pair`: one shape, KL off or on, one rollout correction, the same for lorarl
and TRL, so a ratio never sets one algorithm against another. Each pair repeats as alternating
runs (lorarl, TRL, lorarl, TRL, ...) so drift within a lease (clocks, host load, the order
itself) falls on both systems alike and shows in the spread.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

# lorarl's `algorithm.rollout_correction.mode` names (null is "none"); TRL's importance-sampling
# modes map onto them one to one (same ratio, same truncation or mask; lorarl's threshold and
# lower bound become TRL's clip_max and clip_min).
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

    @property
    def name(self) -> str:
        return "trl" if self.system == "trl" else f"lorarl-{self.backend}-{self.mode}"


TRL = Arm("trl")


@dataclass(frozen=True)
class Run:
    arm: Arm
    pair: Pair
    repeat: int  # 1-based within the pair

    @property
    def name(self) -> str:
        return f"{self.arm.name}-{self.pair.name}-r{self.repeat}"


def lorarl_arms(backends: list[str], modes: list[str]) -> list[Arm]:
    """lorarl's arms; Megatron syncs adapters only, so it takes no merged arm."""
    return [Arm("lorarl", b, m) for b in backends for m in modes if not (b == "megatron" and m == "merged")]


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


def repeat_groups(runs: list[Run]) -> list[list[Run]]:
    """The runs cut into (pair, repeat) groups, in order: the budget starts a group only whole."""
    groups: list[list[Run]] = []
    for run in runs:
        if groups and (groups[-1][0].pair, groups[-1][0].repeat) == (run.pair, run.repeat):
            groups[-1].append(run)
        else:
            groups.append([run])
    return groups


def trl_correction_args(correction: str, threshold: float, lower: float | None) -> list[str]:
    """TRL worker options for lorarl's correction (lorarl.algorithms.rollout_correction): *_tis
    truncates above the threshold only; *_mask keeps ratios in [lower (1 / threshold), threshold]."""
    if correction == "none":
        return ["--vllm-is-correction", "off"]
    args = [
        "--vllm-is-correction",
        "on",
        "--vllm-is-mode",
        TRL_IS_MODE[correction],
        "--vllm-is-clip-max",
        str(threshold),
    ]
    if correction.endswith("_mask"):
        args += ["--vllm-is-clip-min", str(1.0 / threshold if lower is None else lower)]
    return args
