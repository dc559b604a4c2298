"""Translate a verl GRPO launch into the lorarl command that trains the same way.

python -m recipes.from_verl examples/tuning/0.5b/qwen2-0.5b_grpo-lora_1_h100_fsdp_vllm.sh
python -m recipes.from_verl actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct data.train_files=...
python -m recipes.from_verl --run run_qwen2-7b_math_megatron_lora.sh -- trainer.total_epochs=1

The input is either verl's Hydra overrides or one verl launch script. A script runs in bash
inside an empty temporary folder with `python`/`python3` replaced by a recorder, so its
variables, arrays and arithmetic expand as they would for verl; the arguments of its
`python3 -m verl.trainer.main_ppo` call are what gets translated (commands before that line
run as written, so translate scripts you would run). The lorarl command is printed on stdout,
each ignored verl key with its reason on stderr; `--run` runs the command, with any arguments
after `--` appended as lorarl overrides. Every verl key is in VERL_KEYS below (the README's
"Coming from verl" table is generated from it): mapped to a lorarl key, ignored with a reason,
or accepted only with the one value lorarl implements. Any other key is an error naming it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
A = "actor_rollout_ref."

# Reasons shared by several ignored keys.
NO_REF = "no separate reference model: the reference is the actor with its adapter disabled"
ON_POLICY = (
    "passes without backward follow the actor's batching (actor.log_prob_max_token_len_per_gpu "
    "under use_dynamic_bsz); on-policy, the old log-probs are the update's own forward"
)
NO_CRITIC = "GRPO trains no critic"
NO_AGENT = "no agent loop or server: each worker hands token ids to its in-process vLLM engine"
CHECKPOINT = "a checkpoint always holds what a resume needs (lorarl.checkpoint)"
ENGINE_ARG = "a vLLM engine argument, passed as given"


@dataclass(frozen=True)
class Key:
    """One verl key. `to` is the lorarl key (None: ignored, `note` says why); `only` the values
    lorarl accepts for a key it does not otherwise use; `values` renames values on the way."""

    verl: str
    to: str | None
    note: str = ""
    only: tuple[str, ...] = ()
    values: dict[str, str] = field(default_factory=dict)


VERL_KEYS: tuple[Key, ...] = (
    # Model and LoRA.
    Key(A + "model.path", "model.path"),
    Key(A + "model.lora_rank", "model.lora.rank"),
    Key(A + "model.lora_alpha", "model.lora.alpha"),
    Key(A + "model.target_modules", "model.lora.target_modules"),
    Key(A + "model.lora.rank", "model.lora.rank"),
    Key(A + "model.lora.alpha", "model.lora.alpha"),
    Key(A + "model.lora.dropout", "model.lora.dropout"),
    Key(A + "model.lora.target_modules", "model.lora.target_modules"),
    Key(A + "model.lora.target_parameters", "model.lora.target_parameters"),
    Key(A + "model.lora.type", "model.lora.type"),
    Key(A + "model.lora.lora_A_init_method", "model.lora.init_A"),
    Key(A + "model.lora.merge", "model.lora.merge"),
    Key(A + "model.enable_gradient_checkpointing", "model.enable_gradient_checkpointing"),
    Key(A + "model.trust_remote_code", "model.trust_remote_code"),
    Key(A + "model.use_liger", "backend.liger_kernel", "null (default) = on when training on CUDA"),
    Key(A + "model.use_remove_padding", None, "micro-batches are cut by tokens and all-padding columns trimmed"),
    Key(A + "model.use_shm", None, "the model is read from model.path as given"),
    Key(A + "model.use_fused_kernels", None, "log-probs and entropy always come from one fused pass"),
    Key(A + "hybrid_engine", None, "training and rollout are always colocated", only=("True", "true")),
    # Actor.
    Key(
        A + "actor.strategy",
        "+backend",
        "fsdp / fsdp2 -> +backend=fsdp, megatron -> +backend=megatron",
        values={"fsdp": "fsdp", "fsdp2": "fsdp", "megatron": "megatron"},
    ),
    Key(A + "actor.optim.lr", "actor.optim.lr"),
    Key(A + "actor.optim.weight_decay", "actor.optim.weight_decay"),
    Key(A + "actor.optim.betas", "actor.optim.betas"),
    Key(A + "actor.ppo_mini_batch_size", "actor.ppo_mini_batch_size"),
    Key(A + "actor.ppo_micro_batch_size_per_gpu", "actor.ppo_micro_batch_size_per_gpu"),
    Key(A + "actor.use_dynamic_bsz", "actor.use_dynamic_bsz"),
    Key(A + "actor.ppo_max_token_len_per_gpu", "actor.ppo_max_token_len_per_gpu"),
    Key(A + "actor.ppo_epochs", "actor.ppo_epochs"),
    Key(A + "actor.clip_ratio", "actor.clip_ratio"),
    Key(A + "actor.clip_ratio_low", "actor.clip_ratio_low"),
    Key(A + "actor.clip_ratio_high", "actor.clip_ratio_high"),
    Key(A + "actor.clip_ratio_c", "actor.clip_ratio_c", "verl's default 3.0 is on; lorarl's null is off"),
    Key(A + "actor.entropy_coeff", "actor.entropy_coeff"),
    Key(A + "actor.use_kl_loss", "actor.use_kl_loss"),
    Key(A + "actor.kl_loss_coef", "actor.kl_loss_coef"),
    Key(A + "actor.kl_loss_type", "actor.kl_loss_type"),
    Key(A + "actor.loss_agg_mode", "actor.loss_agg_mode"),
    Key(A + "actor.policy_loss.loss_mode", "actor.policy_loss"),
    Key(A + "actor.loss_scale_factor", "actor.loss_scale_factor"),
    Key(A + "actor.grad_clip", "actor.grad_clip"),
    Key(A + "actor.use_torch_compile", "backend.compile"),
    Key(A + "actor.ulysses_sequence_parallel_size", None, "no sequence parallelism in the FSDP backend", only=("1",)),
    Key(A + "actor.fsdp_config.param_offload", "backend.param_offload"),
    Key(A + "actor.fsdp_config.optimizer_offload", "backend.optimizer_offload"),
    Key(A + "actor.fsdp_config.reshard_after_forward", "backend.reshard_after_forward"),
    Key(A + "actor.fsdp_config.fsdp_size", None, "FSDP shards over every worker", only=("-1",)),
    Key(A + "actor.megatron.tensor_model_parallel_size", "backend.tensor_model_parallel_size"),
    Key(A + "actor.megatron.pipeline_model_parallel_size", "backend.pipeline_model_parallel_size"),
    Key(A + "actor.megatron.expert_model_parallel_size", "backend.expert_model_parallel_size"),
    Key(A + "actor.megatron.expert_tensor_parallel_size", "backend.expert_tensor_parallel_size"),
    Key(A + "actor.megatron.sequence_parallel", "backend.sequence_parallel"),
    Key(A + "actor.megatron.use_distributed_optimizer", "backend.use_distributed_optimizer"),
    Key(A + "actor.megatron.use_mbridge", None, "a bridge is always used (backend.bridge)", only=("True", "true")),
    Key(
        A + "actor.megatron.vanilla_mbridge",
        None,
        "LoRA is exported through Megatron-Bridge (backend.bridge=megatron_bridge); vanilla mbridge has no adapter export",
        only=("False", "false"),
    ),
    Key(A + "actor.megatron.override_transformer_config.recompute_method", "backend.recompute_method"),
    Key(A + "actor.megatron.override_transformer_config.recompute_granularity", "backend.recompute_granularity"),
    Key(A + "actor.megatron.override_transformer_config.recompute_num_layers", "backend.recompute_num_layers"),
    Key(A + "actor.checkpoint.save_contents", None, CHECKPOINT),
    Key(A + "actor.checkpoint.load_contents", None, CHECKPOINT),
    # Reference model: the actor itself.
    Key(A + "ref.log_prob_max_token_len_per_gpu", "actor.log_prob_max_token_len_per_gpu", "one budget for both passes"),
    Key(A + "ref.log_prob_micro_batch_size_per_gpu", None, ON_POLICY),
    Key(A + "ref.log_prob_micro_batch_size", None, ON_POLICY),
    Key(A + "ref.log_prob_use_dynamic_bsz", None, ON_POLICY),
    Key(A + "ref.fsdp_config.param_offload", None, NO_REF),
    Key(A + "ref.megatron.tensor_model_parallel_size", None, NO_REF),
    Key(A + "ref.megatron.pipeline_model_parallel_size", None, NO_REF),
    # Rollout.
    Key(A + "rollout.name", None, "the rollout engine is vLLM", only=("vllm",)),
    Key(A + "rollout.mode", None, NO_AGENT),
    Key(A + "rollout.n", "rollout.n"),
    Key(A + "rollout.temperature", "rollout.temperature"),
    Key(A + "rollout.top_p", "rollout.top_p"),
    Key(A + "rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    Key(A + "rollout.tensor_model_parallel_size", "rollout.tensor_model_parallel_size"),
    Key(A + "rollout.load_format", "rollout.load_format"),
    Key(A + "rollout.layered_summon", "rollout.layered_summon"),
    Key(A + "rollout.enforce_eager", "rollout.enforce_eager", "lorarl's null = CUDA graphs on GPU"),
    Key(A + "rollout.free_cache_engine", "rollout.free_cache_engine", "lorarl's null = sleep only when needed"),
    Key(A + "rollout.dtype", "rollout.dtype"),
    Key(A + "rollout.max_model_len", "rollout.max_model_len"),
    Key(A + "rollout.log_prob_max_token_len_per_gpu", "actor.log_prob_max_token_len_per_gpu"),
    Key(A + "rollout.log_prob_micro_batch_size_per_gpu", None, ON_POLICY),
    Key(A + "rollout.log_prob_micro_batch_size", None, ON_POLICY),
    Key(A + "rollout.log_prob_use_dynamic_bsz", None, ON_POLICY),
    Key(A + "rollout.calculate_log_probs", None, "the sampler's log-probs are always kept"),
    Key(A + "rollout.max_num_seqs", "+rollout.engine_kwargs.max_num_seqs", ENGINE_ARG),
    Key(A + "rollout.max_num_batched_tokens", "+rollout.engine_kwargs.max_num_batched_tokens", ENGINE_ARG),
    Key(A + "rollout.enable_chunked_prefill", "+rollout.engine_kwargs.enable_chunked_prefill", ENGINE_ARG),
    Key(A + "rollout.engine_kwargs.vllm.*", "+rollout.engine_kwargs.*", ENGINE_ARG + ", any of them by vLLM's name"),
    Key(A + "rollout.agent.num_workers", None, NO_AGENT),
    Key(A + "rollout.val_kwargs.n", "rollout.val_kwargs.n"),
    Key(A + "rollout.val_kwargs.temperature", "rollout.val_kwargs.temperature"),
    Key(A + "rollout.val_kwargs.top_p", "rollout.val_kwargs.top_p"),
    Key(A + "rollout.val_kwargs.do_sample", "rollout.val_kwargs.do_sample"),
    # Data.
    Key("data.train_files", "data.train_files"),
    Key("data.val_files", "data.val_files"),
    Key("data.train_batch_size", "data.train_batch_size"),
    Key("data.gen_batch_size", "data.gen_batch_size"),
    Key("data.max_prompt_length", "data.max_prompt_length"),
    Key("data.max_response_length", "data.max_response_length"),
    Key("data.filter_overlong_prompts", "data.filter_overlong_prompts"),
    Key("data.truncation", "data.truncation"),
    Key("data.shuffle", "data.shuffle"),
    Key("data.val_batch_size", None, "validation sends every prompt to vLLM at once"),
    Key("data.return_raw_chat", None, NO_AGENT),
    Key("data.dataloader_num_workers", None, "prompts are read into memory once"),
    # Algorithm.
    Key("algorithm.adv_estimator", "algorithm.adv_estimator"),
    Key("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std_in_grpo"),
    Key("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward"),
    Key("algorithm.kl_ctrl.kl_coef", None, "the in-reward KL controller; the KL here is actor.kl_loss_coef"),
    Key("algorithm.kl_ctrl.type", None, "the in-reward KL controller; the KL here is actor.kl_loss_coef"),
    Key("algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is"),
    Key("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rollout_correction.rollout_is_threshold"),
    Key(
        "algorithm.rollout_correction.rollout_is_batch_normalize",
        "algorithm.rollout_correction.rollout_is_batch_normalize",
    ),
    Key("algorithm.rollout_correction.rollout_rs", "algorithm.rollout_correction.rollout_rs"),
    Key("algorithm.rollout_correction.rollout_rs_threshold", "algorithm.rollout_correction.rollout_rs_threshold"),
    Key("algorithm.rollout_correction.bypass_mode", "algorithm.rollout_correction.bypass_mode"),
    Key(
        "algorithm.rollout_correction.loss_type",
        None,
        "bypass mode uses the PPO-clip loss (verl's default)",
        only=("ppo_clip",),
    ),
    Key("algorithm.filter_groups.enable", "algorithm.filter_groups.enable"),
    Key("algorithm.filter_groups.metric", "algorithm.filter_groups.metric"),
    Key("algorithm.filter_groups.max_num_gen_batches", "algorithm.filter_groups.max_num_gen_batches"),
    Key("reward_model.enable", None, "rewards are rule-based (data_source or data.reward_fn)", only=("False", "false")),
    Key("reward.reward_kwargs.overlong_buffer_cfg.enable", "algorithm.overlong_buffer.enable"),
    Key("reward.reward_kwargs.overlong_buffer_cfg.len", "algorithm.overlong_buffer.len"),
    Key("reward.reward_kwargs.overlong_buffer_cfg.penalty_factor", "algorithm.overlong_buffer.penalty_factor"),
    Key("reward_model.overlong_buffer.enable", "algorithm.overlong_buffer.enable"),
    Key("reward_model.overlong_buffer.len", "algorithm.overlong_buffer.len"),
    Key("reward_model.overlong_buffer.penalty_factor", "algorithm.overlong_buffer.penalty_factor"),
    # Trainer.
    Key("trainer.total_epochs", "trainer.total_epochs"),
    Key("trainer.total_training_steps", "trainer.total_steps"),
    Key("trainer.save_freq", "trainer.save_freq"),
    Key("trainer.test_freq", "trainer.test_freq"),
    Key("trainer.val_before_train", "trainer.val_before_train"),
    Key("trainer.logger", "trainer.logger"),
    Key("trainer.project_name", "trainer.project_name"),
    Key("trainer.experiment_name", "trainer.experiment_name"),
    Key("trainer.n_gpus_per_node", "trainer.n_gpus_per_node"),
    Key("trainer.nnodes", "trainer.nnodes"),
    Key("trainer.device", "trainer.device"),
    Key("trainer.default_local_dir", "trainer.default_local_dir"),
    Key("trainer.resume_mode", "trainer.resume_mode"),
    Key("trainer.max_actor_ckpt_to_keep", "trainer.max_ckpt_to_keep"),
    Key("trainer.critic_warmup", None, NO_CRITIC),
    Key("trainer.max_critic_ckpt_to_keep", None, NO_CRITIC),
    Key("trainer.use_legacy_worker_impl", None, "one worker implementation"),
    Key("trainer.balance_batch", None, "prompt groups are split contiguously; micro-batches are cut by tokens"),
)
BY_VERL = {k.verl: k for k in VERL_KEYS}
# Families of keys: `prefix.*` in verl -> the same name under the lorarl row's prefix.
FAMILIES = [k for k in VERL_KEYS if k.verl.endswith(".*")]


def verl_row(key: str) -> tuple[Key | None, str | None]:
    """The VERL_KEYS row for a verl key and the lorarl key it maps to (None: ignored or unknown)."""
    row = BY_VERL.get(key)
    if row is not None:
        return row, row.to
    for family in FAMILIES:
        prefix = family.verl[:-1]
        if key.startswith(prefix) and len(key) > len(prefix):
            return family, family.to[:-1] + key[len(prefix) :]
    return None, None


# verl entry points whose config name picks the backend.
MEGATRON_CONFIGS = ("ppo_megatron_trainer", "ppo_megatron_trainer.yaml")


class VerlTranslationError(ValueError):
    """A verl launch lorarl cannot translate; the message names the key or file."""


@dataclass
class Translation:
    overrides: list[str]
    ignored: list[tuple[str, str, str]]  # (verl key, value, reason)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "recipes.grpo", *self.overrides]


def _presets(group: str, key: str) -> dict[str, str]:
    """{value of `key` in a conf/<group> preset: preset name}, read with OmegaConf (no Hydra)."""
    from omegaconf import OmegaConf

    out = {}
    for path in sorted((ROOT / "conf" / group).glob("*.yaml")):
        node = OmegaConf.select(OmegaConf.load(path), key, throw_on_resolution_failure=False)
        if isinstance(node, str) and "${" not in node:
            out[node] = path.stem
    return out


def model_preset(path: str) -> str:
    by_path = _presets("model", "model.path")
    by_name = {p.rsplit("/", 1)[-1].lower(): name for p, name in by_path.items()}
    name = by_path.get(path) or by_name.get(path.rstrip("/").rsplit("/", 1)[-1].lower())
    if name is None:
        raise VerlTranslationError(
            f"actor_rollout_ref.model.path={path}: no conf/model preset for this model; "
            f"pass --model with one of {', '.join(sorted(by_path.values()))}"
        )
    return name


def data_preset(train_files: str) -> str:
    return "math" if "math" in train_files.lower() else "gsm8k"


def split_override(arg: str) -> tuple[str, str]:
    key, sep, value = arg.partition("=")
    if not sep or not key:
        raise VerlTranslationError(f"{arg!r} is not a verl override (key=value)")
    if key.startswith("~"):
        raise VerlTranslationError(f"{arg}: deleting verl keys has no lorarl equivalent; leave it out")
    return key.lstrip("+"), value


def translate(args: list[str], model: str | None = None, data: str | None = None) -> Translation:
    """lorarl overrides for verl's `main_ppo` arguments (its --config-name picks the backend)."""
    backend = "fsdp"
    mapped: dict[str, tuple[str, str]] = {}  # lorarl key -> (value, verl key it came from)
    ignored, unknown = [], []
    verl_values = {}
    for arg in args:
        if arg.startswith("--config-name"):
            name = arg.partition("=")[2].strip("'\"")
            backend = "megatron" if name in MEGATRON_CONFIGS else backend
            continue
        if arg.startswith("--config-path"):
            continue
        key, value = split_override(arg)
        row, to = verl_row(key)
        if row is None:
            unknown.append(key)
            continue
        verl_values[key] = value
        if row.only and value not in row.only:
            raise VerlTranslationError(f"{key}={value}: lorarl supports only {' or '.join(row.only)} ({row.note})")
        if to is None:
            ignored.append((key, value, row.note))
            continue
        if row.values and value not in row.values:
            raise VerlTranslationError(f"{key}={value}: use one of {', '.join(row.values)}")
        value = row.values.get(value, value)
        if to == "+backend":
            backend = value
            continue
        if to in mapped and mapped[to][0] != value:
            first = mapped[to][1]
            raise VerlTranslationError(f"{first} and {key} both set {to} but differ; give them one value")
        mapped[to] = (value, key)
    if unknown:
        raise VerlTranslationError(
            f"verl keys with no lorarl equivalent: {', '.join(unknown)}; "
            "remove them or see recipes/from_verl.py VERL_KEYS"
        )
    if model is None and A + "model.path" in verl_values:
        model = model_preset(verl_values[A + "model.path"])
    head = [f"+backend={backend}"]
    if model:
        head.append(f"model={model}")
    if data or "data.train_files" in verl_values:
        head.append(f"data={data or data_preset(verl_values['data.train_files'])}")
    return Translation(head + [f"{k}={v}" for k, (v, _) in mapped.items()], ignored)


def script_args(script: Path) -> list[str]:
    """The arguments a verl launch script passes to `python3 -m verl.trainer.main_ppo`."""
    if not script.is_file():
        raise VerlTranslationError(f"{script}: no such launch script")
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "args"
        shim = (
            'record() { [[ " $* " == *" -m verl."* ]] || return 0; printf "%s\\0" "$@" > "$RECORD"; }\n'
            'python() { record "$@"; }\npython3() { record "$@"; }\n'
            'source "$SCRIPT"\n'
        )
        env = {**os.environ, "RECORD": str(record), "SCRIPT": str(script.resolve())}
        done = subprocess.run(
            ["bash", "-c", shim], cwd=tmp, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
        )
        if not record.is_file():
            tail = done.stderr.strip().splitlines()[-1:] or [""]
            raise VerlTranslationError(
                f"{script}: no `python3 -m verl...` call ran (exit {done.returncode}: {tail[0]}); pass its overrides instead"
            )
        argv = record.read_text().split("\0")[:-1]
    module = argv.index("-m") + 1
    return argv[module + 1 :]


def _same_name_prefixes(row: Key) -> tuple[str, str] | None:
    """(verl prefix, lorarl prefix) when the two keys end in the same name, else None."""
    verl, ours = row.verl.split("."), row.to.split(".")
    n = 0
    while n < min(len(verl), len(ours)) and verl[-1 - n] == ours[-1 - n]:
        n += 1
    return (".".join(verl[: len(verl) - n]), ".".join(ours[: len(ours) - n])) if n else None


def markdown_table() -> str:
    """The README's "Coming from verl" table, generated from VERL_KEYS: keys that keep their
    name under another prefix, one line per prefix; renamed keys and keys with a note, one line
    each; ignored keys, one line per reason."""
    lines = ["| verl | lorarl | note |", "|---|---|---|"]
    same: dict[tuple[str, str], list[str]] = {}
    for k in VERL_KEYS:
        prefixes = _same_name_prefixes(k) if k.to and not k.note and not k.values else None
        if prefixes:
            same.setdefault(prefixes, []).append(k.verl[len(prefixes[0]) :].lstrip("."))
    for (verl_prefix, ours), names in same.items():
        where = (
            f"`{ours}.` + the same name" if ours else "the same name" + (" without the prefix" if verl_prefix else "")
        )
        keys = ", ".join(f"`{n}`" for n in names)
        lines.append(f"| {f'`{verl_prefix}.` + ' if verl_prefix else ''}{keys} | {where} | |")
    listed = {f"{p}.{n}".lstrip(".") for (p, _), names in same.items() for n in names}
    for k in VERL_KEYS:
        if k.to and k.verl not in listed:
            lines.append(f"| `{k.verl}` | `{k.to}` | {k.note} |")
    for k in VERL_KEYS:
        if k.only:
            lines.append(f"| `{k.verl}` | only `{k.only[0]}`, ignored | {k.note} |")
    reasons: dict[str, list[str]] = {}
    for k in VERL_KEYS:
        if k.to is None and not k.only:
            reasons.setdefault(k.note, []).append(k.verl)
    for reason, keys in reasons.items():
        lines.append(f"| {', '.join(f'`{v}`' for v in keys)} | ignored | {reason} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m recipes.from_verl", description=__doc__.split("\n")[0])
    parser.add_argument("--run", action="store_true", help="run the lorarl command")
    parser.add_argument("--model", help="conf/model preset, when the model path matches none")
    parser.add_argument("--data", help="conf/data preset (default: math when a train file names math, else gsm8k)")
    parser.add_argument("verl", nargs="+", help="verl overrides, or one verl launch script (.sh)")
    ns = parser.parse_args(argv)
    try:
        verl_args = script_args(Path(ns.verl[0])) if len(ns.verl) == 1 and ns.verl[0].endswith(".sh") else ns.verl
        result = translate(verl_args, model=ns.model, data=ns.data)
    except VerlTranslationError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for key, value, reason in result.ignored:
        print(f"# ignored {key}={value}: {reason}", file=sys.stderr)
    cmd = result.command() + extra
    print(shlex.join(["python", *cmd[1:]]))
    if ns.run:
        return subprocess.run(cmd, cwd=ROOT).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
