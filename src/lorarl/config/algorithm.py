"""The algorithm group's schemas (conf/algorithm/), with their own checks; like lorarl.config.schema,
types and docs only. Also the parser of `rollout_correction.rollout_rs` and its thresholds, which
the check and lorarl.algorithms.rollout_correction share."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from lorarl.errors import ConfigError, check, one_of

IS_LEVELS = ("token", "sequence")
# auto: token on CUDA (bf16 sampler against the trainer) or off-policy (trainer.off_policy_steps > 0),
# off on CPU on-policy (both float32, weights ~1).
IS_CHOICES = (None, "auto", *IS_LEVELS)
RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip
_KEY = "algorithm.rollout_correction"


@dataclass(frozen=True)
class Rejection:
    """One rejection criterion: a token or sequence is kept while its statistic stays in bounds.
    k1 options bound log(pi_rollout / pi_trainer) by [log lower, log upper]; k2 and k3 options
    bound the divergence estimate by `upper` alone."""

    option: str
    upper: float
    lower: float | None = None


def parse_rejection(options: str | None, thresholds: str | None) -> tuple[Rejection, ...]:
    """`rollout_rs` ("seq_mean_k1" or "token_k1,seq_max_k3") and `rollout_rs_threshold` (one value
    shared by every option, or one per option; a k1 option takes "upper" (lower = 1 / upper) or
    "lower_upper") as criteria. ConfigError names the key on any bad value."""
    if options is None:
        return ()
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    bad = [o for o in names if o not in RS_OPTIONS]
    if not names or bad:
        raise ConfigError(f"{_KEY}.rollout_rs={options!r}: unknown option(s) {bad}; use null or a comma-separated list of {', '.join(RS_OPTIONS)}")  # fmt: skip
    if thresholds is None:
        raise ConfigError(f"{_KEY}.rollout_rs={options!r} needs {_KEY}.rollout_rs_threshold (e.g. 1.001 for seq_mean_k1)")  # fmt: skip
    specs = [s.strip() for s in str(thresholds).split(",") if s.strip()]
    if len(specs) == 1:
        specs = specs * len(names)
    if len(specs) != len(names):
        raise ConfigError(f"{_KEY}.rollout_rs_threshold={thresholds!r}: give one value for all {len(names)} options or one each")  # fmt: skip
    return tuple(_rule(name, spec) for name, spec in zip(names, specs))


def _rule(name: str, spec: str) -> Rejection:
    where = f"{_KEY}.rollout_rs_threshold={spec!r} ({name})"
    if "_" in spec and not name.endswith("k1"):
        raise ConfigError(f"{where}: only k1 options take lower_upper; give one upper bound")
    try:
        parts = [float(x) for x in spec.split("_", 1)]
    except ValueError:
        raise ConfigError(f"{where} is not a number (k1 options: upper or lower_upper)") from None
    if any(x <= 0 for x in parts) or (len(parts) == 2 and parts[0] > parts[1]):
        raise ConfigError(f"{where}: bounds must be > 0 and lower <= upper")
    if not name.endswith("k1"):
        return Rejection(name, parts[0])
    lower, upper = parts if len(parts) == 2 else (1.0 / parts[0], parts[0])
    return Rejection(name, upper, lower)


@dataclass
class RolloutCorrectionConfig:
    """verl's keys and meanings (lorarl.algorithms.rollout_correction; formulas in docs/algorithms.md)."""

    # Truncated importance weights min(pi_trainer / pi_rollout, rollout_is_threshold) on the loss:
    # token | sequence (the product over the response) | null | auto (token on CUDA, where they
    # cost no extra pass on the on-policy path; null on CPU, where both sides are float32).
    rollout_is: str | None = MISSING
    rollout_is_threshold: float = MISSING
    # Divide the weights by their batch mean (over tokens, or sequences at sequence level).
    rollout_is_batch_normalize: bool = MISSING
    # Rejection: comma-separated token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3, seq_max_k2|k3;
    # null: none. Rejected tokens leave the loss and its normalisation.
    rollout_rs: str | None = MISSING
    # One bound for all options or one per option; k1: "upper" (lower = 1 / upper) or
    # "lower_upper", bounds on pi_rollout / pi_trainer (per token, or the sequence's sum / mean).
    rollout_rs_threshold: str | None = MISSING
    # true: the sampler's log-probs are pi_old (the PPO ratio is pi / pi_rollout); no weights.
    bypass_mode: bool = MISSING

    def check(self) -> None:
        one_of(f"{_KEY}.rollout_is", self.rollout_is, IS_CHOICES)
        check(
            self.rollout_is_threshold > 1.0,
            f"{_KEY}.rollout_is_threshold={self.rollout_is_threshold} must be > 1 (weights are truncated there, "
            "and the diagnostics use the band [1 / threshold, threshold])",
        )
        parse_rejection(self.rollout_rs, self.rollout_rs_threshold)
        check(
            not (self.bypass_mode and self.rollout_is in IS_LEVELS),
            f"{_KEY}.bypass_mode=true makes the PPO ratio pi / pi_rollout already; weights on top would count the "
            f"mismatch twice: set {_KEY}.rollout_is=null (or auto)",
        )


@dataclass
class FilterGroupsConfig:
    # DAPO dynamic sampling: drop prompt groups whose `metric` is equal for every sample, sample more prompts.
    enable: bool = MISSING
    # acc | score: the reward function's value; seq_reward | seq_final_reward: with the overlong penalty.
    metric: str = MISSING
    # Generation rounds per step at most (the first included), 0 for no limit; a batch still short
    # after them is filled with dropped groups (zero advantage) and the step goes on.
    max_num_gen_batches: int = MISSING


@dataclass
class OverlongBufferConfig:
    # DAPO soft overlong punishment, added to the reward.
    enable: bool = MISSING
    # Tokens before data.max_response_length where the penalty starts; null: 20% of it (the
    # paper's 4096 of 20480).
    len: int | None = MISSING
    penalty_factor: float = MISSING


@dataclass
class AlgorithmConfig:
    adv_estimator: str = MISSING
    norm_adv_by_std_in_grpo: bool = MISSING
    use_kl_in_reward: bool = MISSING
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)

    def check(self) -> None:
        one_of("algorithm.adv_estimator", self.adv_estimator, ("grpo",))
        check(
            not self.use_kl_in_reward,
            "algorithm.use_kl_in_reward=true is not supported: GRPO here puts the KL in the loss; "
            "set actor.use_kl_loss=true instead",
        )
        self.rollout_correction.check()
        fg = self.filter_groups
        one_of("algorithm.filter_groups.metric", fg.metric, ("acc", "score", "seq_reward", "seq_final_reward"))
        check(
            fg.max_num_gen_batches >= 0,
            f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} must be >= 1, or 0 for no limit",
        )
