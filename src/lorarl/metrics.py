"""Every key a run writes to metrics.jsonl: its meaning, unit and the side that computes it.

METRICS is the one list, and the code writes and reads keys only through it: each entry is a
named constant here (`ACTOR_PG_LOSS`); the reports that turn a step's results into logged keys
(lorarl.contract.messages), the PPO update, the trainer and the worker groups write with those
constants, and the trackers, the plots, the sweep summary and the bench read with them
(tests/test_metrics.py fails on a key written as a literal anywhere else). A member of a family
is `Metric.format` of its template; a measure that an algorithm names itself (a loss's own
actor/* names, the rollout correction's) becomes a key through `actor_key` / `rollout_corr_key`,
which pass `checked`, so a key this list lacks cannot be logged. docs/metrics.md is generated from it (`python -m lorarl.metrics >
docs/metrics.md`). A key holding `{name}` placeholders stands for a family
(`val/{source}/acc/mean@{n}`); a placeholder matches any text, data sources such as
`openai/gsm8k` included. The first sync's keys, logged once at step 0, carry an `init/` prefix
(`init/sync/bytes`) and mean what the key without it means. `when` says what a key needs to be
logged, where the default run does not log it.

Sides: `driver` is the trainer process running the step loop; `worker` is each training worker
(its engine, and its colocated vLLM engine), where several workers' numbers are combined as the
key says (the largest for `*_max` keys, else the mean); `vLLM` is the rollout engine's own output.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Metric:
    key: str
    meaning: str
    unit: str
    side: str
    # When it is logged: "" when the default run logs it (every step, or at its validation or
    # probe steps, or once at step 0), else the condition (a setting, the device) it needs.
    when: str = ""

    def format(self, **parts: object) -> str:
        """The key of one member of a family: `VAL_SOURCE_REWARD_MEAN.format(source="gsm8k")`."""
        return self.key.format(**parts)


M = Metric
STEP = M("step", "the optimizer step the row belongs to (0: before training)", "count", "driver")

# Rewards and samples.
REWARD_MEAN = M("reward/mean", "mean reward of every training sample of the step", "reward", "driver")
REWARD_STD = M("reward/std", "standard deviation of those rewards", "reward", "driver")
REWARD_OVERLONG_REWARD = M(
    "reward/overlong_reward",
    "mean DAPO overlong penalty added to the rewards (algorithm.overlong_buffer)",
    "reward",
    "driver",
    when="algorithm.overlong_buffer.enable",
)
REWARD_OVERLONG = M(
    "reward/overlong",
    "share of samples the overlong penalty reached (algorithm.overlong_buffer)",
    "fraction",
    "driver",
    when="algorithm.overlong_buffer.enable",
)
RESPONSE_LENGTH_MEAN = M("response_length/mean", "mean sampled response length", "tokens", "vLLM")
RESPONSE_LENGTH_MAX = M("response_length/max", "longest sampled response", "tokens", "vLLM")
DATA_EPOCH = M("data/epoch", "passes over the training set begun so far", "count", "driver")
DATA_GEN_ROUNDS = M(
    "data/gen_rounds",
    "generation rounds of the step (DAPO dynamic sampling only)",
    "count",
    "driver",
    when="algorithm.filter_groups.enable",
)
DATA_GROUPS_WITH_SIGNAL = M(
    "data/groups_with_signal",
    "share of the step's prompt groups whose rewards differ (DAPO dynamic sampling only)",
    "fraction",
    "driver",
    when="algorithm.filter_groups.enable",
)

# The update.
ACTOR_PG_LOSS = M("actor/pg_loss", "policy-gradient loss, aggregated by actor.loss_agg_mode", "loss", "worker")
ACTOR_PG_CLIPFRAC = M("actor/pg_clipfrac", "share of tokens whose ratio was clipped above", "fraction", "worker")
ACTOR_PG_CLIPFRAC_LOWER = M(
    "actor/pg_clipfrac_lower", "share of tokens whose ratio was clipped below", "fraction", "worker"
)
ACTOR_PPO_KL = M("actor/ppo_kl", "mean of -(log pi - log pi_old) over response tokens (0 on-policy)", "nats", "worker")
ACTOR_KL_LOSS = M("actor/kl_loss", "KL to the base model (adapter disabled), actor.kl_loss_type", "nats", "worker")
ACTOR_ENTROPY = M("actor/entropy", "mean entropy of the policy over response tokens", "nats", "worker")
ACTOR_GRAD_NORM = M("actor/grad_norm", "gradient norm of the LoRA weights before clipping", "norm", "worker")
ACTOR_LR = M("actor/lr", "learning rate the step used", "lr", "worker")
ACTOR_PADDING_FRAC = M(
    "actor/padding_frac", "share of the update's forward positions that are padding", "fraction", "worker"
)
ACTOR_MICRO_BATCHES = M("actor/micro_batches", "micro-batches per optimizer step", "count", "worker")
ACTOR_MICRO_BATCH_TOKENS_MAX = M("actor/micro_batch_tokens_max", "largest micro-batch, padded", "tokens", "worker")
ROLLOUT_CORR_KL = M(
    "rollout_corr/kl",
    "mean of log pi_rollout - log pi_trainer over response tokens (k1 of KL(rollout || trainer))",
    "nats",
    "worker",
)
ROLLOUT_CORR_K3_KL = M(
    "rollout_corr/k3_kl", "mean of rho - log rho - 1, rho = pi_trainer / pi_rollout", "nats", "worker"
)
ROLLOUT_CORR_TRAINING_LOG_PPL = M(
    "rollout_corr/training_log_ppl",
    "mean over sequences of the trainer's negative mean token log-prob",
    "nats",
    "worker",
)
ROLLOUT_CORR_ROLLOUT_LOG_PPL = M(
    "rollout_corr/rollout_log_ppl", "mean over sequences of vLLM's negative mean token log-prob", "nats", "worker"
)
ROLLOUT_CORR_LOG_PPL_DIFF = M(
    "rollout_corr/log_ppl_diff", "mean over sequences of rollout minus trainer mean log-prob", "nats", "worker"
)
ROLLOUT_CORR_LOG_PPL_ABS_DIFF = M(
    "rollout_corr/log_ppl_abs_diff",
    "mean over sequences of the absolute rollout minus trainer mean log-prob",
    "nats",
    "worker",
)
ROLLOUT_CORR_CHI2_TOKEN = M("rollout_corr/chi2_token", "mean(rho^2) - 1 over tokens", "ratio", "worker")
ROLLOUT_CORR_CHI2_SEQ = M("rollout_corr/chi2_seq", "mean over sequences of (prod_t rho)^2 - 1", "ratio", "worker")
ROLLOUT_CORR_ROLLOUT_IS_MEAN = M(
    "rollout_corr/rollout_is_mean",
    "mean importance weight before truncation (token or sequence level)",
    "ratio",
    "worker",
)
ROLLOUT_CORR_ROLLOUT_IS_STD = M("rollout_corr/rollout_is_std", "standard deviation of those weights", "ratio", "worker")
ROLLOUT_CORR_ROLLOUT_IS_MIN = M("rollout_corr/rollout_is_min", "smallest weight before truncation", "ratio", "worker")
ROLLOUT_CORR_ROLLOUT_IS_MAX = M("rollout_corr/rollout_is_max", "largest weight before truncation", "ratio", "worker")
ROLLOUT_CORR_ROLLOUT_IS_RATIO_FRACTION_HIGH = M(
    "rollout_corr/rollout_is_ratio_fraction_high",
    "share of weights above rollout_is_threshold",
    "fraction",
    "worker",
)
ROLLOUT_CORR_ROLLOUT_IS_RATIO_FRACTION_LOW = M(
    "rollout_corr/rollout_is_ratio_fraction_low",
    "share of weights below 1 / rollout_is_threshold",
    "fraction",
    "worker",
)
ROLLOUT_CORR_ROLLOUT_IS_EFF_SAMPLE_SIZE = M(
    "rollout_corr/rollout_is_eff_sample_size",
    "1 / mean((w / mean w)^2) of the weights clamped to [1/tau, tau]",
    "fraction",
    "worker",
)
ROLLOUT_CORR_ROLLOUT_IS_BATCH_NORM_FACTOR = M(
    "rollout_corr/rollout_is_batch_norm_factor",
    "mean weight the batch normalisation divides by (rollout_is_batch_normalize)",
    "ratio",
    "worker",
    when="algorithm.rollout_correction.rollout_is_batch_normalize with rollout_is set",
)
ROLLOUT_CORR_ROLLOUT_RS_MASKED_FRACTION = M(
    "rollout_corr/rollout_rs_masked_fraction",
    "share of tokens rejection removed from the loss (rollout_rs)",
    "fraction",
    "worker",
    when="algorithm.rollout_correction.rollout_rs set",
)
ROLLOUT_CORR_ROLLOUT_RS_SEQ_MASKED_FRACTION = M(
    "rollout_corr/rollout_rs_seq_masked_fraction",
    "share of sequences with a token removed by rejection (rollout_rs)",
    "fraction",
    "worker",
    when="algorithm.rollout_correction.rollout_rs set",
)
ROLLOUT_CORR_ROLLOUT_RS_OPTION_MASKED_FRACTION = M(
    "rollout_corr/rollout_rs_{option}_masked_fraction",
    "share of tokens one rollout_rs option rejected",
    "fraction",
    "worker",
    when="algorithm.rollout_correction.rollout_rs set",
)
MEMORY_MAX_ALLOCATED_GIB = M(
    "memory/max_allocated_gib", "peak device memory of the worker so far (GPU)", "GiB", "worker", when="training on GPU"
)
MEMORY_UPDATE_PEAK_GIB = M(
    "memory/update_peak_gib",
    "device memory the update added above what it started with (GPU)",
    "GiB",
    "worker",
    when="training on GPU",
)
MEMORY_ALLOC_RETRIES = M(
    "memory/alloc_retries",
    "times the update's allocations found no cached block and freed the cache to retry, each a device-wide wait (GPU)",
    "count",
    "worker",
    when="training on GPU",
)
ROLLOUT_SLEEPS = M(
    "rollout/sleeps",
    "1 when vLLM slept during this step's update (the sleep plan), 0 when it stayed awake",
    "0/1",
    "worker",
)
ROLLOUT_STALENESS = M(
    "rollout/staleness",
    "adapter versions between the one that sampled the step's batch and the one its update starts from "
    "(never above trainer.off_policy_steps; 0 on the first step, after a resume, and on-policy)",
    "count",
    "driver",
    when="trainer.off_policy_steps > 0",
)

# The weight sync and its checks.
SYNC_KIND = M("sync/kind", "what the sync sent: adapter, base, merged, or base+adapter", "text", "worker")
SYNC_NUM_TENSORS = M("sync/num_tensors", "tensors sent", "count", "worker")
SYNC_BYTES = M("sync/bytes", "bytes sent", "bytes", "worker")
SYNC_GATHER_SECONDS = M("sync/gather_seconds", "collecting the weights from the training engine", "s", "worker")
SYNC_TRANSFER_SECONDS = M("sync/transfer_seconds", "handing them to the rollout engine", "s", "worker")
SYNC_LOAD_SECONDS = M(
    "sync/load_seconds", "putting them into vLLM (its loader, or the in-place slot write)", "s", "worker"
)
SYNC_SECONDS = M("sync/seconds", "the whole sync: gather, transfer and load", "s", "worker")
SYNC_NUM_ADAPTERS = M(
    "sync/num_adapters", "adapters vLLM holds after the sync (1 in adapter mode, 0 merged)", "count", "vLLM"
)
SYNC_ADAPTER_MATCH = M(
    "sync/adapter_match",
    "1 when the adapter vLLM holds equals the bytes sent exactly (transport fingerprint)",
    "0/1",
    "worker",
)
SYNC_ADAPTER_CHECK_SECONDS = M("sync/adapter_check_seconds", "time of that fingerprint check", "s", "worker")
SYNC_ADAPTER_MEANING = M(
    "sync/adapter_meaning",
    "1 when every module's delta vLLM applies equals the trainer's scaling * B @ A (semantic check; merged "
    "sync: every served weight equals the trainer's base + that delta)",
    "0/1",
    "worker",
)
SYNC_MEANING_CHECK_SECONDS = M("sync/meaning_check_seconds", "time of the semantic check", "s", "worker")
SYNC_WEIGHTS_MATCH = M(
    "sync/weights_match",
    "1 when the merged weights vLLM holds equal the trainer's (merged mode)",
    "0/1",
    "worker",
    when="a base or merged sync (model.lora.merge, rollout.load_format=dummy) with trainer.check_sync",
)
SYNC_WEIGHTS_CHECKED = M(
    "sync/weights_checked",
    "weights compared by that check",
    "count",
    "worker",
    when="a base or merged sync (model.lora.merge, rollout.load_format=dummy) with trainer.check_sync",
)
SYNC_WEIGHTS_CHECK_SECONDS = M(
    "sync/weights_check_seconds",
    "time of that check",
    "s",
    "worker",
    when="a base or merged sync (model.lora.merge, rollout.load_format=dummy) with trainer.check_sync",
)
SYNC_LOGPROB_DIFF_MAX = M(
    "sync/logprob_diff_max",
    "probe: worst token's |trainer - vLLM| log-prob (largest over workers)",
    "nats",
    "worker",
)
SYNC_LOGPROB_DIFF_MEAN = M(
    "sync/logprob_diff_mean", "probe: mean |trainer - vLLM| log-prob (largest over workers)", "nats", "worker"
)
SYNC_LOGPROB_REF_DIFF_MEAN = M(
    "sync/logprob_ref_diff_mean",
    "probe: mean |trainer - base model| log-prob, the scale to judge by",
    "nats",
    "worker",
)
SYNC_PROBE_SECONDS = M("sync/probe_seconds", "time of the log-prob probe", "s", "worker")

# Time of the step's parts.
TIMING_GEN = M("timing/gen", "sampling the step's groups and scoring them", "s", "driver")
TIMING_TRAIN = M("timing/train", "the update call, as the driver waits for it", "s", "driver")
TIMING_SYNC = M(
    "timing/sync",
    "the sync call, as the driver waits for it (checks and a sleeping rollout's wake included)",
    "s",
    "driver",
)
TIMING_STEP = M("timing/step", "the whole step", "s", "driver")
TIMING_GEN_WAIT = M(
    "timing/gen_wait",
    "waiting, after the update call, for the next step's generation begun beside it, and scoring it",
    "s",
    "driver",
    when="trainer.off_policy_steps > 0 while vLLM stays awake beside the update",
)
TIMING_UPDATE = M("timing/update", "the PPO update inside the worker", "s", "worker")
TIMING_OLD_LOGP = M(
    "timing/old_logp",
    "the old log-prob pass (several epochs or mini-batches only)",
    "s",
    "worker",
    when="an off-policy update (several PPO epochs or mini-batches) or a rollout correction decided before it",
)
TIMING_REF_LOGP = M("timing/ref_logp", "the reference log-prob pass (KL on only)", "s", "worker")
TIMING_SLEEP = M("timing/sleep", "putting vLLM to sleep before the update", "s", "worker")
TIMING_WAKE = M(
    "timing/wake", "waking vLLM after the update", "s", "worker", when="vLLM sleeps during the update (GPU)"
)
TIMING_VAL = M("timing/val", "one validation pass", "s", "driver")
TIMING_SAVE = M("timing/save", "writing a checkpoint", "s", "driver", when="trainer.save_freq > 0")

# Validation (greedy by default: rollout.val_kwargs).
VAL_ACC = M(
    "val/acc", "validation accuracy: val/{source}/acc/mean@{n} averaged over data sources", "fraction", "driver"
)
VAL_SOURCE_REWARD_MEAN = M(
    "val/{source}/reward/mean", "mean training reward of one data source's validation samples", "reward", "driver"
)
VAL_SOURCE_SCORER_MEAN_N = M(
    "val/{source}/{scorer}/mean@{n}",
    "share of samples that earn the full score (n samples per prompt); scorer acc is the training "
    "scorer, acc_flexible / acc_verl / acc_verl_flexible (GSM8K) the other scorers",
    "fraction",
    "driver",
)
VAL_SOURCE_SCORER_PASS_K = M(
    "val/{source}/{scorer}/pass@{k}", "chance that one of k samples earns the full score", "fraction", "driver"
)

# Logged once, at step 0.
INIT_NUM_NODES = M("init/num_nodes", "nodes the workers run on", "count", "driver")
INIT_WORKER_NODE_IDS = M("init/worker_node_ids", "Ray node id of each worker, comma separated", "text", "driver")
INIT_TIMING_PREPARE = M(
    "init/timing/prepare",
    "the driver's checks before Ray: model, tokenizer, data, rewards, checkpoints",
    "s",
    "driver",
)
INIT_TIMING_RAY_INIT = M("init/timing/ray_init", "starting Ray (or joining a cluster)", "s", "driver")
INIT_TIMING_WORKERS_START = M(
    "init/timing/workers_start", "placing the workers and starting their processes", "s", "driver"
)
INIT_TIMING_WORKER_SETUP = M(
    "init/timing/worker_setup",
    "the workers' setup: process group, vLLM engine, training engine (the slowest worker)",
    "s",
    "driver",
)
INIT_TIMING_ROLLOUT_START = M(
    "init/timing/rollout_start",
    "starting vLLM: weights, compile, KV cache, CUDA graphs (slowest worker)",
    "s",
    "worker",
)
INIT_TIMING_ENGINE_BUILD = M(
    "init/timing/engine_build", "building the training engine: model, LoRA, sharding, optimizer", "s", "worker"
)

# The one list, in the order above: every Metric defined in this module.
METRICS: tuple[Metric, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Metric))


@cache
def _patterns() -> tuple[tuple[re.Pattern, Metric], ...]:
    out = []
    for m in METRICS:
        parts = re.split(r"\{[a-z_]+\}", m.key)
        out.append((re.compile(".+?".join(re.escape(p) for p in parts) + r"\Z"), m))
    return tuple(out)


def describe(key: str) -> Metric | None:
    """The METRICS entry a logged key belongs to, or None."""
    for pattern, m in _patterns():
        if pattern.match(key):
            return m
    if key.startswith("init/"):
        return describe(key.removeprefix("init/"))
    return None


@cache
def checked(key: str) -> str:
    """`key`, when the list describes it (`describe`); else a KeyError naming it."""
    if describe(key) is None:
        raise KeyError(f"{key}: not a key of lorarl.metrics.METRICS; describe it there before logging it")
    return key


def init_key(key: str) -> str:
    """`key` of the first sync as it is logged once, at step 0 (`init/sync/bytes`)."""
    return checked(f"init/{key}")


def actor_key(name: str) -> str:
    """The logged key of a measure a policy loss names itself (lorarl.algorithms.losses: `pg_clipfrac`)."""
    return checked(f"actor/{name}")


def rollout_corr_key(name: str) -> str:
    """The logged key of a measure of the rollout correction (lorarl.algorithms.rollout_correction: `kl`)."""
    return checked(f"rollout_corr/{name}")


def is_validation(key: str) -> bool:
    """Whether `key` is one of a validation pass's (val/*)."""
    return key.startswith("val/")


def markdown() -> str:
    lines = [
        "# Metrics",
        "",
        "Every key a run writes to `metrics.jsonl` (and to wandb / tensorboard when enabled).",
        "Generated from `lorarl.metrics.METRICS` by `python -m lorarl.metrics > docs/metrics.md`;",
        "do not edit by hand. `{name}` stands for a data source, a scorer or a count. The first",
        "sync's numbers are logged once at step 0 with an `init/` prefix (`init/sync/bytes`); a",
        "resumed run logs its own start-up in the row of the first step it trains.",
        "Side: `driver` is the trainer process, `worker` each training worker (several workers:",
        "the largest for `*_max` keys and the probe, else the mean), `vLLM` the rollout engine's",
        "own output. Logged: `default run` for a key the default run logs (at every step, at its",
        "validation and probe steps, or once at step 0), else the condition it needs.",
        "",
        "| key | meaning | unit | side | logged |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| `{m.key}` | {m.meaning} | {m.unit} | {m.side} | {m.when or 'default run'} |" for m in METRICS]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
