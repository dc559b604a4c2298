"""The dtype a vLLM engine computes in, from rollout.dtype and the checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

from lorarl.errors import ConfigError


def engine_dtype(model_path: str | os.PathLike, dtype: str, is_cpu: bool, lora: bool) -> str:
    resolved = checkpoint_dtype(model_path, dtype)
    if is_cpu or not lora or resolved != "float32":
        return resolved
    # vLLM's GPU LoRA kernels (punica, Triton) take 16-bit activations only.
    if dtype == "auto":
        return "bfloat16"
    raise ConfigError(
        "rollout.dtype=float32: vLLM's GPU LoRA kernels run in float16/bfloat16 only; set rollout.dtype=bfloat16 "
        "(training keeps model.dtype) or model.lora.merge=true"
    )


def checkpoint_dtype(model_path: str | os.PathLike, dtype: str) -> str:
    """'auto' means the checkpoint's dtype, as in transformers.

    vLLM's own 'auto' serves float32 checkpoints in 16-bit: the tiny fp32 model then
    disagreed with the fp32 trainer by up to 0.04 in per-token log-prob (6e-5 in fp32).
    """
    if dtype != "auto":
        return dtype
    from lorarl.files.jsonio import read_json_if_valid

    saved = read_json_if_valid(Path(model_path) / "config.json")
    if saved is None:
        return dtype
    return "float32" if saved.get("dtype", saved.get("torch_dtype")) == "float32" else dtype
