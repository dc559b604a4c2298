"""Liger's Triton kernels in the FSDP engine's training forward and backward (backend.liger_kernel)."""

from __future__ import annotations

from lorarl.errors import ConfigError, first_line

# The model types Liger has kernels for (automatic use applies them to these only).
LIGER_MODEL_TYPES = ("qwen2", "qwen3")


def use_liger_kernel(want: bool | None, compile_layers: bool, device: str) -> bool:
    """backend.liger_kernel (`want`), with null resolved: on when training on CUDA (Triton
    kernels) and the layers are not compiled (backend.compile: the compiler fuses the same
    elementwise work itself). Resolved on the driver (lorarl.driver.prepare)."""
    if want is None:
        return device == "cuda" and not compile_layers
    if want and device != "cuda":
        raise ConfigError(
            f"backend.liger_kernel=true needs CUDA (Triton kernels), but training runs on {device}; "
            "set backend.liger_kernel=null or false"
        )
    return want


def apply_liger_kernel(model) -> None:
    """Liger's fused RMSNorm, SwiGLU and RoPE in place of HF's eager ops, patched into the loaded
    model before PEFT wraps its linears. At 152k vocabulary and LoRA on every projection, the
    update's time beyond its matmuls is elementwise work; each of these replaces several
    kernels forward and backward with one. Liger's fused linear cross entropy stays off: the
    PPO loss needs per-token log-probs, which token_logprobs computes."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2, apply_liger_kernel_to_qwen3
    except ImportError as err:
        raise ConfigError(
            f"backend.liger_kernel: liger-kernel is not importable ({first_line(err)}); "
            "pip install -e '.[gpu]', or set backend.liger_kernel=false"
        ) from err
    patch = dict(zip(LIGER_MODEL_TYPES, (apply_liger_kernel_to_qwen2, apply_liger_kernel_to_qwen3))).get(
        model.config.model_type
    )
    if patch is None:
        raise ConfigError(
            f"backend.liger_kernel: no Liger kernels for model_type {model.config.model_type!r} "
            "(qwen2, qwen3); set backend.liger_kernel=false"
        )
    patch(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)
