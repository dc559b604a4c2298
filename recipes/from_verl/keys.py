"""The one table of verl keys: each mapped to a lorarl key, ignored with a reason, or accepted
only with the values lorarl implements (any other value is refused with the reason).

The rows that carry a value are written here; the rows of keys lorarl does not use live in
ignored_keys.yaml, grouped by reason. A row whose verl name ends in `.*` covers that key and
every key under it; `to` ending in `.*` carries the rest of the name over. The README's
"Coming from verl" table is generated from VERL_KEYS (recipes.from_verl.table), and tests check
that every key of verl's published launch scripts (recipes/verl_data/script_keys.json) and of
verl's trainer configs in every release named (recipes.from_verl.releases) has a row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

A = "actor_rollout_ref."

ENGINE_ARG = "a vLLM engine argument, passed as given"
# The rows of the keys lorarl does not use, grouped by reason (loaded by ignored_rows()).
IGNORED_KEYS = Path(__file__).with_name("ignored_keys.yaml")


@dataclass(frozen=True)
class Key:
    """One verl key. `to` is the lorarl key (None: not used, `note` says why). `only` lists the
    values lorarl accepts (as verl writes them); any other value is refused with `note`. `values`
    renames values on the way (a closed set); `convert` rewrites any value. `backend` names the
    verl config whose default this row carries (None: both). `decisive`: a refused value means
    lorarl cannot train the launch at all, so its problem is reported first."""

    verl: str
    to: str | None
    note: str = ""
    only: tuple[str, ...] = ()
    values: dict[str, str] = field(default_factory=dict)
    convert: Callable[[str], str] | None = None
    backend: str | None = None
    decisive: bool = False


def _warmup(value: str) -> str:
    return "0" if value.strip() in ("-1", "null", "None") else value


def _expert_parallel(value: str) -> str:
    return "true" if int(value) > 1 else "false"


MODEL_KEYS = (
    Key(A + "model.path", "model.path"),
    Key(A + "model.lora_rank", "model.lora.rank", "0 (verl's default) is full fine-tuning, refused", backend="fsdp"),
    Key(A + "model.lora_alpha", "model.lora.alpha", backend="fsdp"),
    Key(A + "model.target_modules", "model.lora.target_modules", backend="fsdp"),
    Key(A + "model.lora.rank", "model.lora.rank", backend="megatron"),
    Key(A + "model.lora.alpha", "model.lora.alpha", backend="megatron"),
    Key(A + "model.lora.dropout", "model.lora.dropout"),
    Key(A + "model.lora.target_modules", "model.lora.target_modules", backend="megatron"),
    Key(A + "model.lora.target_parameters", "model.lora.target_parameters"),
    Key(A + "model.lora.type", "model.lora.type"),
    Key(A + "model.lora.lora_A_init_method", "model.lora.init_A"),
    Key(A + "model.lora.merge", "model.lora.merge"),
    Key(A + "model.enable_gradient_checkpointing", "model.enable_gradient_checkpointing"),
    Key(A + "model.trust_remote_code", "model.trust_remote_code"),
    Key(A + "model.torch_dtype", "model.dtype"),
    Key(A + "model.use_liger", "backend.liger_kernel", "null (default) = on when training on CUDA"),
)

ACTOR_KEYS = (
    Key(
        A + "actor.strategy",
        "+backend",
        "fsdp / fsdp2 -> +backend=fsdp, megatron -> +backend=megatron",
        values={"fsdp": "fsdp", "fsdp2": "fsdp", "megatron": "megatron"},
    ),
    Key(A + "actor.optim.lr", "actor.optim.lr"),
    Key(A + "actor.optim.weight_decay", "actor.optim.weight_decay"),
    Key(A + "actor.optim.betas", "actor.optim.betas"),
    Key(
        A + "actor.optim.lr_warmup_steps", "actor.optim.warmup_steps", "verl's -1 (use the ratio) -> 0", convert=_warmup
    ),
    Key(
        A + "actor.optim.lr_warmup_steps_ratio",
        "actor.optim.warmup_steps",
        "x trainer.total_training_steps, as verl computes it (with lr_warmup_steps unset); warmup is counted in steps",
    ),
    Key(A + "actor.optim.clip_grad", "actor.grad_clip"),
    Key(A + "actor.ppo_mini_batch_size", "actor.ppo_mini_batch_size"),
    Key(A + "actor.ppo_micro_batch_size_per_gpu", "actor.ppo_micro_batch_size_per_gpu"),
    Key(
        A + "actor.ppo_micro_batch_size",
        "actor.ppo_micro_batch_size_per_gpu",
        "global: divided by the data-parallel size, as verl does",
    ),
    Key(A + "actor.use_dynamic_bsz", "actor.use_dynamic_bsz"),
    Key(A + "actor.ppo_max_token_len_per_gpu", "actor.ppo_max_token_len_per_gpu"),
    Key(A + "actor.ppo_epochs", "actor.ppo_epochs"),
    Key(A + "actor.clip_ratio", "actor.clip_ratio"),
    Key(A + "actor.clip_ratio_low", "actor.clip_ratio_low"),
    Key(A + "actor.clip_ratio_high", "actor.clip_ratio_high"),
    Key(A + "actor.clip_ratio_c", "actor.clip_ratio_c", "not passed under GSPO, whose loss ignores it in verl"),
    Key(A + "actor.entropy_coeff", "actor.entropy_coeff"),
    Key(A + "actor.use_kl_loss", "actor.use_kl_loss"),
    Key(A + "actor.kl_loss_coef", "actor.kl_loss_coef"),
    Key(A + "actor.kl_loss_type", "actor.kl_loss_type"),
    Key(A + "actor.loss_agg_mode", "actor.loss_agg_mode", "GSPO: seq-mean-token-mean, what verl's GSPO loss uses"),
    Key(A + "actor.policy_loss.loss_mode", "actor.policy_loss", "vanilla or gspo", only=("vanilla", "gspo")),
    Key(A + "actor.loss_scale_factor", "actor.loss_scale_factor"),
    Key(A + "actor.grad_clip", "actor.grad_clip"),
    Key(A + "actor.use_torch_compile", "backend.compile"),
    Key(A + "actor.fsdp_config.param_offload", "backend.param_offload"),
    Key(A + "actor.fsdp_config.optimizer_offload", "backend.optimizer_offload"),
    Key(A + "actor.fsdp_config.reshard_after_forward", "backend.reshard_after_forward"),
    Key(A + "actor.megatron.tensor_model_parallel_size", "backend.tensor_model_parallel_size"),
    Key(A + "actor.megatron.pipeline_model_parallel_size", "backend.pipeline_model_parallel_size"),
    Key(A + "actor.megatron.expert_model_parallel_size", "backend.expert_model_parallel_size"),
    Key(A + "actor.megatron.expert_tensor_parallel_size", "backend.expert_tensor_parallel_size"),
    Key(A + "actor.megatron.sequence_parallel", "backend.sequence_parallel", "verl's true applies when TP > 1"),
    Key(A + "actor.megatron.use_distributed_optimizer", "backend.use_distributed_optimizer"),
    Key(A + "actor.megatron.override_transformer_config.recompute_method", "backend.recompute_method"),
    Key(A + "actor.megatron.override_transformer_config.recompute_granularity", "backend.recompute_granularity"),
    Key(A + "actor.megatron.override_transformer_config.recompute_num_layers", "backend.recompute_num_layers"),
    Key(
        A + "actor.megatron.override_transformer_config.*",
        "+backend.override_transformer_config.*",
        "a TransformerConfig field, passed as given",
    ),
)

ROLLOUT_KEYS = (
    Key(
        A + "ref.log_prob_max_token_len_per_gpu",
        "actor.log_prob_max_token_len_per_gpu",
        "one budget for both passes: the smaller of the two when both are set",
    ),  # fmt: skip
    Key(A + "rollout.n", "rollout.n"),
    Key(A + "rollout.temperature", "rollout.temperature"),
    Key(A + "rollout.top_p", "rollout.top_p"),
    Key(A + "rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    Key(A + "rollout.tensor_model_parallel_size", "rollout.tensor_model_parallel_size"),
    Key(A + "rollout.expert_parallel_size", "rollout.enable_expert_parallel", "> 1 -> true", convert=_expert_parallel),
    Key(A + "rollout.load_format", "rollout.load_format"),
    Key(A + "rollout.layered_summon", "rollout.layered_summon"),
    Key(A + "rollout.enforce_eager", "rollout.enforce_eager", "lorarl's null = CUDA graphs on GPU"),
    Key(A + "rollout.free_cache_engine", "rollout.free_cache_engine", "lorarl's null = sleep only when needed"),
    Key(A + "rollout.dtype", "rollout.dtype"),
    Key(A + "rollout.max_model_len", "rollout.max_model_len"),
    Key(
        A + "rollout.log_prob_max_token_len_per_gpu",
        "actor.log_prob_max_token_len_per_gpu",
        "one budget for both passes: the smaller of the two when both are set",
    ),  # fmt: skip
    Key(A + "rollout.max_num_seqs", "+rollout.engine_kwargs.max_num_seqs", ENGINE_ARG),
    Key(A + "rollout.max_num_batched_tokens", "+rollout.engine_kwargs.max_num_batched_tokens", ENGINE_ARG),
    Key(A + "rollout.enable_chunked_prefill", "+rollout.engine_kwargs.enable_chunked_prefill", ENGINE_ARG),
    Key(A + "rollout.enable_prefix_caching", "+rollout.engine_kwargs.enable_prefix_caching", ENGINE_ARG),
    Key(A + "rollout.disable_log_stats", "+rollout.engine_kwargs.disable_log_stats", ENGINE_ARG),
    Key(A + "rollout.engine_kwargs.vllm.*", "+rollout.engine_kwargs.*", ENGINE_ARG + ", any of them by vLLM's name"),
    Key(A + "rollout.val_kwargs.n", "rollout.val_kwargs.n"),
    Key(A + "rollout.val_kwargs.temperature", "rollout.val_kwargs.temperature"),
    Key(A + "rollout.val_kwargs.top_p", "rollout.val_kwargs.top_p"),
    Key(A + "rollout.val_kwargs.do_sample", "rollout.val_kwargs.do_sample"),
)

DATA_KEYS = (
    Key("data.train_files", "data.train_files"),
    Key("data.val_files", "data.val_files"),
    Key("data.train_batch_size", "data.train_batch_size"),
    Key("data.gen_batch_size", "data.gen_batch_size"),
    Key("data.max_prompt_length", "data.max_prompt_length"),
    Key("data.max_response_length", "data.max_response_length"),
    # After data's own rows, so a default carried is stated under data's key.
    Key(A + "rollout.prompt_length", "data.max_prompt_length", "verl's follows data.max_prompt_length"),
    Key(A + "rollout.response_length", "data.max_response_length", "verl's follows data.max_response_length"),
    Key("data.filter_overlong_prompts", "data.filter_overlong_prompts"),
    Key("data.truncation", "data.truncation"),
    Key("data.shuffle", "data.shuffle"),
)

ALGORITHM_KEYS = (
    Key(
        "algorithm.adv_estimator",
        "algorithm.adv_estimator",
        "GRPO; verl's default gae (PPO with a critic) is refused",
        only=("grpo",),
        decisive=True,
    ),  # fmt: skip
    Key("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std_in_grpo"),
    Key("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward", only=("False", "false")),
    Key("algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is"),
    Key("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rollout_correction.rollout_is_threshold"),
    Key(
        "algorithm.rollout_correction.rollout_is_batch_normalize",
        "algorithm.rollout_correction.rollout_is_batch_normalize",
    ),
    Key("algorithm.rollout_correction.rollout_rs", "algorithm.rollout_correction.rollout_rs"),
    Key("algorithm.rollout_correction.rollout_rs_threshold", "algorithm.rollout_correction.rollout_rs_threshold"),
    Key("algorithm.rollout_correction.bypass_mode", "algorithm.rollout_correction.bypass_mode"),
    Key("algorithm.filter_groups.enable", "algorithm.filter_groups.enable"),
    Key("algorithm.filter_groups.metric", "algorithm.filter_groups.metric"),
    Key("algorithm.filter_groups.max_num_gen_batches", "algorithm.filter_groups.max_num_gen_batches"),
)

REWARD_KEYS = (
    Key("reward_model.reward_kwargs.overlong_buffer_cfg.enable", "algorithm.overlong_buffer.enable"),
    Key("reward_model.reward_kwargs.overlong_buffer_cfg.len", "algorithm.overlong_buffer.len"),
    Key("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor", "algorithm.overlong_buffer.penalty_factor"),
    Key("reward.reward_kwargs.overlong_buffer_cfg.enable", "algorithm.overlong_buffer.enable"),
    Key("reward.reward_kwargs.overlong_buffer_cfg.len", "algorithm.overlong_buffer.len"),
    Key("reward.reward_kwargs.overlong_buffer_cfg.penalty_factor", "algorithm.overlong_buffer.penalty_factor"),
    Key("reward_model.overlong_buffer.enable", "algorithm.overlong_buffer.enable"),
    Key("reward_model.overlong_buffer.len", "algorithm.overlong_buffer.len"),
    Key("reward_model.overlong_buffer.penalty_factor", "algorithm.overlong_buffer.penalty_factor"),
    Key(
        "custom_reward_function.path",
        "data.reward_fn",
        "data.reward_fn=PATH:NAME (a relative PATH made absolute); lorarl runs the file and calls NAME as verl does",
    ),
    Key("custom_reward_function.name", "data.reward_fn", "verl's compute_score by default; used with the path only"),
    Key("custom_reward_function.reward_kwargs.*", "+data.reward_kwargs.*", "keyword arguments of the reward function"),
)

TRAINER_KEYS = (
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
)


def ignored_rows(path: Path = IGNORED_KEYS) -> tuple[Key, ...]:
    """ignored_keys.yaml as rows: each entry's keys with its reason, accepted values and weight."""
    rows = []
    for entry in yaml.safe_load(path.read_text()):
        only = tuple(str(v) for v in entry.get("only", ()))
        rows += [Key(k, None, entry["why"], only=only, decisive=entry.get("decisive", False)) for k in entry["keys"]]
    return tuple(rows)


VERL_KEYS: tuple[Key, ...] = (
    MODEL_KEYS + ACTOR_KEYS + ROLLOUT_KEYS + DATA_KEYS + ALGORITHM_KEYS + REWARD_KEYS + TRAINER_KEYS + ignored_rows()
)
BY_VERL = {k.verl: k for k in VERL_KEYS}
# Families, longest prefix first so `rollout.engine_kwargs.vllm.*` wins over `rollout.engine_kwargs.*`.
FAMILIES = sorted((k for k in VERL_KEYS if k.verl.endswith(".*")), key=lambda k: -len(k.verl))
# Every section of verl's config names its Python class in `_target_`.
TARGET = BY_VERL["*._target_"]


def verl_row(key: str) -> tuple[Key | None, str | None]:
    """The VERL_KEYS row for a verl key and the lorarl key it maps to (None: not used, or unknown).
    A family `x.*` covers `x` itself too (verl takes a whole mapping there: x={a: 1})."""
    row = BY_VERL.get(key)
    if row is not None:
        return row, row.to
    if key.endswith("._target_"):
        return TARGET, None
    for family in FAMILIES:
        prefix = family.verl[:-1]
        if key.startswith(prefix) and len(key) > len(prefix):
            return family, family.to[:-1] + key[len(prefix) :] if family.to else None
        if key == prefix[:-1]:  # the whole mapping replaces lorarl's, so no `+`
            return family, family.to.lstrip("+")[:-2] if family.to else None
    return None, None
