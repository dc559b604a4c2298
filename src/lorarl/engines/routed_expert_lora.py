"""Expert LoRA on the routed tokens: y_e = x W_e^T + s (x A_e^T) B_e^T for the tokens expert e gets.

PEFT serves LoRA on a fused expert stack (`target_parameters`) by folding it into the weight on
every forward: W' = W + s B A for all E experts (a `baddbmm` the size of the whole stack), then
transformers' expert kernels run on W'. W' needs a gradient, so the backward also forms the full
[E, out, in] gradient of the stack and reduces it to A and B: per layer and micro-batch, two
tensors the size of the stack and a weight-gradient GEMM as large as the experts' forward. Here
the frozen W gets no gradient and the adapter acts on each expert's routed tokens through two
rank-r products, as PEFT's LoRA linear does for a dense layer: the same function (W + s B A
applied to the same rows), different rounding. `backend.routed_expert_lora=true` installs it
(lorarl.engines.fsdp); it runs only where PEFT's forward would apply exactly one unmerged
adapter without dropout, and calls PEFT's own forward otherwise (the reference pass under
`disable_adapter`, a merge, ...).

On CUDA the per-expert products are grouped GEMMs (torch's grouped_mm, bf16, tokens sorted by
expert as transformers' grouped_mm experts do); elsewhere, or where grouped_mm's 16-byte
alignment does not hold, one matmul per expert with tokens.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lorarl.config.schema import EXPERT_PROJECTIONS
from lorarl.engines.lora_linear import plain_adapter
from lorarl.sync.experts import expert_factors


def route_expert_lora(peft_model: nn.Module) -> int:
    """Give the outermost PEFT ParamWrapper over every experts module the routed forward, in
    place (parameter names and the adapter's layout do not change). The count."""
    from peft.tuners.lora.layer import ParamWrapper

    inner = {id(m.base_layer) for m in peft_model.modules() if isinstance(m, ParamWrapper)}
    outer = [m for m in peft_model.modules() if isinstance(m, ParamWrapper) and id(m) not in inner]
    for wrapper in outer:
        wrapper.forward = types.MethodType(_forward, wrapper)
    return len(outer)


def _chain(outer: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """(the nested wrappers, outermost first; the experts module they wrap)."""
    wrappers, module = [], outer
    while type(module).__name__ == "ParamWrapper":
        wrappers.append(module)
        module = module.base_layer
    return wrappers, module


def _routable(wrappers: list[nn.Module], experts: nn.Module) -> str | None:
    """The active adapter's name when every wrapper would apply exactly it, unmerged and without
    dropout, to a (experts, out, in) stack of a gate-up/down experts module; else None."""
    names = {plain_adapter(w) for w in wrappers}
    if len(names) != 1 or None in names:
        return None
    for w in wrappers:
        if not w._did_swap_in_out_features or w.parameter_name not in EXPERT_PROJECTIONS:
            return None
        if w.num_experts != experts.num_experts:
            return None
    if not getattr(experts, "is_concatenated", True) or getattr(experts, "has_bias", False):
        return None
    return names.pop()


def _forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, *args, **kwargs) -> Tensor:
    wrappers, experts = _chain(self)
    name = None if (args or kwargs) else _routable(wrappers, experts)
    if name is None:
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    lora = {}
    for w in wrappers:
        a, b = expert_factors(w.lora_A[name].weight, w.lora_B[name].weight, w.num_experts)
        lora[w.parameter_name] = (a.to(hidden_states.dtype), b.to(hidden_states.dtype), w.scaling[name])
    return routed_experts(experts, hidden_states, top_k_index, top_k_weights, lora)


def routed_experts(experts, hidden_states, top_k_index, top_k_weights, lora: dict) -> Tensor:
    """transformers' Qwen3-MoE experts (gate_up_proj [E, 2I, H] with gate rows first, down_proj
    [E, H, I]) with LoRA `lora[parameter] = (A [E, r, in], B [E, out, r], scaling)` on the routed
    rows. hidden_states [T, H]; top_k_index and top_k_weights [T, k]."""
    k = top_k_index.shape[-1]
    expert_ids, order = torch.sort(top_k_index.reshape(-1), stable=True)  # the same order when recomputed
    rows = order // k  # the token behind each sorted (token, expert) pair
    x = hidden_states[rows]
    ends = torch.bincount(expert_ids, minlength=experts.num_experts).cumsum(0).to(torch.int32)
    grouped = _grouped_mm if _grouped_mm_fits(x, experts, lora) else _per_expert_mm
    gate_up = _project(grouped, x, experts.gate_up_proj, lora.get("gate_up_proj"), ends)
    gate, up = gate_up.chunk(2, dim=-1)
    h = experts.act_fn(gate) * up
    out = _project(grouped, h, experts.down_proj, lora.get("down_proj"), ends)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(hidden_states).index_add_(0, rows, out.to(hidden_states.dtype))


def _project(grouped, x: Tensor, weight: Tensor, factors, ends: Tensor) -> Tensor:
    """Each row through its expert's `weight` [E, out, in] (frozen) and LoRA factors."""
    y = grouped(x, weight, ends)
    if factors is None:
        return y
    a, b, scaling = factors
    return y + grouped(grouped(x, a, ends), b.contiguous(), ends) * scaling


def _grouped_mm(x: Tensor, weight: Tensor, ends: Tensor) -> Tensor:
    """Rows [ends[e-1], ends[e]) of x times weight[e]^T, one grouped GEMM."""
    return F.grouped_mm(x, weight.transpose(-2, -1), offs=ends)


def _per_expert_mm(x: Tensor, weight: Tensor, ends: Tensor) -> Tensor:
    """What _grouped_mm computes, one matmul per expert that has rows (any device and dtype)."""
    starts = [0, *ends[:-1].tolist()]
    parts = [x[s:e] @ weight[i].t() for i, (s, e) in enumerate(zip(starts, ends.tolist(), strict=True)) if e > s]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


def _grouped_mm_fits(x: Tensor, experts, lora: dict) -> bool:
    """torch's grouped_mm on CUDA in bf16, where every operand's rows are 16-byte aligned."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16 or not hasattr(F, "grouped_mm"):
        return False
    widths = [*experts.gate_up_proj.shape[1:], *experts.down_proj.shape[1:]]
    widths += [a.shape[1] for a, _, _ in lora.values()]  # the rank: the inner width of B's product
    return all(w * x.element_size() % 16 == 0 for w in widths)
