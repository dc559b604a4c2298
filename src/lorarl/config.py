"""Typed schemas for every config group, and the cross-field checks Hydra cannot do.

The YAML files under conf/ are the source of truth for values; these dataclasses are the
source of truth for which keys exist and their types. Hydra merges each YAML into its
schema, so a typo (`model.lora.rnak=8`) or a wrong type fails at compose time naming the
key. `validate` then checks what needs several keys at once and returns the typed object.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict

from lorarl.errors import ConfigError

HF_LINEAR_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# vLLM serves LoRA on these Qwen2 modules only; embeddings and lm_head exist in PEFT but
# vLLM rejects them when the adapter is loaded ("... is unsupported LoRA weight").
VLLM_LORA_UNSUPPORTED = ("lm_head", "embed_tokens")


@dataclass
class LoraConfig:
    rank: int = 32
    alpha: int = 32
    dropout: float = 0.0
    # HF projection names (q_proj ...), "all-linear", or Megatron names (linear_qkv ...). One
    # name or a list (see STRING_OR_LIST_KEYS).
    target_modules: Any = field(default_factory=lambda: list(HF_LINEAR_PROJECTIONS))
    # Stacked parameters PEFT wraps directly (its `target_parameters`): the fused MoE experts,
    # e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj] (lorarl.expert_lora). Empty for dense models.
    target_parameters: list[str] = field(default_factory=list)
    # Megatron only: fused `lora` or per-projection `canonical_lora`.
    type: str = "lora"
    # Megatron only: initialisation of A (B always starts at zero).
    init_A: str = "xavier"
    # true: push merged W + BA every step into a vLLM started without LoRA.
    merge: bool = False


@dataclass
class ModelConfig:
    # HF hub id or local directory.
    path: str = MISSING
    # "tiny_qwen2" | "tiny_qwen3": build the embedded model at `path` when it is not there yet.
    builder: str | None = None
    # Training dtype of the frozen base; LoRA weights and optimizer state stay float32.
    dtype: str = "bfloat16"
    trust_remote_code: bool = False
    enable_gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class DataConfig:
    # One parquet path or a list, as verl takes them (see STRING_OR_LIST_KEYS).
    train_files: Any = MISSING
    val_files: Any = field(default_factory=list)
    # "arith": the files are written by the embedded task generator when missing.
    generator: str | None = None
    generator_size: int = 2000
    train_batch_size: int = 8
    max_prompt_length: int = 512
    max_response_length: int = 512
    filter_overlong_prompts: bool = True
    # error | left | right: what to do with prompts over max_prompt_length when not filtered.
    truncation: str = "error"
    shuffle: bool = True
    # "package.module:function" scoring every sample instead of the data_source registry.
    reward_fn: str | None = None
    # Prompts per generation round of DAPO dynamic sampling (oversampling); null: train_batch_size.
    gen_batch_size: int | None = None


@dataclass
class ValKwargs:
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    do_sample: bool = False


@dataclass
class RolloutConfig:
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    gpu_memory_utilization: float = 0.5
    tensor_model_parallel_size: int = 1
    # MoE models: spread the experts over the tensor-parallel ranks instead of slicing each one
    # (vLLM's enable_expert_parallel; each rank then holds and is checked on its own experts).
    enable_expert_parallel: bool = False
    # auto/safetensors: vLLM reads the base from disk. dummy: random base, sent once by the trainer.
    load_format: str = "auto"
    # Export the adapter one FSDP unit at a time (needs the base already in vLLM).
    layered_summon: bool = False
    # null: CUDA graphs on GPU (false), eager on CPU (true).
    enforce_eager: bool | None = None
    # vLLM sleep mode during the update (GPU only). null: sleep only when the update would not
    # fit beside the awake engine (lorarl.memory estimates it; the decision is logged).
    free_cache_engine: bool | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    # tmpfs: PEFT folder in /dev/shm loaded by path. memory: tensors handed to vLLM directly.
    adapter_transport: str = "memory"
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    # Counted in prompts, like train_batch_size; each becomes rollout.n sequences.
    ppo_mini_batch_size: int = 8
    # Counted in sequences per device.
    ppo_micro_batch_size_per_gpu: int = 4
    # true: cut micro-batches by padded tokens (ppo_max_token_len_per_gpu) instead of rows.
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    # Token budget of the passes without a backward (old and reference log-probs) under
    # use_dynamic_bsz. null: twice ppo_max_token_len_per_gpu (they keep no activations).
    log_prob_max_token_len_per_gpu: int | None = None
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    # Dual-clip bound for negative advantages; null disables it.
    clip_ratio_c: float | None = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"
    # seq-mean-token-sum-norm's constant divisor; null: data.max_response_length.
    loss_scale_factor: int | None = None
    # vanilla: per-token PPO ratio; gspo: one length-normalised ratio per sequence.
    policy_loss: str = "vanilla"
    grad_clip: float = 1.0


@dataclass
class RolloutCorrectionConfig:
    """verl's keys and meanings (lorarl.rollout_correction; formulas in docs/algorithms.md)."""

    # Truncated importance weights min(pi_trainer / pi_rollout, rollout_is_threshold) on the loss:
    # token | sequence (the product over the response) | null | auto (token on CUDA, where they
    # cost no extra pass on the on-policy path; null on CPU, where both sides are float32).
    rollout_is: str | None = "auto"
    rollout_is_threshold: float = 2.0
    # Divide the weights by their batch mean (over tokens, or sequences at sequence level).
    rollout_is_batch_normalize: bool = False
    # Rejection: comma-separated token_k1|k2|k3, seq_sum_k1|k2|k3, seq_mean_k1|k2|k3, seq_max_k2|k3;
    # null: none. Rejected tokens leave the loss and its normalisation.
    rollout_rs: str | None = None
    # One bound for all options or one per option; k1: "upper" (lower = 1 / upper) or
    # "lower_upper", bounds on pi_rollout / pi_trainer (per token, or the sequence's sum / mean).
    rollout_rs_threshold: str | None = None
    # true: the sampler's log-probs are pi_old (the PPO ratio is pi / pi_rollout); no weights.
    bypass_mode: bool = False


@dataclass
class FilterGroupsConfig:
    # DAPO dynamic sampling: drop prompt groups whose `metric` is equal for every sample, sample more prompts.
    enable: bool = False
    # acc | score: the reward function's value; seq_reward | seq_final_reward: with the overlong penalty.
    metric: str = "acc"
    # Generation rounds per step at most (the first included), 0 for no limit; a batch still short
    # after them is filled with dropped groups (zero advantage) and the step goes on.
    max_num_gen_batches: int = 4


@dataclass
class OverlongBufferConfig:
    # DAPO soft overlong punishment, added to the reward.
    enable: bool = False
    # Tokens before data.max_response_length where the penalty starts; null: 20% of it (the
    # paper's 4096 of 20480).
    len: int | None = None
    penalty_factor: float = 1.0


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class TrainerConfig:
    total_epochs: int = 1
    # Overrides total_epochs when set.
    total_steps: int | None = None
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = False
    # One name or a list (see STRING_OR_LIST_KEYS).
    logger: Any = field(default_factory=lambda: ["console", "jsonl"])
    project_name: str = "lorarl"
    experiment_name: str = "grpo"
    nnodes: int = 1
    n_gpus_per_node: int = 1
    # auto: cuda when GPUs are visible, else cpu (gloo).
    device: str = "auto"
    seed: int = 1
    # After each sync: the adapter vLLM holds must equal the one sent (exact fingerprint), and
    # trainer and vLLM log-probs on fixed probe sequences must agree (lorarl.sync_checks).
    check_sync: bool = True
    # The probe's bound on the worst token's |log-prob diff| (null: 1e-3 when both sides compute
    # in float32, 0.5 when either is 16-bit; bf16 on H200 measured 0.03 at 0.5B, 0.16-0.31 at 7B).
    check_sync_tolerance: float | None = None
    # The fingerprint runs after every sync; the probe (two trainer forwards and one vLLM
    # prefill per probe sequence, 0.1-0.3 s at 7B on one H200) every this many steps, on the
    # first step each process runs (so a resumed run probes at once) and on the last.
    check_sync_probe_freq: int = 10
    # Relative paths sit inside the run folder, so sweep jobs never share checkpoints; to resume
    # a run, launch again with the same hydra.run.dir, or point resume_mode at a step folder.
    default_local_dir: str = "checkpoints"
    # auto (newest complete checkpoint, if any) | disable | path to a global_step_N folder.
    resume_mode: str = "auto"
    max_ckpt_to_keep: int | None = None
    progress_bar: bool = True


@dataclass
class FSDPBackendConfig:
    strategy: str = "fsdp2"
    reshard_after_forward: bool = True
    # GPU only: keep sharded params / optimizer state in CPU memory between uses.
    param_offload: bool = False
    optimizer_offload: bool = False
    # float32 or bfloat16: dtype of the all-gathered params during compute (GPU).
    mixed_precision: str = "bfloat16"
    # Liger's Triton kernels for RMSNorm, SwiGLU and RoPE in the training forward and backward
    # (liger-kernel, in the gpu extra). null: on when training on CUDA and not compiled, off on
    # CPU (Triton).
    liger_kernel: bool | None = None
    # torch.compile each decoder layer (regional compilation: one compiled graph serves every
    # layer; fewer, fused kernels and less host work per layer). Off: at 7B on one H200 it did
    # not speed the update (bench/results/update_profile_2026-12-02c).
    compile: bool = False


@dataclass
class MegatronBackendConfig:
    strategy: str = "megatron"
    # megatron_bridge (LoRA adapters + HF export) or mbridge (full weights only).
    bridge: str = "megatron_bridge"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # MoE only: experts split over this many ranks (must divide the experts); each expert's
    # linears split over expert_tensor_parallel_size ranks (only 1 exports correctly).
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    # transformer_engine or local (megatron-core's own layers; no TransformerEngine needed).
    transformer_impl: str = "local"
    override_transformer_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class GSM8KRewardConfig:
    # lenient: numbers compared by value ("#### 18.00", "#### $18", "#### 1,000" count; the last
    # "####" wins). verl: verl's scorer as its published GSM8K table was measured (first "#### N",
    # exact text). Validation logs the verl accuracy whichever is chosen.
    scoring: str = "lenient"
    # strict: only a "#### N" line counts; flexible: the last number anywhere.
    method: str = "strict"

    # Checked when the object is built (module-level helpers below are not defined yet then).
    def __post_init__(self) -> None:
        for key, value, allowed in (
            ("scoring", self.scoring, ("lenient", "verl")),
            ("method", self.method, ("strict", "flexible")),
        ):
            if value not in allowed:
                raise ConfigError(f"reward.gsm8k.{key}={value!r} is not valid; use one of: {', '.join(allowed)}")


@dataclass
class MathRewardConfig:
    # Seconds one answer's symbolic check may take before it is stopped and scored 0.
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"reward.math.timeout_s={self.timeout_s} must be > 0")


@dataclass
class RewardConfig:
    """How the built-in reward functions score (a data.reward_fn replaces them)."""

    gsm8k: GSM8KRewardConfig = field(default_factory=GSM8KRewardConfig)
    math: MathRewardConfig = field(default_factory=MathRewardConfig)


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


def cache_dir() -> str:
    """Where the embedded model and generated data live: $LORARL_CACHE or ~/.cache/lorarl."""
    return os.path.expanduser(os.environ.get("LORARL_CACHE", "~/.cache/lorarl"))


def register_schemas() -> None:
    """Make the schemas visible to Hydra; the YAML files name them in their defaults lists."""
    if not OmegaConf.has_resolver("lorarl_cache"):
        OmegaConf.register_new_resolver("lorarl_cache", cache_dir)
    cs = ConfigStore.instance()
    cs.store(name="grpo_schema", node=GRPOConfig)
    cs.store(group="backend", name="fsdp_schema", node=FSDPBackendConfig)
    cs.store(group="backend", name="megatron_schema", node=MegatronBackendConfig)


register_schemas()

MISSING_BACKEND = (
    "no training backend chosen: add +backend=fsdp (FSDP2, CPU or GPU) or +backend=megatron (Megatron-core, GPU)"
)


@dataclass
class RunConfig:
    """The validated, typed config handed to the trainer (plain dataclasses, picklable)."""

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    actor: ActorConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    backend: FSDPBackendConfig | MegatronBackendConfig
    reward: RewardConfig = field(default_factory=RewardConfig)

    @property
    def world_size(self) -> int:
        return self.trainer.nnodes * self.trainer.n_gpus_per_node

    @property
    def clip_low(self) -> float:
        return self.actor.clip_ratio if self.actor.clip_ratio_low is None else self.actor.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.actor.clip_ratio if self.actor.clip_ratio_high is None else self.actor.clip_ratio_high

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


# List-typed keys that verl also takes as one string (`data.train_files=train.parquet`,
# `target_modules=all-linear`, `trainer.logger=console`). Their schema type is Any so Hydra
# accepts both spellings; `as_string_lists` makes them lists of strings before anything reads them.
STRING_OR_LIST_KEYS = ("data.train_files", "data.val_files", "model.lora.target_modules", "trainer.logger")


def as_string_lists(obj: Any) -> None:
    """Turn each STRING_OR_LIST_KEYS value of a GRPOConfig object into a list of strings."""
    for key in STRING_OR_LIST_KEYS:
        section, *path, leaf = key.split(".")
        parent = getattr(obj, section)
        for name in path:
            parent = getattr(parent, name)
        value = getattr(parent, leaf)
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
            raise ConfigError(f"{key}={value!r}: give one string or a list of strings, e.g. {key}=[a,b]")
        setattr(parent, leaf, list(items))


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Typed config from a composed one, after every cross-field check."""
    if "backend" not in cfg or OmegaConf.is_missing(cfg, "backend"):
        raise ConfigError(MISSING_BACKEND)
    obj = OmegaConf.to_object(cfg)
    as_string_lists(obj)
    run = RunConfig(
        **{
            k: getattr(obj, k)
            for k in ("model", "data", "rollout", "actor", "algorithm", "trainer", "backend", "reward")
        }
    )
    validate(run)
    return run


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _one_of(key: str, value: Any, allowed: tuple) -> None:
    _check(value in allowed, f"{key}={value!r} is not valid; use one of: {', '.join(map(str, allowed))}")


def validate(run: RunConfig) -> None:
    """Every check that needs more than one key, or knowledge Hydra lacks. One line per error."""
    from lorarl.sync import vllm_lora_rank

    m, d, r, a, alg, t = run.model, run.data, run.rollout, run.actor, run.algorithm, run.trainer
    from lorarl.engines import BACKENDS

    _one_of("backend.strategy", run.backend.strategy, tuple(BACKENDS))
    megatron = isinstance(run.backend, MegatronBackendConfig)

    lora = m.lora
    _check(lora.rank > 0, f"model.lora.rank={lora.rank} must be > 0 (LoRA is the only training mode)")
    vllm_lora_rank(lora.rank)  # raises ConfigError above vLLM's largest rank
    _check(lora.alpha > 0, f"model.lora.alpha={lora.alpha} must be > 0")
    _check(0.0 <= lora.dropout < 1.0, f"model.lora.dropout={lora.dropout} must be in [0, 1)")
    _check(
        len(lora.target_modules) > 0,
        "model.lora.target_modules is empty; list modules such as q_proj,v_proj or all-linear",
    )
    for name in lora.target_modules:
        leaf = name.split(".")[-1]
        _check(
            leaf not in VLLM_LORA_UNSUPPORTED,
            f"model.lora.target_modules contains {name!r}: vLLM cannot load LoRA on lm_head/embed_tokens; "
            f"target the linear projections ({','.join(HF_LINEAR_PROJECTIONS)})",
        )
        _check(
            leaf != "gate",
            f"model.lora.target_modules contains {name!r}: that is the MoE router, which vLLM serves no LoRA on; "
            "target the attention projections and the experts (model.lora.target_parameters)",
        )
    from lorarl.expert_lora import check_target_parameters

    check_target_parameters(lora.target_parameters)
    _one_of("model.lora.type", lora.type, ("lora", "canonical_lora"))
    _one_of("model.lora.init_A", lora.init_A, ("xavier", "kaiming", "normal"))
    _one_of("model.dtype", m.dtype, ("float32", "bfloat16", "float16"))
    from lorarl.models.tiny import ARCHS as BUILDERS

    _check(
        m.builder is None or m.builder in BUILDERS,
        f"model.builder={m.builder!r} is not valid; use null or one of: {', '.join(BUILDERS)}",
    )

    _one_of("data.truncation", d.truncation, ("error", "left", "right"))
    _check(d.train_batch_size > 0, f"data.train_batch_size={d.train_batch_size} must be > 0")
    _check(
        d.max_prompt_length > 0 and d.max_response_length > 0,
        "data.max_prompt_length and data.max_response_length must be > 0",
    )
    _check(d.generator in (None, "arith"), f"data.generator={d.generator!r} is not valid; use null or arith")

    _one_of("rollout.adapter_transport", r.adapter_transport, ("tmpfs", "memory"))
    _check(
        0.0 < r.gpu_memory_utilization <= 1.0,
        f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1]",
    )
    _check(
        r.temperature > 0.0,
        f"rollout.temperature={r.temperature}: training samples must differ within a group (greedy samples are "
        "identical, so every GRPO advantage would be 0); set rollout.temperature>0 (rollout.val_kwargs for validation)",
    )
    _check(0.0 < r.top_p <= 1.0, f"rollout.top_p={r.top_p} must be in (0, 1]")
    _check(r.val_kwargs.n >= 1, f"rollout.val_kwargs.n={r.val_kwargs.n} must be >= 1")
    _check(
        r.val_kwargs.n == 1 or r.val_kwargs.do_sample,
        f"rollout.val_kwargs.n={r.val_kwargs.n} with do_sample=false would repeat one greedy answer; set rollout.val_kwargs.do_sample=true",
    )
    _check(
        not (r.layered_summon and r.load_format == "dummy"),
        "rollout.layered_summon=true exports only the adapter, so vLLM must load the base from disk: "
        "set rollout.load_format=auto (or safetensors), or rollout.layered_summon=false",
    )
    _check(
        not (r.layered_summon and lora.merge),
        "rollout.layered_summon=true exports only the adapter, but model.lora.merge=true pushes merged full weights; pick one",
    )

    _one_of("algorithm.adv_estimator", alg.adv_estimator, ("grpo",))
    _check(
        not alg.use_kl_in_reward,
        "algorithm.use_kl_in_reward=true is not supported: GRPO here puts the KL in the loss; set actor.use_kl_loss=true instead",
    )
    _check(
        r.n >= 2,
        f"rollout.n={r.n}: GRPO compares samples of the same prompt, so with fewer than 2 every advantage is 0; set rollout.n>=2",
    )
    _one_of("actor.kl_loss_type", a.kl_loss_type, ("k1", "k2", "mse", "k3", "low_var_kl"))
    from lorarl.algorithms import AGG_MODES, POLICY_LOSSES

    _one_of("actor.loss_agg_mode", a.loss_agg_mode, AGG_MODES)
    _one_of("actor.policy_loss", a.policy_loss, POLICY_LOSSES)
    _check_rollout_correction(alg.rollout_correction)
    if a.policy_loss == "gspo":
        from lorarl.algorithms import check_gspo

        check_gspo(a.clip_ratio_c, a.loss_agg_mode)
    _check(
        a.loss_scale_factor is None or a.loss_scale_factor > 0,
        f"actor.loss_scale_factor={a.loss_scale_factor} must be > 0, or null for data.max_response_length",
    )
    fg = alg.filter_groups
    _one_of("algorithm.filter_groups.metric", fg.metric, ("acc", "score", "seq_reward", "seq_final_reward"))
    _check(
        fg.max_num_gen_batches >= 0,
        f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} must be >= 1, or 0 for no limit",
    )
    _check(
        d.gen_batch_size is None or (fg.enable and d.gen_batch_size >= d.train_batch_size),
        f"data.gen_batch_size={d.gen_batch_size} oversamples for dynamic sampling: it needs "
        f"algorithm.filter_groups.enable=true and a value >= data.train_batch_size={d.train_batch_size} (or null)",
    )
    ob = alg.overlong_buffer
    _check(
        ob.len is None or 0 < ob.len < d.max_response_length,
        f"algorithm.overlong_buffer.len={ob.len} must be in (0, data.max_response_length={d.max_response_length})",
    )
    _check(a.ppo_epochs >= 1, f"actor.ppo_epochs={a.ppo_epochs} must be >= 1")
    _check(a.grad_clip > 0, f"actor.grad_clip={a.grad_clip} must be > 0")
    _check(a.optim.lr > 0, f"actor.optim.lr={a.optim.lr} must be > 0")
    _check(
        a.clip_ratio_c is None or a.clip_ratio_c > 1.0,
        f"actor.clip_ratio_c={a.clip_ratio_c} must be > 1 (dual clip) or null",
    )

    _one_of("trainer.device", t.device, ("auto", "cpu", "cuda"))
    _check(t.nnodes >= 1 and t.n_gpus_per_node >= 1, "trainer.nnodes and trainer.n_gpus_per_node must be >= 1")
    _check(
        t.check_sync_tolerance is None or t.check_sync_tolerance > 0,
        f"trainer.check_sync_tolerance={t.check_sync_tolerance} must be > 0, or null for the default by precision",
    )
    _check(t.check_sync_probe_freq >= 1, f"trainer.check_sync_probe_freq={t.check_sync_probe_freq} must be >= 1")
    for lg in t.logger:
        _one_of("trainer.logger", lg, ("console", "jsonl", "wandb", "tensorboard"))
    _check(
        t.resume_mode in ("auto", "disable") or "/" in t.resume_mode or t.resume_mode.startswith("."),
        f"trainer.resume_mode={t.resume_mode!r} is not valid; use auto, disable, or a checkpoint path",
    )

    world = run.world_size
    # Data is split over data-parallel replicas: every device with FSDP; with Megatron, the
    # devices of one tensor x pipeline group share a replica and see the same sequences.
    mp = BACKENDS[run.backend.strategy].model_parallel_size(run.backend)
    if mp > 1:
        _check(
            world % mp == 0,
            f"backend.tensor_model_parallel_size x backend.pipeline_model_parallel_size = {mp} must divide the {world} devices",
        )
    dp = world // mp
    replicas = f"{dp} data-parallel replicas" if mp > 1 else f"{world} devices"
    _check(
        a.ppo_mini_batch_size <= d.train_batch_size and d.train_batch_size % a.ppo_mini_batch_size == 0,
        f"data.train_batch_size={d.train_batch_size} must be a multiple of actor.ppo_mini_batch_size={a.ppo_mini_batch_size} (both count prompts)",
    )
    _check(
        d.train_batch_size % dp == 0,
        f"data.train_batch_size={d.train_batch_size} must divide over {replicas} (trainer.nnodes x trainer.n_gpus_per_node"
        + (" / model-parallel size)" if mp > 1 else ")"),
    )
    mini_seqs = a.ppo_mini_batch_size * r.n
    _check(
        mini_seqs % dp == 0,
        f"actor.ppo_mini_batch_size x rollout.n = {mini_seqs} sequences must divide over {replicas}",
    )
    per_device = mini_seqs // dp
    _check(
        a.ppo_max_token_len_per_gpu > 0,
        f"actor.ppo_max_token_len_per_gpu={a.ppo_max_token_len_per_gpu} must be > 0",
    )
    _check(
        a.log_prob_max_token_len_per_gpu is None or a.log_prob_max_token_len_per_gpu > 0,
        f"actor.log_prob_max_token_len_per_gpu={a.log_prob_max_token_len_per_gpu} must be > 0 (or null: twice "
        "actor.ppo_max_token_len_per_gpu)",
    )
    _check(
        a.use_dynamic_bsz or per_device % a.ppo_micro_batch_size_per_gpu == 0,
        f"actor.ppo_micro_batch_size_per_gpu={a.ppo_micro_batch_size_per_gpu} must divide the "
        f"{per_device} sequences each device gets per mini-batch (ppo_mini_batch_size x rollout.n / {'replicas' if mp > 1 else 'devices'})",
    )
    tp = r.tensor_model_parallel_size
    # T consecutive workers of one node share a vLLM engine, each holding a shard of it; an
    # engine never spans nodes (its all-reduces run every layer of every decoded token).
    _check(tp >= 1, f"rollout.tensor_model_parallel_size={tp} must be >= 1")
    _check(
        t.n_gpus_per_node % tp == 0,
        f"rollout.tensor_model_parallel_size={tp} must divide trainer.n_gpus_per_node={t.n_gpus_per_node}: "
        "the workers of one vLLM engine sit on one node",
    )
    if megatron:
        b = run.backend
        _one_of("backend.bridge", b.bridge, ("megatron_bridge", "mbridge"))
        _one_of("backend.transformer_impl", b.transformer_impl, ("transformer_engine", "local"))
        from lorarl.engines.megatron.experts import check_expert_parallel

        check_expert_parallel(b, num_experts=None, merge=lora.merge)  # the model's experts: in the engine
        _check(
            not (a.use_dynamic_bsz and b.pipeline_model_parallel_size > 1),
            "actor.use_dynamic_bsz=true with backend.pipeline_model_parallel_size>1: pipeline stages exchange "
            "activations of one fixed shape; set actor.use_dynamic_bsz=false",
        )
        _check(
            lora.rank % b.tensor_model_parallel_size == 0,
            f"model.lora.rank={lora.rank} must be divisible by backend.tensor_model_parallel_size={b.tensor_model_parallel_size}",
        )
        _check(
            t.save_freq <= 0,
            "trainer.save_freq: mid-run checkpoints are not supported with +backend=megatron yet (the final adapter is "
            "still exported); set trainer.save_freq=-1 or use +backend=fsdp",
        )
        _check(
            b.bridge != "mbridge" or lora.merge,
            "backend.bridge=mbridge cannot export LoRA adapters; set model.lora.merge=true or backend.bridge=megatron_bridge",
        )
    else:
        _one_of("backend.mixed_precision", run.backend.mixed_precision, ("float32", "bfloat16"))


def _check_rollout_correction(rc: RolloutCorrectionConfig) -> None:
    from lorarl.rollout_correction import IS_CHOICES, parse_rejection

    key = "algorithm.rollout_correction"
    _one_of(f"{key}.rollout_is", rc.rollout_is, IS_CHOICES)
    _check(
        rc.rollout_is_threshold > 1.0,
        f"{key}.rollout_is_threshold={rc.rollout_is_threshold} must be > 1 (weights are truncated there, and "
        "the diagnostics use the band [1 / threshold, threshold])",
    )
    parse_rejection(rc.rollout_rs, rc.rollout_rs_threshold)
    _check(
        not (rc.bypass_mode and rc.rollout_is in ("token", "sequence")),
        f"{key}.bypass_mode=true makes the PPO ratio pi / pi_rollout already; weights on top would count the "
        f"mismatch twice: set {key}.rollout_is=null (or auto)",
    )


def check_model_shape(run: RunConfig, num_attention_heads: int, num_key_value_heads: int) -> None:
    """Checks that need the model's config: tensor parallel sizes must split the heads."""
    sizes = [("rollout.tensor_model_parallel_size", run.rollout.tensor_model_parallel_size)]
    if isinstance(run.backend, MegatronBackendConfig):
        sizes.append(("backend.tensor_model_parallel_size", run.backend.tensor_model_parallel_size))
    for key, tp in sizes:
        _check(
            num_attention_heads % tp == 0,
            f"{key}={tp} does not divide the model's {num_attention_heads} attention heads",
        )
        _check(
            num_key_value_heads % tp == 0 or tp % num_key_value_heads == 0,
            f"{key}={tp} does not divide the model's {num_key_value_heads} key/value heads",
        )


def steps_for(run: RunConfig, steps_per_epoch: int) -> int:
    """Total optimizer steps: trainer.total_steps if set, else epochs x batches per epoch."""
    if run.trainer.total_steps is not None:
        return run.trainer.total_steps
    return run.trainer.total_epochs * steps_per_epoch


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")


def compose(overrides: list[str], config_dir: str | None = None) -> RunConfig:
    """The validated RunConfig that `python -m recipes.grpo <overrides>` would train with.

    Composes conf/grpo.yaml through Hydra's compose API (the same defaults lists, schemas and
    `${hydra:...}` interpolations as the command line), so tests, benchmarks and GPU scripts
    never build a RunConfig by hand. `config_dir` defaults to the repository's conf/. Any Hydra
    instance already initialised in this process is left as it was found.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    config_dir = os.path.abspath(config_dir or CONF_DIR)
    if not os.path.isfile(os.path.join(config_dir, "grpo.yaml")):
        raise ConfigError(f"{config_dir} has no grpo.yaml; pass the repository's conf/ folder as config_dir")
    saved_hydra, saved_cfg = GlobalHydra.instance().hydra, HydraConfig.instance().cfg
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            cfg = hydra_compose("grpo", overrides=list(overrides), return_hydra_config=True)
            # `${hydra:runtime.choices.model}` (trainer.experiment_name) resolves against this.
            HydraConfig.instance().set_config(cfg)
            OmegaConf.set_readonly(cfg, False)
            with open_dict(cfg):
                del cfg["hydra"]
            return to_run_config(cfg)
    finally:
        # initialize_config_dir swaps the GlobalHydra singleton on exit: ask for it again.
        GlobalHydra.instance().clear()
        if saved_hydra is not None:
            GlobalHydra.instance().initialize(saved_hydra)
        HydraConfig.instance().cfg = saved_cfg


__all__ = ["RunConfig", "to_run_config", "validate", "check_model_shape", "steps_for", "compose"]
