"""lorarl's `model.lora.*` and `backend.*` keys -> Megatron-Bridge PEFT and provider settings.

Inputs are the lead's config dataclasses or plain dicts with the same keys. Names on the
Megatron side were read from megatron-bridge 0.6.2 (`peft/lora.py` LoRA, `peft/canonical_lora.py`
CanonicalLoRA, `models/gpt_provider.py` GPTModelProvider) and megatron-core 0.19.2
(`transformer/transformer_config.py`, `model_parallel_config.py`); the tests check every key
this module emits against those classes' fields in the released wheels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lorarl.engines.megatron.experts import check_expert_parallel
from lorarl.engines.megatron.names import LORA_TYPES, resolve_lora_targets
from lorarl.errors import ConfigError
from lorarl.expert_lora import expert_projections

INIT_METHODS = ("xavier", "kaiming", "normal")  # ParallelLinearAdapter._get_init_fn; "zero" is B's
TRANSFORMER_IMPLS = ("transformer_engine", "local")
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = (None, "uniform", "block")
PEFT_CLASSES = {"lora": "LoRA", "canonical_lora": "CanonicalLoRA"}

# Kernels that need TransformerEngine, Apex or separately built extensions. With the local
# spec they must be off: gradient_accumulation_fusion defaults to True whenever TE imports
# and then raises without Apex; masked_softmax_fusion imports scaled_masked_softmax_cuda;
# rope fusion is TE-only (notes §3.2).
LOCAL_SPEC_FUSIONS_OFF = {
    "gradient_accumulation_fusion": False,
    "masked_softmax_fusion": False,
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "persist_layer_norm": False,
    # MoE: grouped GEMM experts and fused token permutation are TransformerEngine kernels;
    # the local spec builds experts as a SequentialMLP of megatron-core linears instead.
    # Qwen3MoEBridge turns both on; harmless on dense models (no experts to build).
    "moe_grouped_gemm": False,
    "moe_permute_fusion": False,
}
DTYPES = ("float32", "bfloat16", "float16")


# ---------------------------------------------------------------------------------------------
# LoRA
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeftSpec:
    """Which Megatron-Bridge PEFT class to build and with what keyword arguments."""

    class_name: str  # "LoRA" | "CanonicalLoRA" in megatron.bridge.peft
    kwargs: dict[str, Any] = field(default_factory=dict)
    hf_target_modules: tuple[str, ...] = ()  # what the exported adapter covers (HF names)
    widened: tuple[str, ...] = ()  # HF projections added by fusing (q_proj alone -> q,k,v)

    def build(self) -> Any:
        """The real PEFT object (GPU stack; imports megatron.bridge)."""
        if self.class_name == "LoRA":
            from megatron.bridge.peft.lora import LoRA as cls
        else:
            from megatron.bridge.peft.canonical_lora import CanonicalLoRA as cls
        return cls(**self.kwargs)


def peft_spec(lora: Any) -> PeftSpec:
    """`model.lora` -> LoRA/CanonicalLoRA(target_modules, dim, alpha, dropout, ...)."""
    lora_type = lora.type
    if lora_type not in LORA_TYPES:
        raise ConfigError(f"model.lora.type={lora_type!r} is not valid; use one of: {', '.join(LORA_TYPES)}")
    init_a = lora.init_A
    if init_a not in INIT_METHODS:
        raise ConfigError(f"model.lora.init_A={init_a!r} is not valid; use one of: {', '.join(INIT_METHODS)}")
    rank = lora.rank
    if not isinstance(rank, int) or rank <= 0:
        raise ConfigError(f"model.lora.rank={rank!r} must be a positive integer")
    alpha = lora.alpha
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ConfigError(f"model.lora.alpha={alpha!r} must be > 0")
    dropout = float(lora.dropout)
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(f"model.lora.dropout={dropout} must be in [0, 1)")
    # Megatron's experts are linear_fc1/linear_fc2 modules: the fused-expert parameters name them.
    experts = expert_projections(getattr(lora, "target_parameters", ()) or ())
    targets = resolve_lora_targets(list(lora.target_modules) + experts, lora_type)
    kwargs = {
        "target_modules": list(targets.megatron),
        "dim": rank,
        "alpha": alpha,
        "dropout": dropout,
        # PEFT applies lora_dropout to the adapter input; Megatron-Bridge's "pre" is the same.
        "dropout_position": "pre",
        "lora_A_init_method": init_a,
        # B = 0 makes the adapter start as the identity on the base, as in PEFT.
        "lora_B_init_method": "zero",
    }
    return PeftSpec(PEFT_CLASSES[lora_type], kwargs, targets.hf, targets.widened)


def peft_adapter_config(lora: Any) -> dict[str, Any]:
    """Adapter config (PEFT `adapter_config.json` keys) describing the exported adapter.

    Megatron-Bridge scales by alpha/dim, PEFT by lora_alpha/r with use_rslora=False, so the
    values carry over unchanged. target_modules are the HF projections that really carry an
    adapter (fused LoRA on linear_qkv adapts all of q/k/v).
    """
    spec = peft_spec(lora)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.kwargs["dim"],
        "lora_alpha": spec.kwargs["alpha"],
        "lora_dropout": spec.kwargs["dropout"],
        "target_modules": list(spec.hf_target_modules),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
    }


# ---------------------------------------------------------------------------------------------
# Backend -> provider
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProviderPlan:
    """Settings for a GPTModelProvider before `finalize()`.

    `settings` are plain attribute values (applied in order, user overrides last);
    `layer_spec` and `attention_backend` name objects the engine resolves on the GPU
    (`megatron.bridge.models.gpt_provider.local_layer_spec`, `AttnBackend.local`).
    """

    settings: dict[str, Any]
    layer_spec: str  # "transformer_engine" (provider default) | "local"
    attention_backend: str | None  # None keeps the provider default (auto)
    overrides: dict[str, Any]


def provider_plan(backend: Any, dtype: str = "bfloat16") -> ProviderPlan:
    """`backend.*` (+ model.dtype) -> provider attributes."""
    impl = backend.transformer_impl
    if impl not in TRANSFORMER_IMPLS:
        raise ConfigError(f"backend.transformer_impl={impl!r} is not valid; use one of: {', '.join(TRANSFORMER_IMPLS)}")
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype={dtype!r} is not valid; use one of: {', '.join(DTYPES)}")
    tp = int(backend.tensor_model_parallel_size)
    pp = int(backend.pipeline_model_parallel_size)
    settings: dict[str, Any] = {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        # Set even when 1: megatron-core defaults expert TP to the attention TP, which the
        # expert adapter export cannot handle (lorarl.engines.megatron.experts).
        "expert_model_parallel_size": int(backend.expert_model_parallel_size),
        "expert_tensor_parallel_size": int(backend.expert_tensor_parallel_size),
        # Top-k routing is discrete: router logits in bf16 pick other experts for near-tied
        # tokens than vLLM's float32 top-k softmax, a trainer/rollout mismatch the probe would
        # show. megatron-core itself warns without it at >= 32 experts. Ignored by dense models.
        "moe_router_dtype": "fp32",
        "sequence_parallel": bool(backend.sequence_parallel),
        "bf16": dtype == "bfloat16",
        "fp16": dtype == "float16",
        "params_dtype": _torch_dtype(dtype),
        "pipeline_dtype": _torch_dtype(dtype),
        "autocast_dtype": _torch_dtype(dtype),
        # variable_seq_lengths stays off: megatron-core 0.19 rejects it with the default MoE
        # dispatcher even for dense models; each call pads its micro-batches to one width
        # and passes that seq_length to the schedule instead.
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    granularity = backend.recompute_granularity
    if granularity is not None:
        settings["recompute_granularity"] = granularity
        settings["recompute_method"] = backend.recompute_method
        settings["recompute_num_layers"] = backend.recompute_num_layers
    if impl == "local":
        settings.update(LOCAL_SPEC_FUSIONS_OFF)
    overrides = dict(backend.override_transformer_config or {})
    return ProviderPlan(settings, impl, "local" if impl == "local" else None, overrides)


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def apply_provider_plan(provider: Any, plan: ProviderPlan) -> Any:
    """Set the plan on a real provider, then the user's overrides, then finalize() it.

    Unknown override keys fail here (one line naming the key) instead of being set as stray
    attributes that Megatron would silently ignore.
    """
    for key, value in plan.settings.items():
        setattr(provider, key, value)
    if plan.layer_spec == "local":
        from megatron.bridge.models.gpt_provider import local_layer_spec

        provider.transformer_layer_spec = local_layer_spec
    if plan.attention_backend is not None:
        from megatron.core.transformer.enums import AttnBackend

        provider.attention_backend = AttnBackend[plan.attention_backend]
    for key, value in plan.overrides.items():
        if not hasattr(provider, key):
            raise ConfigError(
                f"backend.override_transformer_config.{key} is not a field of {type(provider).__name__} "
                f"(megatron-core TransformerConfig / Megatron-Bridge provider); check the spelling"
            )
        setattr(provider, key, value)
    provider.finalize()
    return provider


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def check_megatron(
    lora: Any,
    backend: Any,
    *,
    num_layers: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    vocab_size: int | None = None,
    world_size: int | None = None,
    num_experts: int | None = None,
) -> None:
    """Everything Megatron would assert later, checked up front with lorarl's key names.

    Model-shape arguments are optional so the config-only part runs before the HF config
    is read; pass them once it is (num_experts: 0 for a dense model, None when unknown).
    """
    tp = backend.tensor_model_parallel_size
    pp = backend.pipeline_model_parallel_size
    for key, v in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"backend.{key}={v!r} must be an integer >= 1")
    bridge = backend.bridge
    if bridge not in ("megatron_bridge", "mbridge"):
        raise ConfigError(f"backend.bridge={bridge!r} is not valid; use one of: megatron_bridge, mbridge")
    impl = backend.transformer_impl
    if impl not in TRANSFORMER_IMPLS:
        raise ConfigError(f"backend.transformer_impl={impl!r} is not valid; use one of: {', '.join(TRANSFORMER_IMPLS)}")
    spec = peft_spec(lora)
    rank = spec.kwargs["dim"]
    if rank % tp:
        # ColumnParallelLinear(in, dim) for LoRA A: megatron's divide() asserts dim % tp == 0.
        raise ConfigError(f"model.lora.rank={rank} must be divisible by backend.tensor_model_parallel_size={tp}")
    sp = bool(backend.sequence_parallel)
    if sp and tp == 1:
        raise ConfigError(
            "backend.sequence_parallel=true needs backend.tensor_model_parallel_size > 1 (megatron-core refuses SP without TP)"
        )
    if sp and impl == "local":
        raise ConfigError(
            "backend.sequence_parallel=true needs backend.transformer_impl=transformer_engine: "
            "the local spec's RMSNorm (torch.nn.RMSNorm wrapper) does not support sequence parallelism"
        )
    if bridge == "mbridge":
        if not lora.merge:
            raise ConfigError(
                "backend.bridge=mbridge cannot export LoRA adapters; set model.lora.merge=true or backend.bridge=megatron_bridge"
            )
        if impl != "transformer_engine":
            raise ConfigError(
                "backend.bridge=mbridge maps TransformerEngine layer names only (linear_qkv.layer_norm_weight); "
                "set backend.transformer_impl=transformer_engine or backend.bridge=megatron_bridge"
            )
    _check_recompute(backend, num_layers, pp)
    check_expert_parallel(backend, num_experts, merge=bool(lora.merge))
    overrides = backend.override_transformer_config or {}
    if not isinstance(overrides, Mapping):
        raise ConfigError("backend.override_transformer_config must be a mapping of TransformerConfig fields to values")
    for key in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "sequence_parallel",
    ):
        if key in overrides:
            raise ConfigError(
                f"backend.override_transformer_config.{key} duplicates backend.{key}; set backend.{key} instead"
            )
    if world_size is not None and world_size % (tp * pp):
        raise ConfigError(
            f"backend.tensor_model_parallel_size x backend.pipeline_model_parallel_size = {tp * pp} "
            f"must divide the {world_size} devices"
        )
    ep = backend.expert_model_parallel_size * backend.expert_tensor_parallel_size
    if world_size is not None and world_size % (ep * pp):
        # megatron-core builds expert groups as ETP x EP x expert-DP inside each pipeline stage.
        raise ConfigError(
            f"backend.expert_model_parallel_size x backend.expert_tensor_parallel_size x "
            f"backend.pipeline_model_parallel_size = {ep * pp} must divide the {world_size} devices"
        )
    if num_attention_heads is not None and num_attention_heads % tp:
        raise ConfigError(
            f"backend.tensor_model_parallel_size={tp} does not divide the model's {num_attention_heads} attention heads"
        )
    if num_key_value_heads is not None and num_key_value_heads % tp:
        # Megatron can replicate KV heads when tp > groups, but the per-group qkv layout the
        # adapter export relies on assumes each rank holds whole groups.
        raise ConfigError(
            f"backend.tensor_model_parallel_size={tp} does not divide the model's {num_key_value_heads} "
            f"key/value heads; use a tensor parallel size that divides it"
        )
    if num_layers is not None and num_layers % pp:
        raise ConfigError(f"backend.pipeline_model_parallel_size={pp} does not divide the model's {num_layers} layers")
    if vocab_size is not None and vocab_size % tp:
        # VocabParallelEmbedding splits rows evenly; Megatron-Bridge does not pad Qwen2's vocab.
        raise ConfigError(
            f"backend.tensor_model_parallel_size={tp} does not divide the model's vocab_size={vocab_size}"
        )


def _check_recompute(backend: Any, num_layers: int | None, pp: int) -> None:
    gran = backend.recompute_granularity
    method = backend.recompute_method
    n = backend.recompute_num_layers
    if gran not in RECOMPUTE_GRANULARITIES:
        raise ConfigError(f"backend.recompute_granularity={gran!r} is not valid; use null, full or selective")
    if method not in RECOMPUTE_METHODS:
        raise ConfigError(f"backend.recompute_method={method!r} is not valid; use null, uniform or block")
    if gran is None:
        if method is not None or n is not None:
            raise ConfigError(
                "backend.recompute_method / backend.recompute_num_layers need backend.recompute_granularity=full"
            )
        return
    if gran == "selective":
        if n is not None:
            raise ConfigError(
                "backend.recompute_granularity=selective takes no backend.recompute_num_layers; set it to null"
            )
        return
    if method is None:
        raise ConfigError("backend.recompute_granularity=full needs backend.recompute_method=uniform or block")
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"backend.recompute_granularity=full needs backend.recompute_num_layers >= 1 (got {n!r})")
    if num_layers is not None and n > num_layers // pp:
        raise ConfigError(f"backend.recompute_num_layers={n} exceeds the {num_layers // pp} layers per pipeline stage")


def require_cuda() -> int:
    """Number of visible CUDA devices, or a one-line ConfigError pointing to the FSDP backend."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ConfigError("the Megatron backend needs CUDA GPUs (none found); use +backend=fsdp on CPU")
    return n


__all__ = [
    "PeftSpec",
    "peft_spec",
    "peft_adapter_config",
    "ProviderPlan",
    "provider_plan",
    "apply_provider_plan",
    "check_megatron",
    "require_cuda",
]
