"""Every key a run writes to metrics.jsonl: its meaning, unit and the side that computes it.

METRICS is the one list: docs/metrics.md is generated from it (`python -m lorarl.metrics >
docs/metrics.md`) and tests check that each key a real run logs is described here. A key holding
`{name}` placeholders stands for a family (`val/{source}/acc/mean@{n}`); a placeholder matches
any text, data sources such as `openai/gsm8k` included. The first sync's keys, logged once at
step 0, carry an `init/` prefix (`init/sync/bytes`) and mean what the key without it means.

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


M = Metric
METRICS: tuple[Metric, ...] = (
    M("step", "the optimizer step the row belongs to (0: before training)", "count", "driver"),
    # Rewards and samples.
    M("reward/mean", "mean reward of every training sample of the step", "reward", "driver"),
    M("reward/std", "standard deviation of those rewards", "reward", "driver"),
    M(
        "reward/overlong_reward",
        "mean DAPO overlong penalty added to the rewards (algorithm.overlong_buffer)",
        "reward",
        "driver",
    ),
    M(
        "reward/overlong",
        "share of samples the overlong penalty reached (algorithm.overlong_buffer)",
        "fraction",
        "driver",
    ),
    M("response_length/mean", "mean sampled response length", "tokens", "vLLM"),
    M("response_length/max", "longest sampled response", "tokens", "vLLM"),
    M("data/epoch", "passes over the training set begun so far", "count", "driver"),
    M("data/gen_rounds", "generation rounds of the step (DAPO dynamic sampling only)", "count", "driver"),
    M(
        "data/groups_with_signal",
        "share of the step's prompt groups whose rewards differ (DAPO dynamic sampling only)",
        "fraction",
        "driver",
    ),
    # The update.
    M("actor/pg_loss", "policy-gradient loss, aggregated by actor.loss_agg_mode", "loss", "worker"),
    M("actor/pg_clipfrac", "share of tokens whose ratio was clipped above", "fraction", "worker"),
    M("actor/pg_clipfrac_lower", "share of tokens whose ratio was clipped below", "fraction", "worker"),
    M("actor/ppo_kl", "mean of -(log pi - log pi_old) over response tokens (0 on-policy)", "nats", "worker"),
    M("actor/kl_loss", "KL to the base model (adapter disabled), actor.kl_loss_type", "nats", "worker"),
    M("actor/entropy", "mean entropy of the policy over response tokens", "nats", "worker"),
    M("actor/grad_norm", "gradient norm of the LoRA weights before clipping", "norm", "worker"),
    M("actor/lr", "learning rate the step used", "lr", "worker"),
    M("actor/padding_frac", "share of the update's forward positions that are padding", "fraction", "worker"),
    M("actor/micro_batches", "micro-batches per optimizer step", "count", "worker"),
    M("actor/micro_batch_tokens_max", "largest micro-batch, padded", "tokens", "worker"),
    M(
        "rollout_corr/kl",
        "mean of log pi_rollout - log pi_trainer over response tokens (k1 of KL(rollout || trainer))",
        "nats",
        "worker",
    ),
    M("rollout_corr/k3_kl", "mean of rho - log rho - 1, rho = pi_trainer / pi_rollout", "nats", "worker"),
    M(
        "rollout_corr/training_log_ppl",
        "mean over sequences of the trainer's negative mean token log-prob",
        "nats",
        "worker",
    ),
    M("rollout_corr/rollout_log_ppl", "mean over sequences of vLLM's negative mean token log-prob", "nats", "worker"),
    M("rollout_corr/log_ppl_diff", "mean over sequences of rollout minus trainer mean log-prob", "nats", "worker"),
    M(
        "rollout_corr/log_ppl_abs_diff",
        "mean over sequences of the absolute rollout minus trainer mean log-prob",
        "nats",
        "worker",
    ),
    M("rollout_corr/chi2_token", "mean(rho^2) - 1 over tokens", "ratio", "worker"),
    M("rollout_corr/chi2_seq", "mean over sequences of (prod_t rho)^2 - 1", "ratio", "worker"),
    M(
        "rollout_corr/rollout_is_mean",
        "mean importance weight before truncation (token or sequence level)",
        "ratio",
        "worker",
    ),
    M("rollout_corr/rollout_is_std", "standard deviation of those weights", "ratio", "worker"),
    M("rollout_corr/rollout_is_min", "smallest weight before truncation", "ratio", "worker"),
    M("rollout_corr/rollout_is_max", "largest weight before truncation", "ratio", "worker"),
    M(
        "rollout_corr/rollout_is_ratio_fraction_high",
        "share of weights above rollout_is_threshold",
        "fraction",
        "worker",
    ),
    M(
        "rollout_corr/rollout_is_ratio_fraction_low",
        "share of weights below 1 / rollout_is_threshold",
        "fraction",
        "worker",
    ),
    M(
        "rollout_corr/rollout_is_eff_sample_size",
        "1 / mean((w / mean w)^2) of the weights clamped to [1/tau, tau]",
        "fraction",
        "worker",
    ),
    M(
        "rollout_corr/rollout_is_batch_norm_factor",
        "mean weight the batch normalisation divides by (rollout_is_batch_normalize)",
        "ratio",
        "worker",
    ),
    M(
        "rollout_corr/rollout_rs_masked_fraction",
        "share of tokens rejection removed from the loss (rollout_rs)",
        "fraction",
        "worker",
    ),
    M(
        "rollout_corr/rollout_rs_seq_masked_fraction",
        "share of sequences with a token removed by rejection (rollout_rs)",
        "fraction",
        "worker",
    ),
    M(
        "rollout_corr/rollout_rs_{option}_masked_fraction",
        "share of tokens one rollout_rs option rejected",
        "fraction",
        "worker",
    ),
    M("memory/max_allocated_gib", "peak device memory of the worker so far (GPU)", "GiB", "worker"),
    M("memory/update_peak_gib", "device memory the update added above what it started with (GPU)", "GiB", "worker"),
    M(
        "memory/alloc_retries",
        "times the update's allocations found no cached block and freed the cache to retry, each a device-wide wait (GPU)",
        "count",
        "worker",
    ),
    M(
        "rollout/sleeps",
        "1 when vLLM slept during this step's update (the sleep plan), 0 when it stayed awake",
        "0/1",
        "worker",
    ),
    # The weight sync and its checks.
    M("sync/kind", "what the sync sent: adapter, base, merged, or base+adapter", "text", "worker"),
    M("sync/num_tensors", "tensors sent", "count", "worker"),
    M("sync/bytes", "bytes sent", "bytes", "worker"),
    M("sync/gather_seconds", "collecting the weights from the training engine", "s", "worker"),
    M("sync/transfer_seconds", "handing them to the rollout engine", "s", "worker"),
    M("sync/load_seconds", "vLLM loading them", "s", "worker"),
    M("sync/seconds", "the whole sync: gather, transfer and load", "s", "worker"),
    M("sync/num_adapters", "adapters vLLM holds after the sync (1 in adapter mode, 0 merged)", "count", "vLLM"),
    M(
        "sync/adapter_match",
        "1 when the adapter vLLM holds equals the bytes sent exactly (transport fingerprint)",
        "0/1",
        "worker",
    ),
    M("sync/adapter_check_seconds", "time of that fingerprint check", "s", "worker"),
    M(
        "sync/adapter_meaning",
        "1 when every module's delta vLLM applies equals the trainer's scaling * B @ A (semantic check; merged "
        "sync: every served weight equals the trainer's base + that delta)",
        "0/1",
        "worker",
    ),
    M("sync/meaning_check_seconds", "time of the semantic check", "s", "worker"),
    M("sync/weights_match", "1 when the merged weights vLLM holds equal the trainer's (merged mode)", "0/1", "worker"),
    M("sync/weights_checked", "weights compared by that check", "count", "worker"),
    M("sync/weights_check_seconds", "time of that check", "s", "worker"),
    M(
        "sync/logprob_diff_max",
        "probe: worst token's |trainer - vLLM| log-prob (largest over workers)",
        "nats",
        "worker",
    ),
    M("sync/logprob_diff_mean", "probe: mean |trainer - vLLM| log-prob (largest over workers)", "nats", "worker"),
    M(
        "sync/logprob_ref_diff_mean",
        "probe: mean |trainer - base model| log-prob, the scale to judge by",
        "nats",
        "worker",
    ),
    M("sync/probe_seconds", "time of the log-prob probe", "s", "worker"),
    # Time of the step's parts.
    M("timing/gen", "sampling the step's groups and scoring them", "s", "driver"),
    M("timing/train", "the update call, as the driver waits for it", "s", "driver"),
    M(
        "timing/sync",
        "the sync call, as the driver waits for it (checks and a sleeping rollout's wake included)",
        "s",
        "driver",
    ),
    M("timing/step", "the whole step", "s", "driver"),
    M("timing/update", "the PPO update inside the worker", "s", "worker"),
    M("timing/old_logp", "the old log-prob pass (several epochs or mini-batches only)", "s", "worker"),
    M("timing/ref_logp", "the reference log-prob pass (KL on only)", "s", "worker"),
    M("timing/sleep", "putting vLLM to sleep before the update", "s", "worker"),
    M("timing/wake", "waking vLLM after the update", "s", "worker"),
    M("timing/val", "one validation pass", "s", "driver"),
    M("timing/save", "writing a checkpoint", "s", "driver"),
    # Validation (greedy by default: rollout.val_kwargs).
    M("val/acc", "validation accuracy: val/{source}/acc/mean@{n} averaged over data sources", "fraction", "driver"),
    M("val/{source}/reward/mean", "mean training reward of one data source's validation samples", "reward", "driver"),
    M(
        "val/{source}/{scorer}/mean@{n}",
        "share of samples that earn the full score (n samples per prompt); scorer acc is the training "
        "scorer, acc_flexible / acc_verl / acc_verl_flexible (GSM8K) the other scorers",
        "fraction",
        "driver",
    ),
    M("val/{source}/{scorer}/pass@{k}", "chance that one of k samples earns the full score", "fraction", "driver"),
    # Logged once, at step 0.
    M("init/num_nodes", "nodes the workers run on", "count", "driver"),
    M("init/worker_node_ids", "Ray node id of each worker, comma separated", "text", "driver"),
    M(
        "init/timing/prepare",
        "the driver's checks before Ray: model, tokenizer, data, rewards, checkpoints",
        "s",
        "driver",
    ),
    M("init/timing/ray_init", "starting Ray (or joining a cluster)", "s", "driver"),
    M("init/timing/workers_start", "placing the workers and starting their processes", "s", "driver"),
    M(
        "init/timing/worker_setup",
        "the workers' setup: process group, vLLM engine, training engine (the slowest worker)",
        "s",
        "driver",
    ),
    M(
        "init/timing/rollout_start",
        "starting vLLM: weights, compile, KV cache, CUDA graphs (slowest worker)",
        "s",
        "worker",
    ),
    M("init/timing/engine_build", "building the training engine: model, LoRA, sharding, optimizer", "s", "worker"),
)


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
        "own output.",
        "",
        "| key | meaning | unit | side |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{m.key}` | {m.meaning} | {m.unit} | {m.side} |" for m in METRICS]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
