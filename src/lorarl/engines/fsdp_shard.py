"""FSDP2 over a PEFT model: every decoder layer a unit, then the root; regional compilation."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard


def decoder_layers(peft_model) -> list[torch.nn.Module]:
    inner = peft_model.base_model.model  # the HF *ForCausalLM
    return list(inner.model.layers)


def compile_layers(peft_model) -> None:
    """torch.compile every decoder layer (LoRA linears included) in place, which keeps the
    parameter names. The layers share one compiled graph (modules are graph inputs, not
    constants), compiled for dynamic shapes since every micro-batch has its own rows and length.
    Called before `shard`: FSDP's hooks run around the compiled call, not inside it."""
    for layer in decoder_layers(peft_model):
        layer.compile(dynamic=True)


def shard(peft_model, mesh, device: torch.device, **fsdp_kwargs):
    """fully_shard every decoder layer, then the root; then one token through it, adapter on.

    FSDP2 fixes each unit's gradient dtypes at the root's first forward, from the parameters
    that require grad at that moment. PEFT's disable_adapter() switches requires_grad off, so a
    first forward for reference log-probs left the float32 LoRA weights with bf16 gradients,
    which torch refuses to assign (seen on GPU with KL loss before any update)."""
    for layer in decoder_layers(peft_model):
        fully_shard(layer, mesh=mesh, **fsdp_kwargs)
    fully_shard(peft_model, mesh=mesh, **fsdp_kwargs)
    with torch.no_grad():
        peft_model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    if not fsdp_kwargs.get("reshard_after_forward", True):
        reshard_all(peft_model)
    return peft_model


def reshard_all(peft_model) -> None:
    """Register the sharded parameters again after a forward without autograd.

    With `reshard_after_forward=False` FSDP2 keeps a forward's unsharded parameters registered
    until the backward reshards them, and a forward under no_grad has no backward. Everything
    else reads the registered parameters as the shards: the optimizer's list, the adapter
    gather, PEFT's adapter switch setting requires_grad (on the unsharded copies, the sharded
    LoRA weights would stay frozen and an update's loss have no graph)."""
    for module in peft_model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def fsdp_units(model) -> list[tuple[str, FSDPModule]]:
    """Every FSDP unit with the name prefix of its params, root first."""
    return [(f"{n}." if n else "", m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]


def own_params(unit: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Params managed by this unit, not by a nested FSDP unit inside it."""
    nested = [f"{n}." for n, m in unit.named_modules() if n and isinstance(m, FSDPModule)]
    for name, p in unit.named_parameters():
        if not any(name.startswith(pre) for pre in nested):
            yield name, p
