"""The one table of verl keys: each mapped to a lorarl key, ignored with a reason, or accepted
only with the values lorarl implements (any other value is refused with the reason).

A row whose verl name ends in `.*` covers every key under that prefix; `to` ending in `.*`
carries the rest of the name over. The README's "Coming from verl" table is generated from
VERL_KEYS (recipes.from_verl.table), and tests check every key of verl's published launch
scripts (recipes/verl_data/script_keys.json) has a row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

A = "actor_rollout_ref."

# Reasons shared by several rows.
NO_REF = "no separate reference model: the reference is the actor with its adapter disabled"
ON_POLICY = (
    "passes without backward follow the actor's batching (actor.log_prob_max_token_len_per_gpu "
    "under use_dynamic_bsz); on-policy, the old log-probs are the update's own forward"
)
NO_CRITIC = "GRPO trains no critic (algorithm.adv_estimator=gae is refused)"
NO_AGENT = "no agent loop or server: each worker hands token ids to its in-process vLLM engine"
CHECKPOINT = "a checkpoint always holds what a resume needs (lorarl.checkpoint)"
ENGINE_ARG = "a vLLM engine argument, passed as given"
PROFILER = "verl's profiler; lorarl logs step timings (wrap the run in nsys or torch.profiler for traces)"
OFFLOAD = "memory placement only: the frozen base stays on the GPU and the optimizer state is adapter-sized"
FUSED = "log-probs and entropy always come from one fused pass"
NO_REWARD_MODEL = "a reward model's settings; rewards are rule-based (reward_model.enable=true is refused)"
OTHER_ENGINE = "arguments of another rollout engine; the rollout engine is vLLM"
MULTI_TURN = "multi-turn rollouts: used only with rollout.multi_turn.enable=true, which is refused"
IN_REWARD_KL = "the in-reward KL controller; the KL here is actor.kl_loss_coef"
FSDP_LAYOUT = "FSDP2 wraps each decoder layer; the base is held in model.dtype, the adapter in float32"
GAE = "GAE's discount and lambda; GRPO advantages are normalised within each prompt's group"
WEIGHT_SYNC = "weights sync as a LoRA adapter after every step"
TOP_K_OFF = "top-k sampling: lorarl samples without it (verl's -1 or 0 means off)"


@dataclass(frozen=True)
class Key:
    """One verl key. `to` is the lorarl key (None: not used, `note` says why). `only` lists the
    values lorarl accepts (as verl writes them); any other value is refused with `note`. `values`
    renames values on the way (a closed set); `convert` rewrites any value. `backend` names the
    verl config whose default this row carries (None: both)."""

    verl: str
    to: str | None
    note: str = ""
    only: tuple[str, ...] = ()
    values: dict[str, str] = field(default_factory=dict)
    convert: Callable[[str], str] | None = None
    backend: str | None = None


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
    Key(A + "model.use_remove_padding", None, "micro-batches are cut by tokens and all-padding columns trimmed"),
    Key(A + "model.use_shm", None, "the model is read from model.path as given"),
    Key(A + "model.use_fused_kernels", None, FUSED),
    Key(A + "model.fused_kernel_options.*", None, FUSED),
    Key(A + "model.enable_activation_offload", None, OFFLOAD),
    Key(
        A + "model.override_config.*",
        None,
        "HF config overrides: Qwen's dropouts are 0 already, and sequences "
        "are bounded by data.max_prompt_length + data.max_response_length",
    ),  # fmt: skip
    Key(A + "model.exclude_modules", None, "name the adapted modules in model.lora.target_modules", only=("null",)),
    Key(A + "model.lora_adapter_path", None, "training starts from a fresh adapter", only=("null",)),
    Key(A + "model.mtp.enable", None, "no multi-token prediction head is trained", only=("False", "false")),
    Key(A + "model.mtp.*", None, "multi-token prediction: used only with model.mtp.enable=true, which is refused"),
    Key(A + "hybrid_engine", None, "training and rollout are always colocated", only=("True", "true")),
    Key(A + "nccl_timeout", None, "process-group timeouts are lorarl's own"),
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
    Key(A + "actor.optim.lr_scheduler_type", None, "the learning rate is constant after warmup", only=("constant",)),
    Key(A + "actor.optim.lr_decay_style", None, "the learning rate is constant after warmup", only=("constant",)),
    Key(A + "actor.optim.override_optimizer_config.*", None, OFFLOAD),
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
    Key(A + "actor.shuffle", None, "mini-batches keep the rollout's order", only=("False", "false")),
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
    Key(A + "actor.policy_loss.*", None, "parameters of policy losses other than vanilla and gspo (refused)"),
    Key(A + "actor.tau_pos", None, "SAPO's parameters (policy_loss.loss_mode=sapo is refused)"),
    Key(A + "actor.tau_neg", None, "SAPO's parameters (policy_loss.loss_mode=sapo is refused)"),
    Key(A + "actor.loss_scale_factor", "actor.loss_scale_factor"),
    Key(A + "actor.grad_clip", "actor.grad_clip"),
    Key(A + "actor.use_torch_compile", "backend.compile"),
    Key(A + "actor.calculate_entropy", None, FUSED),
    Key(A + "actor.calculate_sum_pi_squared", None, FUSED),
    Key(A + "actor.entropy_checkpointing", None, FUSED),
    Key(A + "actor.entropy_from_logits_with_chunking", None, FUSED),
    Key(A + "actor.use_prefix_grouper", None, "each sequence is its own row", only=("False", "false")),
    Key(A + "actor.freeze_vision_tower", None, "text models only"),
    Key(A + "actor.router_replay.mode", None, "MoE routing is recomputed in the update", only=("disabled",)),
    Key(
        A + "actor.ulysses_sequence_parallel_size",
        None,
        "no sequence parallelism: each device holds whole sequences, its activation memory grows by this factor",
    ),  # fmt: skip
    Key(A + "actor.fsdp_config.param_offload", "backend.param_offload"),
    Key(A + "actor.fsdp_config.optimizer_offload", "backend.optimizer_offload"),
    Key(A + "actor.fsdp_config.reshard_after_forward", "backend.reshard_after_forward"),
    Key(
        A + "actor.fsdp_config.fsdp_size",
        None,
        "the sharding group's size changes memory only; FSDP shards over every worker",
    ),  # fmt: skip
    Key(A + "actor.fsdp_config.*", None, FSDP_LAYOUT),
    Key(A + "actor.megatron.tensor_model_parallel_size", "backend.tensor_model_parallel_size"),
    Key(A + "actor.megatron.pipeline_model_parallel_size", "backend.pipeline_model_parallel_size"),
    Key(A + "actor.megatron.expert_model_parallel_size", "backend.expert_model_parallel_size"),
    Key(A + "actor.megatron.expert_tensor_parallel_size", "backend.expert_tensor_parallel_size"),
    Key(A + "actor.megatron.sequence_parallel", "backend.sequence_parallel", "verl's true applies when TP > 1"),
    Key(A + "actor.megatron.use_distributed_optimizer", "backend.use_distributed_optimizer"),
    Key(A + "actor.megatron.use_mbridge", None, "a bridge is always used (backend.bridge)", only=("True", "true")),
    Key(
        A + "actor.megatron.vanilla_mbridge",
        None,
        "LoRA is exported through Megatron-Bridge (backend.bridge=megatron_bridge); vanilla mbridge has no adapter export",
        only=("False", "false"),
    ),
    Key(
        A + "actor.megatron.context_parallel_size",
        None,
        "no context parallelism: each device holds whole sequences, its activation memory grows by this factor",
    ),  # fmt: skip
    Key(
        A + "actor.megatron.override_transformer_config.context_parallel_size",
        None,
        "no context parallelism: each device holds whole sequences (--check prints the estimate)",
    ),  # fmt: skip
    Key(
        A + "actor.megatron.virtual_pipeline_model_parallel_size",
        None,
        "no interleaved pipeline schedule: the same math with larger pipeline bubbles",
    ),  # fmt: skip
    Key(A + "actor.megatron.override_transformer_config.recompute_method", "backend.recompute_method"),
    Key(A + "actor.megatron.override_transformer_config.recompute_granularity", "backend.recompute_granularity"),
    Key(A + "actor.megatron.override_transformer_config.recompute_num_layers", "backend.recompute_num_layers"),
    Key(
        A + "actor.megatron.override_transformer_config.*",
        "+backend.override_transformer_config.*",
        "a TransformerConfig field, passed as given",
    ),
    Key(A + "actor.megatron.param_offload", None, OFFLOAD),
    Key(A + "actor.megatron.grad_offload", None, OFFLOAD),
    Key(A + "actor.megatron.optimizer_offload", None, OFFLOAD),
    Key(A + "actor.megatron.use_dist_checkpointing", None, "the base is read from model.path through the bridge"),
    Key(A + "actor.megatron.dist_checkpointing_path", None, "the base is read from model.path through the bridge"),
    Key(A + "actor.megatron.*", None, "Megatron settings lorarl derives itself (dtype from model.dtype, its own seed)"),
    Key(A + "actor.checkpoint.*", None, CHECKPOINT),
    Key(A + "actor.profiler.*", None, PROFILER),
)

ROLLOUT_KEYS = (
    Key(
        A + "ref.log_prob_max_token_len_per_gpu",
        "actor.log_prob_max_token_len_per_gpu",
        "one budget for both passes: the smaller of the two when both are set",
    ),  # fmt: skip
    Key(A + "ref.log_prob_micro_batch_size_per_gpu", None, ON_POLICY),
    Key(A + "ref.log_prob_micro_batch_size", None, ON_POLICY),
    Key(A + "ref.log_prob_use_dynamic_bsz", None, ON_POLICY),
    Key(A + "ref.profiler.*", None, PROFILER),
    Key(A + "ref.*", None, NO_REF),
    Key(A + "rollout.name", None, "the rollout engine is vLLM", only=("vllm",)),
    Key(A + "rollout.mode", None, NO_AGENT),
    Key(A + "rollout.n", "rollout.n"),
    Key(A + "rollout.temperature", "rollout.temperature"),
    Key(A + "rollout.top_p", "rollout.top_p"),
    Key(A + "rollout.top_k", None, TOP_K_OFF, only=("-1", "0")),
    Key(A + "rollout.ignore_eos", None, "sampling stops at EOS", only=("False", "false")),
    Key(A + "rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    Key(A + "rollout.tensor_model_parallel_size", "rollout.tensor_model_parallel_size"),
    Key(A + "rollout.expert_parallel_size", "rollout.enable_expert_parallel", "> 1 -> true", convert=_expert_parallel),
    Key(A + "rollout.data_parallel_size", None, "one vLLM engine per rollout.tensor_model_parallel_size workers"),
    Key(A + "rollout.load_format", "rollout.load_format"),
    Key(A + "rollout.layered_summon", "rollout.layered_summon"),
    Key(A + "rollout.enforce_eager", "rollout.enforce_eager", "lorarl's null = CUDA graphs on GPU"),
    Key(A + "rollout.free_cache_engine", "rollout.free_cache_engine", "lorarl's null = sleep only when needed"),
    Key(A + "rollout.multi_stage_wake_up", None, "the engine's sleep is planned by memory (rollout.free_cache_engine)"),
    Key(A + "rollout.dtype", "rollout.dtype"),
    Key(A + "rollout.max_model_len", "rollout.max_model_len"),
    Key(
        A + "rollout.log_prob_max_token_len_per_gpu",
        "actor.log_prob_max_token_len_per_gpu",
        "one budget for both passes: the smaller of the two when both are set",
    ),  # fmt: skip
    Key(A + "rollout.log_prob_micro_batch_size_per_gpu", None, ON_POLICY),
    Key(A + "rollout.log_prob_micro_batch_size", None, ON_POLICY),
    Key(A + "rollout.log_prob_use_dynamic_bsz", None, ON_POLICY),
    Key(A + "rollout.calculate_log_probs", None, "the sampler's log-probs are always kept"),
    Key(A + "rollout.max_num_seqs", "+rollout.engine_kwargs.max_num_seqs", ENGINE_ARG),
    Key(A + "rollout.max_num_batched_tokens", "+rollout.engine_kwargs.max_num_batched_tokens", ENGINE_ARG),
    Key(A + "rollout.enable_chunked_prefill", "+rollout.engine_kwargs.enable_chunked_prefill", ENGINE_ARG),
    Key(A + "rollout.enable_prefix_caching", "+rollout.engine_kwargs.enable_prefix_caching", ENGINE_ARG),
    Key(A + "rollout.disable_log_stats", "+rollout.engine_kwargs.disable_log_stats", ENGINE_ARG),
    Key(A + "rollout.engine_kwargs.vllm.*", "+rollout.engine_kwargs.*", ENGINE_ARG + ", any of them by vLLM's name"),
    Key(A + "rollout.engine_kwargs.*", None, OTHER_ENGINE),
    Key(A + "rollout.skip_tokenizer_init", None, NO_AGENT),
    Key(A + "rollout.agent.*", None, NO_AGENT),
    Key(A + "rollout.trace.*", None, NO_AGENT),
    Key(A + "rollout.prometheus.*", None, "vLLM's metrics server is not started"),
    Key(A + "rollout.checkpoint_engine.*", None, WEIGHT_SYNC),
    Key(
        A + "rollout.enable_rollout_routing_replay",
        None,
        "MoE routing is recomputed in the update",
        only=("False", "false"),
    ),  # fmt: skip
    Key(A + "rollout.over_sample_rate", None, "every sampled response is kept", only=("0", "0.0")),
    Key(A + "rollout.multi_turn.enable", None, "single-turn rollouts only", only=("False", "false")),
    Key(A + "rollout.multi_turn.*", None, MULTI_TURN),
    Key(A + "rollout.val_kwargs.n", "rollout.val_kwargs.n"),
    Key(A + "rollout.val_kwargs.temperature", "rollout.val_kwargs.temperature"),
    Key(A + "rollout.val_kwargs.top_p", "rollout.val_kwargs.top_p"),
    Key(A + "rollout.val_kwargs.top_k", None, TOP_K_OFF, only=("-1", "0")),
    Key(A + "rollout.val_kwargs.do_sample", "rollout.val_kwargs.do_sample"),
)

DATA_KEYS = (
    Key("data.train_files", "data.train_files"),
    Key("data.val_files", "data.val_files"),
    Key("data.train_batch_size", "data.train_batch_size"),
    Key("data.gen_batch_size", "data.gen_batch_size"),
    Key("data.max_prompt_length", "data.max_prompt_length"),
    Key("data.max_response_length", "data.max_response_length"),
    Key("data.filter_overlong_prompts", "data.filter_overlong_prompts"),
    Key("data.truncation", "data.truncation"),
    Key("data.shuffle", "data.shuffle"),
    Key("data.prompt_key", None, "prompts are read from verl's `prompt` column", only=("prompt",)),
    Key("data.image_key", None, "text models only: images are not read"),
    Key("data.val_batch_size", None, "validation sends every prompt to vLLM at once"),
    Key("data.return_raw_chat", None, NO_AGENT),
    Key("data.dataloader_num_workers", None, "prompts are read into memory once"),
    Key("data.filter_overlong_prompts_workers", None, "prompts are read into memory once"),
    Key("data.trust_remote_code", None, "the tokenizer follows model.trust_remote_code"),
    Key("data.min_response_length", None, "no minimum response length", only=("0",)),
    Key("data.custom_cls.path", None, "prompts are read by lorarl's dataset (verl's parquet layout)", only=("null",)),
    Key("data.custom_cls.name", None, "used only with data.custom_cls.path, which is refused"),
    Key("data.sampler.class_path", None, "prompts are drawn in (shuffled) order", only=("null",)),
    Key("data.sampler.class_name", None, "used only with data.sampler.class_path, which is refused"),
    Key("data.apply_chat_template_kwargs.*", None, "the tokenizer's chat template is applied with its defaults"),
)

ALGORITHM_KEYS = (
    Key(
        "algorithm.adv_estimator",
        "algorithm.adv_estimator",
        "GRPO; verl's default gae (PPO with a critic) is refused",
        only=("grpo",),
    ),  # fmt: skip
    Key("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std_in_grpo"),
    Key("algorithm.use_kl_in_reward", "algorithm.use_kl_in_reward", only=("False", "false")),
    Key("algorithm.kl_ctrl.*", None, IN_REWARD_KL),
    Key("algorithm.kl_penalty", None, IN_REWARD_KL),
    Key("algorithm.gamma", None, GAE),
    Key("algorithm.lam", None, GAE),
    Key("algorithm.use_pf_ppo", None, "batches are not reweighted by reward", only=("False", "false")),
    Key("algorithm.pf_ppo.*", None, "used only with algorithm.use_pf_ppo=true, which is refused"),
    Key("algorithm.rollout_correction.rollout_is", "algorithm.rollout_correction.rollout_is"),
    Key("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rollout_correction.rollout_is_threshold"),
    Key(
        "algorithm.rollout_correction.rollout_is_batch_normalize",
        "algorithm.rollout_correction.rollout_is_batch_normalize",
    ),
    Key("algorithm.rollout_correction.rollout_rs", "algorithm.rollout_correction.rollout_rs"),
    Key("algorithm.rollout_correction.rollout_rs_threshold", "algorithm.rollout_correction.rollout_rs_threshold"),
    Key(
        "algorithm.rollout_correction.rollout_rs_threshold_lower",
        None,
        "give the band in one value, rollout_rs_threshold=LOWER_UPPER",
        only=("null",),
    ),  # fmt: skip
    Key(
        "algorithm.rollout_correction.rollout_token_veto_threshold",
        None,
        "no per-token veto; reject with rollout_rs",
        only=("null",),
    ),  # fmt: skip
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
)

REWARD_KEYS = (
    Key("reward_model.enable", None, "rewards are rule-based (data_source or data.reward_fn)", only=("False", "false")),
    Key(
        "reward_model.reward_manager",
        None,
        "rewards are scored per sample; DAPO's overlong penalty is algorithm.overlong_buffer",
        only=("naive", "dapo"),
    ),  # fmt: skip
    Key(
        "reward.reward_manager.name",
        None,
        "rewards are scored per sample; DAPO's overlong penalty is algorithm.overlong_buffer",
        only=("naive", "dapo"),
    ),  # fmt: skip
    Key("reward_model.reward_kwargs.overlong_buffer_cfg.enable", "algorithm.overlong_buffer.enable"),
    Key("reward_model.reward_kwargs.overlong_buffer_cfg.len", "algorithm.overlong_buffer.len"),
    Key("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor", "algorithm.overlong_buffer.penalty_factor"),
    Key("reward.reward_kwargs.overlong_buffer_cfg.enable", "algorithm.overlong_buffer.enable"),
    Key("reward.reward_kwargs.overlong_buffer_cfg.len", "algorithm.overlong_buffer.len"),
    Key("reward.reward_kwargs.overlong_buffer_cfg.penalty_factor", "algorithm.overlong_buffer.penalty_factor"),
    Key("reward_model.overlong_buffer.enable", "algorithm.overlong_buffer.enable"),
    Key("reward_model.overlong_buffer.len", "algorithm.overlong_buffer.len"),
    Key("reward_model.overlong_buffer.penalty_factor", "algorithm.overlong_buffer.penalty_factor"),
    Key("reward_model.reward_kwargs.overlong_buffer_cfg.log", None, "the overlong penalty is logged every step"),
    Key("reward.reward_kwargs.overlong_buffer_cfg.log", None, "the overlong penalty is logged every step"),
    Key("reward_model.overlong_buffer.log", None, "the overlong penalty is logged every step"),
    Key(
        "reward_model.reward_kwargs.max_resp_len", None, "the overlong penalty counts against data.max_response_length"
    ),
    Key("reward.reward_kwargs.max_resp_len", None, "the overlong penalty counts against data.max_response_length"),
    Key("reward_model.*", None, NO_REWARD_MODEL),
    Key(
        "custom_reward_function.path",
        None,
        "lorarl imports a scorer as data.reward_fn=package.module:function: put "
        "the file on PYTHONPATH and append `-- data.reward_fn=module:name`",
        only=("null",),
    ),  # fmt: skip
    Key("custom_reward_function.name", None, "used only with custom_reward_function.path"),
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
    Key(
        "trainer.resume_from_path",
        None,
        "resume from a lorarl checkpoint in the run folder (trainer.resume_mode)",
        only=("null",),
    ),  # fmt: skip
    Key("trainer.max_actor_ckpt_to_keep", "trainer.max_ckpt_to_keep"),
    Key("trainer.log_val_generations", None, "validation logs scores, not generations"),
    Key("trainer.critic_warmup", None, NO_CRITIC),
    Key("trainer.max_critic_ckpt_to_keep", None, NO_CRITIC),
    Key("trainer.use_legacy_worker_impl", None, "one worker implementation"),
    Key("trainer.balance_batch", None, "prompt groups are split contiguously; micro-batches are cut by tokens"),
    Key("critic.*", None, NO_CRITIC),
    Key("global_profiler.*", None, PROFILER),
)

VERL_KEYS: tuple[Key, ...] = (
    MODEL_KEYS + ACTOR_KEYS + ROLLOUT_KEYS + DATA_KEYS + ALGORITHM_KEYS + REWARD_KEYS + TRAINER_KEYS
)
BY_VERL = {k.verl: k for k in VERL_KEYS}
# Families, longest prefix first so `rollout.engine_kwargs.vllm.*` wins over `rollout.engine_kwargs.*`.
FAMILIES = sorted((k for k in VERL_KEYS if k.verl.endswith(".*")), key=lambda k: -len(k.verl))


def verl_row(key: str) -> tuple[Key | None, str | None]:
    """The VERL_KEYS row for a verl key and the lorarl key it maps to (None: not used, or unknown)."""
    row = BY_VERL.get(key)
    if row is not None:
        return row, row.to
    for family in FAMILIES:
        prefix = family.verl[:-1]
        if key.startswith(prefix) and len(key) > len(prefix):
            return family, family.to[:-1] + key[len(prefix) :] if family.to else None
    return None, None
