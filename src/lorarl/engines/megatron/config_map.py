"""lorarl's `model.lora.*` and `backend.*` keys -> Megatron-Bridge PEFT and provider settings.

Inputs are the lead's config dataclasses or plain dicts with the same keys. Names on the
Megatron side were read from megatron-bridge 0.6.2 (`peft/lora.py` LoRA, `peft/canonical_lora.py`
CanonicalLoRA, `models/gpt_provider.py` GPTModelProvider) and megatron-core 0.19.2
(`transformer/transformer_config.py`, `model_parallel_config.py`); the tests check every key
this module emits against those classes' fields in the released wheels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lorarl.config.schema import LORA_INIT_METHODS as INIT_METHODS  # noqa: F401  (what the tests check against the bridge)
from lorarl.engines.megatron.names import resolve_lora_targets
from lorarl.errors import ConfigError
from lorarl.sync.experts import expert_projections

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
    """`model.lora` (checked by lorarl.config.schema.LoraConfig) -> LoRA/CanonicalLoRA(target_modules, dim, alpha, ...)."""
    lora_type, init_a, rank, alpha, dropout = lora.type, lora.init_A, lora.rank, lora.alpha, float(lora.dropout)
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
    "require_cuda",
]
