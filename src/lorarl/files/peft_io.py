"""PEFT's formats: the LoraConfig for model.lora, and the adapter folder that checkpoints, the
final export and the tmpfs sync share.

`adapter_model.safetensors` + `adapter_config.json`: what `PeftModel.from_pretrained` and
vLLM's `--lora-modules` / `LoRARequest` load. Weights only (safetensors), never pickles.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lorarl.errors import SyncError

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def save_peft_adapter(directory: str | os.PathLike, tensors: dict[str, torch.Tensor], adapter_config: dict) -> Path:
    """Write (or overwrite) the adapter folder; the tensors are copied to host memory first.

    Refuses an empty adapter: PEFT and vLLM would load it as the untrained base model."""
    if not tensors:
        raise SyncError(
            f"no LoRA tensors to write to {directory}; an empty adapter folder would load as the base model"
        )
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(out / WEIGHTS_FILE))
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2, sort_keys=True))
    return out


def load_peft_adapter(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    d = Path(directory)
    return load_file(str(d / WEIGHTS_FILE)), json.loads((d / CONFIG_FILE).read_text())


def peft_lora_config(lora):
    """PEFT's LoraConfig for model.lora (lorarl.config's LoRA group): what the trainer trains, and
    what the start-up plan counts (lorarl.driver.base_plan.layout_bytes)."""
    from peft import LoraConfig

    targets = lora.target_modules
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules="all-linear" if list(targets) == ["all-linear"] else list(targets),
        target_parameters=list(lora.target_parameters) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
