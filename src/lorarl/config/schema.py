"""One typed schema per config group, each with the checks that need only its own keys.

The schemas say which keys exist, their types and what they mean; they hold no values. The
values live once, in the YAML groups under conf/ (tests/test_config.py fails when a schema
carries a default). Hydra merges each YAML into its schema, so a typo (`model.lora.rnak=8`)
or a wrong type fails at compose time naming the key. Checks that need several groups live in
lorarl.config.validate; the backend group's schemas in lorarl.config.backends. Every check raises
ConfigError with one line naming the key.

This module imports nothing of lorarl but its errors: everything else may import it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from lorarl.config.algorithm import AlgorithmConfig
from lorarl.errors import ConfigError, check, one_of

HF_LINEAR_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# vLLM serves LoRA on these Qwen2 modules only; embeddings and lm_head exist in PEFT but
# vLLM rejects them when the adapter is loaded ("... is unsupported LoRA weight").
VLLM_LORA_UNSUPPORTED = ("lm_head", "embed_tokens")
# vLLM's accepted `max_lora_rank` values (vllm.config.lora.MaxLoRARanks in 0.32); tests check
# this against vLLM's own list.
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# model.builder -> the architecture lorarl.models.tiny builds for it.
MODEL_BUILDERS = {"tiny_qwen2": "qwen2", "tiny_qwen3": "qwen3", "tiny_qwen3_moe": "qwen3_moe"}
# data.generator values: embedded tasks whose parquet is written on first use (lorarl.data).
DATA_GENERATORS = ("arith", "token_share")
# The names the loss functions in lorarl.algorithms dispatch on.
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("vanilla", "gspo")
KL_KINDS = ("k1", "k2", "mse", "k3", "low_var_kl")
# Megatron-Bridge's LoRA classes and A initialisations (ParallelLinearAdapter._get_init_fn; "zero" is B's).
LORA_TYPES = ("lora", "canonical_lora")
LORA_INIT_METHODS = ("xavier", "kaiming", "normal")
# trainer.sync_fault's names (a test switch; what each corrupts: lorarl.sync.faults). The send faults
# act between processes, so they need trainer.placement=split.
FAULTS = (
    "gate_up_swap",
    "expert_swap",
    "scale_x2",
    "scale_half",
    "transpose",
    "missing_module",
    "stale_layer",
    "base_as_lora",
    "qk_swap",
    "trainer_scaling",
)
SEND_FAULTS = ("drop_send", "stale_send")


def vllm_lora_rank(rank: int) -> int:
    """Smallest `max_lora_rank` vLLM accepts that holds `rank`."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ConfigError(f"model.lora.rank must be an integer, got {rank!r}")
    if rank <= 0 or rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(f"model.lora.rank={rank} is outside 1..{VLLM_LORA_RANKS[-1]}, the ranks vLLM can serve")
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


# MoE expert parameters: the fused stacks lorarl exports LoRA on (vLLM's per-expert projections
# come from them, lorarl.sync.experts), and what vLLM serves no LoRA on.
QWEN3_MOE_EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")
_UNSERVABLE = re.compile(r"(^|\.)(gate|lm_head|embed_tokens)(\.|$)")


def check_target_parameters(names) -> None:
    """One-line ConfigError for a target parameter vLLM cannot serve or lorarl cannot export."""
    for name in names:
        check(
            not _UNSERVABLE.search(name),
            f"model.lora.target_parameters contains {name!r}: vLLM serves no LoRA on the router (mlp.gate), "
            f"embeddings or lm_head; target the experts ({','.join(QWEN3_MOE_EXPERT_PARAMETERS)})",
        )
        check(
            name.rsplit(".", 1)[-1] in EXPERT_PROJECTIONS,
            f"model.lora.target_parameters contains {name!r}: lorarl exports LoRA on the fused expert "
            f"parameters {', '.join(EXPERT_PROJECTIONS)} only (e.g. {QWEN3_MOE_EXPERT_PARAMETERS[0]})",
        )


def cache_dir() -> str:
    """Where the embedded model and generated data live: $LORARL_CACHE or ~/.cache/lorarl."""
    return os.path.expanduser(os.environ.get("LORARL_CACHE") or "~/.cache/lorarl")


@dataclass
class LoraConfig:
    rank: int = MISSING
    alpha: int = MISSING
    dropout: float = MISSING
    # HF projection names (q_proj ...), "all-linear", or Megatron names (linear_qkv ...). One
    # name or a list (see lorarl.config.compose.STRING_OR_LIST_KEYS).
    target_modules: Any = MISSING
    # Stacked parameters PEFT wraps directly (its `target_parameters`): the fused MoE experts,
    # e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj] (lorarl.sync.experts). Empty for dense models.
    target_parameters: list[str] = MISSING
    # Megatron only: fused `lora` or per-projection `canonical_lora`.
    type: str = MISSING
    # Megatron only: initialisation of A (B always starts at zero).
    init_A: str = MISSING
    # true: push merged W + BA every step into a vLLM started without LoRA.
    merge: bool = MISSING

    def check(self) -> None:
        check(self.rank > 0, f"model.lora.rank={self.rank} must be > 0 (LoRA is the only training mode)")
        vllm_lora_rank(self.rank)  # raises above vLLM's largest rank
        check(self.alpha > 0, f"model.lora.alpha={self.alpha} must be > 0")
        check(0.0 <= self.dropout < 1.0, f"model.lora.dropout={self.dropout} must be in [0, 1)")
        check(
            len(self.target_modules) > 0,
            "model.lora.target_modules is empty; list modules such as q_proj,v_proj or all-linear",
        )
        for name in self.target_modules:
            check(
                name.split(".")[-1] not in VLLM_LORA_UNSUPPORTED,
                f"model.lora.target_modules contains {name!r}: vLLM cannot load LoRA on lm_head/embed_tokens; "
                f"target the linear projections ({','.join(HF_LINEAR_PROJECTIONS)})",
            )
            check(
                name.split(".")[-1] != "gate",
                f"model.lora.target_modules contains {name!r}: that is the MoE router, which vLLM serves no LoRA on; "
                "target the attention projections and the experts (model.lora.target_parameters)",
            )
        check_target_parameters(self.target_parameters)
        one_of("model.lora.type", self.type, LORA_TYPES)
        one_of("model.lora.init_A", self.init_A, LORA_INIT_METHODS)


@dataclass
class ModelConfig:
    # HF hub id or local directory.
    path: str = MISSING
    # "tiny_qwen2" | "tiny_qwen3" | "tiny_qwen3_moe": build the embedded model at `path` when it is not there yet.
    builder: str | None = MISSING
    # Training dtype of the frozen base; LoRA weights and optimizer state stay float32.
    dtype: str = MISSING
    trust_remote_code: bool = MISSING
    enable_gradient_checkpointing: bool = MISSING
    lora: LoraConfig = field(default_factory=LoraConfig)

    def check(self) -> None:
        self.lora.check()
        one_of("model.builder", self.builder, (None, *MODEL_BUILDERS))
        one_of("model.dtype", self.dtype, ("float32", "bfloat16", "float16"))


@dataclass
class DataConfig:
    # One parquet path or a list, as verl takes them (see lorarl.config.compose.STRING_OR_LIST_KEYS).
    train_files: Any = MISSING
    val_files: Any = MISSING
    # "arith" | "token_share": the files are written by that embedded task's generator when missing.
    generator: str | None = MISSING
    generator_size: int | None = MISSING
    train_batch_size: int = MISSING
    max_prompt_length: int = MISSING
    max_response_length: int = MISSING
    filter_overlong_prompts: bool = MISSING
    # error | left | right: what to do with prompts over max_prompt_length when not filtered.
    truncation: str = MISSING
    shuffle: bool = MISSING
    # "package.module:function" or "path/to/file.py[:function]" (verl's custom_reward_function: the
    # file is run, the function defaults to compute_score) scoring every sample instead of the
    # data_source registry (lorarl.rewards.custom).
    reward_fn: str | None = MISSING
    # Keyword arguments data.reward_fn is called with on top of verl's four (verl's
    # custom_reward_function.reward_kwargs).
    reward_kwargs: dict[str, Any] = MISSING
    # Prompts per generation round of DAPO dynamic sampling (oversampling); null: train_batch_size.
    gen_batch_size: int | None = MISSING

    def check(self) -> None:
        one_of("data.truncation", self.truncation, ("error", "left", "right"))
        check(self.train_batch_size > 0, f"data.train_batch_size={self.train_batch_size} must be > 0")
        check(
            self.max_prompt_length > 0 and self.max_response_length > 0,
            "data.max_prompt_length and data.max_response_length must be > 0",
        )
        one_of("data.generator", self.generator, (None, *DATA_GENERATORS))
        check(
            not self.reward_kwargs or bool(self.reward_fn),
            "data.reward_kwargs are passed to data.reward_fn only; set data.reward_fn or remove them",
        )


@dataclass
class ValKwargs:
    n: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING
    do_sample: bool = MISSING


@dataclass
class RolloutConfig:
    n: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING
    gpu_memory_utilization: float = MISSING
    tensor_model_parallel_size: int = MISSING
    # MoE models: spread the experts over the tensor-parallel ranks instead of slicing each one
    # (vLLM's enable_expert_parallel; each rank then holds and is checked on its own experts).
    enable_expert_parallel: bool = MISSING
    # auto/safetensors: vLLM reads the base from disk. dummy: random base, sent once by the trainer.
    load_format: str = MISSING
    # Export the adapter one FSDP unit at a time (needs the base already in vLLM).
    layered_summon: bool = MISSING
    # null: CUDA graphs on GPU (false), eager on CPU (true).
    enforce_eager: bool | None = MISSING
    # vLLM sleep mode during the update (GPU only). null: sleep only when the update would not
    # fit beside the awake engine (lorarl.rollout.memory estimates it; the decision is logged).
    free_cache_engine: bool | None = MISSING
    dtype: str = MISSING
    max_model_len: int | None = MISSING
    # tmpfs: PEFT folder in /dev/shm loaded by path. memory: tensors handed to vLLM directly.
    adapter_transport: str = MISSING
    # vLLM engine arguments by vLLM's names (vllm.EngineArgs), passed through as given; the
    # ones lorarl sets from its own keys are refused (lorarl.rollout.vllm.engine_args).
    engine_kwargs: dict[str, Any] = MISSING
    # trainer.placement=split: how many rollout workers (one vLLM engine and one device each) sit
    # beside the trainer's; null there means 1. Colocated, every trainer worker holds the rollout, so
    # it must stay null.
    n_workers: int | None = MISSING
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)

    def check(self) -> None:
        one_of("rollout.adapter_transport", self.adapter_transport, ("tmpfs", "memory"))
        check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]",
        )
        check(
            self.temperature > 0.0,
            f"rollout.temperature={self.temperature}: training samples must differ within a group (greedy samples "
            "are identical, so every GRPO advantage would be 0); set rollout.temperature>0 (rollout.val_kwargs for "
            "validation)",
        )
        check(0.0 < self.top_p <= 1.0, f"rollout.top_p={self.top_p} must be in (0, 1]")
        check(
            self.n >= 2,
            f"rollout.n={self.n}: GRPO compares samples of the same prompt, so with fewer than 2 every advantage "
            "is 0; set rollout.n>=2",
        )
        tp = self.tensor_model_parallel_size
        check(tp >= 1, f"rollout.tensor_model_parallel_size={tp} must be >= 1")
        check(self.n_workers is None or self.n_workers >= 1, f"rollout.n_workers={self.n_workers} must be >= 1 or null")
        check(
            not (self.layered_summon and self.load_format == "dummy"),
            "rollout.layered_summon=true exports only the adapter, so vLLM must load the base from disk: "
            "set rollout.load_format=auto (or safetensors), or rollout.layered_summon=false",
        )
        vk = self.val_kwargs
        check(vk.n >= 1, f"rollout.val_kwargs.n={vk.n} must be >= 1")
        check(
            vk.n == 1 or vk.do_sample,
            f"rollout.val_kwargs.n={vk.n} with do_sample=false would repeat one greedy answer; "
            "set rollout.val_kwargs.do_sample=true",
        )


@dataclass
class OptimConfig:
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: list[float] = MISSING
    warmup_steps: int = MISSING


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Counted in prompts, like train_batch_size; each becomes rollout.n sequences.
    ppo_mini_batch_size: int = MISSING
    # Counted in sequences per device.
    ppo_micro_batch_size_per_gpu: int = MISSING
    # true: cut micro-batches by padded tokens (ppo_max_token_len_per_gpu) instead of rows.
    use_dynamic_bsz: bool = MISSING
    ppo_max_token_len_per_gpu: int = MISSING
    # Token budget of the passes without a backward (old and reference log-probs) under
    # use_dynamic_bsz. null: twice ppo_max_token_len_per_gpu (they keep no activations).
    log_prob_max_token_len_per_gpu: int | None = MISSING
    ppo_epochs: int = MISSING
    clip_ratio: float = MISSING
    clip_ratio_low: float | None = MISSING
    clip_ratio_high: float | None = MISSING
    # Dual-clip bound for negative advantages; null disables it.
    clip_ratio_c: float | None = MISSING
    entropy_coeff: float = MISSING
    use_kl_loss: bool = MISSING
    kl_loss_coef: float = MISSING
    kl_loss_type: str = MISSING
    loss_agg_mode: str = MISSING
    # seq-mean-token-sum-norm's constant divisor; null: data.max_response_length.
    loss_scale_factor: int | None = MISSING
    # vanilla: per-token PPO ratio; gspo: one length-normalised ratio per sequence.
    policy_loss: str = MISSING
    grad_clip: float = MISSING

    def check(self) -> None:
        one_of("actor.kl_loss_type", self.kl_loss_type, KL_KINDS)
        one_of("actor.loss_agg_mode", self.loss_agg_mode, AGG_MODES)
        one_of("actor.policy_loss", self.policy_loss, POLICY_LOSSES)
        check(self.ppo_epochs >= 1, f"actor.ppo_epochs={self.ppo_epochs} must be >= 1")
        check(self.grad_clip > 0, f"actor.grad_clip={self.grad_clip} must be > 0")
        check(self.optim.lr > 0, f"actor.optim.lr={self.optim.lr} must be > 0")
        check(
            self.clip_ratio_c is None or self.clip_ratio_c > 1.0,
            f"actor.clip_ratio_c={self.clip_ratio_c} must be > 1 (dual clip) or null",
        )
        check(
            self.loss_scale_factor is None or self.loss_scale_factor > 0,
            f"actor.loss_scale_factor={self.loss_scale_factor} must be > 0, or null for data.max_response_length",
        )
        if self.policy_loss == "gspo":
            # GSPO is defined (and run by verl) without the dual clip and with seq-mean-token-mean;
            # other combinations are refused rather than given a meaning verl does not have.
            check(
                self.clip_ratio_c is None,
                f"actor.policy_loss=gspo does not use the dual clip; set actor.clip_ratio_c=null (got {self.clip_ratio_c})",
            )
            check(
                self.loss_agg_mode == "seq-mean-token-mean",
                "actor.policy_loss=gspo aggregates seq-mean-token-mean; set actor.loss_agg_mode=seq-mean-token-mean "
                f"(got {self.loss_agg_mode})",
            )
        check(
            self.ppo_max_token_len_per_gpu > 0,
            f"actor.ppo_max_token_len_per_gpu={self.ppo_max_token_len_per_gpu} must be > 0",
        )
        check(
            self.log_prob_max_token_len_per_gpu is None or self.log_prob_max_token_len_per_gpu > 0,
            f"actor.log_prob_max_token_len_per_gpu={self.log_prob_max_token_len_per_gpu} must be > 0 (or null: "
            "twice actor.ppo_max_token_len_per_gpu)",
        )


@dataclass
class TrainerConfig:
    total_epochs: int = MISSING
    # Overrides total_epochs when set.
    total_steps: int | None = MISSING
    save_freq: int = MISSING
    test_freq: int = MISSING
    val_before_train: bool = MISSING
    # One name or a list (see lorarl.config.compose.STRING_OR_LIST_KEYS).
    logger: Any = MISSING
    project_name: str = MISSING
    experiment_name: str = MISSING
    nnodes: int = MISSING
    n_gpus_per_node: int = MISSING
    # auto: cuda when GPUs are visible, else cpu (gloo).
    device: str = MISSING
    seed: int = MISSING
    # 0: on-policy. 1: step k+1's batch is generated (with the adapter of step k-1) while step k's
    # update runs; the adapter of step k is synced when both end. Larger values would need vLLM to
    # hold one adapter per version in flight, so they are refused.
    off_policy_steps: int = MISSING
    # colocated: every worker holds the training engine and a vLLM engine on one device. split: the
    # training workers (trainer.n_gpus_per_node devices) and rollout.n_workers vLLM workers run on
    # devices of their own; the adapter reaches them through Ray's object store after each update.
    placement: str = MISSING
    # After each sync: the adapter vLLM holds must equal the one sent (exact fingerprint), each
    # module's delta in vLLM must be the trainer's (lorarl.sync.semantic), and trainer and vLLM
    # log-probs on fixed probe sequences must agree (lorarl.sync.probe).
    check_sync: bool = MISSING
    # The probe's bound on the worst token's |log-prob diff| (null: 1e-3 when both sides compute
    # in float32, 0.5 when either is 16-bit; bf16 on H200 measured 0.03 at 0.5B, 0.16-0.31 at 7B).
    check_sync_tolerance: float | None = MISSING
    # The fingerprint runs after every sync; the probe (two trainer forwards and one vLLM
    # prefill per probe sequence, 0.1-0.3 s at 7B on one H200) every this many steps, on the
    # first step each process runs (so a resumed run probes at once) and on the last.
    check_sync_probe_freq: int = MISSING
    # A test switch that corrupts the export on purpose (lorarl.sync.faults); null for training.
    sync_fault: str | None = MISSING
    # Relative paths sit inside the run folder, so sweep jobs never share checkpoints; to resume
    # a run, launch again with the same hydra.run.dir, or point resume_mode at a step folder.
    default_local_dir: str = MISSING
    # auto (newest complete checkpoint, if any) | disable | path to a global_step_N folder.
    resume_mode: str = MISSING
    max_ckpt_to_keep: int | None = MISSING
    progress_bar: bool = MISSING
    # A worker call (set-up, generation, update, sync, checkpoint) running longer than this
    # writes each worker's Python stacks to the run folder and the driver says so; the call
    # goes on (lorarl.workers.stall_report). null: never.
    stall_report_s: float | None = MISSING

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_gpus_per_node

    def check(self) -> None:
        one_of("trainer.device", self.device, ("auto", "cpu", "cuda"))
        check(self.nnodes >= 1 and self.n_gpus_per_node >= 1, "trainer.nnodes and trainer.n_gpus_per_node must be >= 1")
        check(
            self.check_sync_tolerance is None or self.check_sync_tolerance > 0,
            f"trainer.check_sync_tolerance={self.check_sync_tolerance} must be > 0, or null for the default by "
            "precision",
        )
        check(
            self.check_sync_probe_freq >= 1,
            f"trainer.check_sync_probe_freq={self.check_sync_probe_freq} must be >= 1",
        )
        one_of("trainer.sync_fault", self.sync_fault, (None, *FAULTS, *SEND_FAULTS))
        one_of("trainer.placement", self.placement, ("colocated", "split"))
        check(
            self.off_policy_steps in (0, 1),
            f"trainer.off_policy_steps={self.off_policy_steps}: use 0 (on-policy) or 1 (the next batch is generated "
            "during the update); more steps behind would need vLLM to hold one adapter per version in flight",
        )
        check(
            self.stall_report_s is None or self.stall_report_s > 0,
            f"trainer.stall_report_s={self.stall_report_s} must be > 0, or null for no report",
        )
        for name in self.logger:
            one_of("trainer.logger", name, ("console", "jsonl", "wandb", "tensorboard"))
        check(
            self.resume_mode in ("auto", "disable") or "/" in self.resume_mode or self.resume_mode.startswith("."),
            f"trainer.resume_mode={self.resume_mode!r} is not valid; use auto, disable, or a checkpoint path",
        )


@dataclass
class GSM8KRewardConfig:
    # lenient: numbers compared by value ("#### 18.00", "#### $18", "#### 1,000" count; the last
    # "####" wins). verl: verl's scorer as its published GSM8K table was measured (first "#### N",
    # exact text). Validation logs the verl accuracy whichever is chosen.
    scoring: str = MISSING
    # strict: only a "#### N" line counts; flexible: the last number anywhere.
    method: str = MISSING


@dataclass
class MathRewardConfig:
    # Seconds one answer's symbolic check may take before it is stopped and scored 0.
    timeout_s: float = MISSING


@dataclass
class RewardConfig:
    """How the built-in reward functions score (a data.reward_fn replaces them)."""

    gsm8k: GSM8KRewardConfig = field(default_factory=GSM8KRewardConfig)
    math: MathRewardConfig = field(default_factory=MathRewardConfig)

    def check(self) -> None:
        one_of("reward.gsm8k.scoring", self.gsm8k.scoring, ("lenient", "verl"))
        one_of("reward.gsm8k.method", self.gsm8k.method, ("strict", "flexible"))
        check(self.math.timeout_s > 0, f"reward.math.timeout_s={self.math.timeout_s} must be > 0")


@dataclass
class GRPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    # Chosen on the command line with +backend=fsdp|megatron; no default on purpose.
    backend: Any = MISSING
