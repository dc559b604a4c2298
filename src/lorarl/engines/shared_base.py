"""One copy of the frozen base per replica: the training model's base parameters are views of
the colocated vLLM engine's weight tensors (lorarl.rollout.vllm.base_views), the LoRA parameters
the trainer's own.

The driver decides whether the base is shared (lorarl.driver.base_plan); `model_on_views`
builds the HF model with no weights of its own and binds the views. With the base shared the
trainer never loads it, never shards it (FSDP manages the LoRA parameters only, so no base
all-gather; lorarl.engines.fsdp_shard) and never sends it (no base payload: the engine loaded
it from disk, lorarl.sync.session refuses one); vLLM's sleep may release only its KV cache
(lorarl.rollout.vllm.engine).
"""

from __future__ import annotations

import torch

from lorarl.errors import ModelError


def model_on_views(model_path: str, dtype: torch.dtype, views: dict[str, torch.Tensor], trust_remote_code: bool):
    """The HF causal LM of `model_path` with every parameter bound to `views[name]` (frozen, the
    same storage) and no weights loaded or allocated; its buffers (rotary tables) are computed
    from the config and placed beside the views. A parameter without a view, or a view of
    another shape or dtype, is a ModelError naming it: a wrong binding must never train."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
        )
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    head = model.get_output_embeddings().weight if tied else None  # tied to the input embedding below
    device = None
    for name, meta in list(model.named_parameters()):
        if meta is head:
            continue
        view = views.get(name)
        if view is None:
            raise ModelError(f"vLLM's engine holds no tensor for {name}; set backend.share_base=false")
        if tuple(view.shape) != tuple(meta.shape) or view.dtype != meta.dtype:
            raise ModelError(
                f"vLLM's tensor for {name} is {tuple(view.shape)} {view.dtype}, the model needs "
                f"{tuple(meta.shape)} {meta.dtype}; set backend.share_base=false"
            )
        bind(model, name, view)
        device = view.device
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    for module in model.modules():
        for key, buf in module.named_buffers(recurse=False):
            module._buffers[key] = buf.to(device)
    return model


def bind(model: torch.nn.Module, name: str, view: torch.Tensor) -> None:
    """Make parameter `name` of `model` a frozen Parameter over `view`'s storage (no copy)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    module._parameters[leaf] = torch.nn.Parameter(view, requires_grad=False)


def frozen_params(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    """The parameters that do not train (the shared base), for FSDP to leave alone."""
    return {p for p in model.parameters() if not p.requires_grad}
