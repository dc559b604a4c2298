"""`trainer.sync_fault` in merged mode: the same export bugs, made in the merged weights.

The merged payload is a base payload of plain HF names holding W_base + delta. Each fault
changes it as a merge with that bug would have made it (lorarl.sync.faults lists them). Faults
on the delta alone (scaling, transpose, a missing module, a stale layer) need W_base beside the
merged weight; the switch reads it from the engine's unmerged base stream and holds both whole
in memory: a test switch, never for training.

    gate_up_swap    gate_proj and up_proj exchanged (dense weights, every expert's halves)
    expert_swap     experts 0 and 1 exchanged in the first MoE layer (its stacks, or its per-expert
                    weights as the Megatron export names them)
    scale_x2/half   W_base + 2 delta / W_base + delta / 2
    transpose       W_base + delta^T where the weight is square
    missing_module  the first layer's v_proj (or first LoRA weight) sent without its delta
    stale_layer     the last layer's weights kept from the previous sync (the base at the first)
    base_as_lora    a LoRA factor sent in the merged payload (the payload refuses it)
    qk_swap         layer 0's k_proj exchanged with as many rows of q_proj
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import Tensor

from lorarl.errors import ConfigError

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_EXPERT_LAYER = re.compile(r"\.layers\.(\d+)\.mlp\.experts\.\d+\.")
Tensors = dict[str, Tensor]


def _delta_faults(name: str) -> Callable[[Tensors, Tensors], None] | None:
    """The faults that rewrite the delta: f(merged, base) changes `merged` in place."""

    def rescale(factor: float) -> Callable[[Tensors, Tensors], None]:
        def apply(merged: Tensors, base: Tensors) -> None:
            for n, w in merged.items():
                if n in base and not torch.equal(w, base[n]):
                    merged[n] = (base[n].float() + factor * (w.float() - base[n].float())).to(w.dtype)

        return apply

    def transpose(merged: Tensors, base: Tensors) -> None:
        done = 0
        for n, w in merged.items():
            if w.dim() == 2 and w.shape[0] == w.shape[1] and not torch.equal(w, base[n]):
                merged[n] = (base[n].float() + (w.float() - base[n].float()).T).to(w.dtype)
                done += 1
        if not done:
            raise ConfigError("trainer.sync_fault=transpose needs a LoRA module whose in and out sizes are equal")

    def missing(merged: Tensors, base: Tensors) -> None:
        changed = [n for n, w in merged.items() if not torch.equal(w, base[n])]
        if not changed:
            raise ConfigError("trainer.sync_fault=missing_module needs a merged weight that differs from its base")
        first = next((n for n in changed if ".layers.0." in n and ".v_proj." in n), changed[0])
        merged[first] = base[first]

    return {
        "scale_x2": rescale(2.0),
        "scale_half": rescale(0.5),
        "transpose": transpose,
        "missing_module": missing,
    }.get(name)


def corrupt_merged(name: str, merged: Tensors, engine, previous: Tensors) -> Tensors:
    """The merged weights as the fault `name` would have sent them; `previous` is stale_layer's
    memory of the last sync's last layer (updated in place)."""
    out = dict(merged)
    delta_fault = _delta_faults(name)
    if delta_fault is not None or name == "stale_layer":
        base = dict(engine.base_stream(merge=False))
        if delta_fault is not None:
            delta_fault(out, base)
        else:
            last = max(int(m[1]) for n in out if (m := _LAYER.search(n)))
            layer = f".layers.{last}."
            current = {n: t.clone() for n, t in out.items() if layer in n}
            for n in current:
                out[n] = previous.get(n, base[n])
            previous.clear()
            previous.update(current)
    elif name == "gate_up_swap":
        _gate_up_swap(out)
    elif name == "expert_swap":
        _expert_swap(out)
    elif name == "qk_swap":
        _qk_swap(out)
    elif name == "base_as_lora":
        factor = next(iter(engine.lora_state().items()))
        return {factor[0]: factor[1], **out}
    return out


def _gate_up_swap(out: Tensors) -> None:
    done = 0
    for n in [n for n in out if ".gate_proj." in n]:
        up = n.replace(".gate_proj.", ".up_proj.")
        if up in out:
            out[n], out[up] = out[up], out[n]
            done += 1
    for n in [n for n in out if n.endswith(".experts.gate_up_proj")]:
        half = out[n].shape[1] // 2
        out[n] = torch.cat([out[n][:, half:], out[n][:, :half]], dim=1)
        done += 1
    if not done:
        raise ConfigError("trainer.sync_fault needs an MLP with gate_proj and up_proj in the adapter")


def _expert_swap(out: Tensors) -> None:
    stacks = sorted((n for n in out if ".experts." in n and out[n].dim() == 3), key=lambda n: int(_LAYER.search(n)[1]))
    per_expert = sorted(int(m[1]) for n in out if (m := _EXPERT_LAYER.search(n)))
    if not stacks and per_expert:  # `model.layers.L.mlp.experts.E.<proj>.weight`, one tensor per expert
        stem = f".layers.{per_expert[0]}.mlp.experts."
        for n in [n for n in out if f"{stem}0." in n]:
            other = n.replace(f"{stem}0.", f"{stem}1.")
            out[n], out[other] = out[other], out[n]
        return
    if not stacks:
        raise ConfigError("trainer.sync_fault=expert_swap needs expert LoRA (model.lora.target_parameters)")
    layer = _LAYER.search(stacks[0])[0]
    for n in (n for n in stacks if layer in n):
        swapped = out[n].clone()
        swapped[[0, 1]] = out[n][[1, 0]]
        out[n] = swapped


def _qk_swap(out: Tensors) -> None:
    q = next((n for n in out if ".layers.0." in n and n.endswith(".q_proj.weight")), None)
    k = q.replace(".q_proj.", ".k_proj.") if q else None
    if k not in out:
        raise ConfigError("trainer.sync_fault=qk_swap needs LoRA on q_proj and k_proj of layer 0")
    rows = out[k].shape[0]
    q_new = out[q].clone()
    q_new[:rows] = out[k]
    out[k], out[q] = out[q][:rows].clone(), q_new
