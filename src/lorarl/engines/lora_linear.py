"""PEFT's LoRA linear as one autograd node: y = x W^T + b + s (x A^T) B^T, W and b frozen.

PEFT computes the base layer, then `lora_B(lora_A(dropout(x))) * scaling`, then the sum: five
kernels and thirteen autograd nodes (views and transposes included) for a [rows, seq, width]
input, launched from Python through three module calls. On one GPU the 7B update is bound by
the host's time per launch (~46k launches per update for 2.4 s of kernels;
bench/results/update_profile_2026-12-04), so `backend.fused_lora=true` swaps each LoRA linear's
forward for `LoRALinear`: three matmuls forward (the scale folded into the last one's alpha),
five backward (the scales again inside the GEMMs), no gradient for the frozen base: eight
kernels and one autograd node where PEFT launches twelve kernels from thirteen nodes. The same
math as PEFT; it runs only where PEFT's forward would do exactly this (adapter enabled and not
merged, one active vanilla-LoRA adapter, no dropout, one dtype, no autocast, a frozen bias) and
calls PEFT's own forward otherwise (the reference pass under `disable_adapter`, DoRA, ...).
"""

from __future__ import annotations

import types

import torch
from torch import nn


class LoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
        x2 = x.reshape(-1, x.shape[-1])
        xa = x2 @ lora_a.t()  # [tokens, rank]
        y = torch.nn.functional.linear(x2, weight, bias)
        y.addmm_(xa, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x2, weight, lora_a, lora_b, xa)
        ctx.scaling = scaling
        ctx.x_shape = x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x2, weight, lora_a, lora_b, xa = ctx.saved_tensors
        s = ctx.scaling
        g = grad.reshape(-1, grad.shape[-1])
        gb = _scaled_mm(g, lora_b, s)  # [tokens, rank]: s (g B), scaled inside the GEMM
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (g @ weight).addmm_(gb, lora_a).view(ctx.x_shape)
        da = gb.t() @ x2 if ctx.needs_input_grad[3] else None
        db = _scaled_mm(g.t(), xa, s) if ctx.needs_input_grad[4] else None
        return dx, None, None, da, db, None


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    """s (a b) as one GEMM: addmm with beta=0 ignores the uninitialised input (no NaN from it)."""
    return a.new_empty(a.shape[0], b.shape[1]).addmm_(a, b, beta=0, alpha=s)


def plain_adapter(layer) -> str | None:
    """The name of a PEFT LoRA layer's one active adapter when its forward applies exactly that,
    unmerged, as vanilla LoRA without dropout; else None (disabled, merged, several, DoRA, ...)."""
    if layer.disable_adapters or layer.merged:
        return None
    adapters = layer.active_adapters
    if len(adapters) != 1:
        return None
    name = adapters[0]
    if name not in layer.lora_A or name in layer.lora_variant or not isinstance(layer.lora_dropout[name], nn.Identity):
        return None
    return name


def _fusable(layer, x: torch.Tensor) -> str | None:
    """The active adapter's name when PEFT's forward would be exactly LoRALinear, else None."""
    name = plain_adapter(layer)
    if name is None:
        return None
    base, a, b = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    if type(base) is not nn.Linear or b.bias is not None or base.weight.requires_grad:
        return None
    if base.bias is not None and base.bias.requires_grad:  # LoraConfig(bias="all"): PEFT trains it
        return None
    if not (x.dtype == base.weight.dtype == a.weight.dtype == b.weight.dtype) or torch.is_autocast_enabled():
        return None
    return name


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    name = None if (args or kwargs) else _fusable(self, x)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    base = self.base_layer
    return LoRALinear.apply(
        x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name]
    )


def fuse_lora_linears(peft_model: nn.Module) -> int:
    """Give every PEFT LoRA Linear (exactly that class: quantized and other subclasses keep their
    own forward) the fused forward, in place; parameter names do not change. The count."""
    from peft.tuners.lora.layer import Linear

    layers = [m for m in peft_model.modules() if type(m) is Linear]
    for layer in layers:
        layer.forward = types.MethodType(_forward, layer)
    return len(layers)
