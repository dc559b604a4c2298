"""LoRA on fused MoE experts: PEFT's stacked layout in the trainer, vLLM's per-expert one in the engine.

transformers 5 keeps a Qwen3-MoE layer's experts as two 3-D parameters, `mlp.experts.gate_up_proj`
[E, 2I, H] and `mlp.experts.down_proj` [E, H, I]; PEFT reaches them through `target_parameters`
and wraps each in a `ParamWrapper` whose factors hold every expert at once:
A [r*E, in] (expert-major rows), B [out, r*E] (expert-minor columns), so that expert e's delta
is `B.view(out, r, E)[:, :, e] @ A.view(E, r, in)[e]` in the parameter's (out, in) orientation.
Targeting both parameters nests the wrappers: the first listed sits at `experts.base_layer`,
the second at `experts`; which is which is read from the wrappers, never from shapes.

vLLM (0.26 on GPU, 0.32 on CPU) serves Qwen3-MoE expert LoRA through its fused-MoE LoRA layer
and reads it per expert, as `experts.<e>.gate_proj|up_proj|down_proj` with 2-D A [r, in] and
B [out, r] (its `packed_modules_mapping["experts"]`); gate and up share the gate_up A. Models
vLLM marks `is_3d_moe_weight` read stacked 3-D tensors instead: `check_engine_reads_per_expert`
refuses those rather than send a layout the engine would misread.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from lorarl.config.schema import QWEN3_MOE_EXPERT_PARAMETERS, check_target_parameters  # noqa: F401  (checked by the config)
from lorarl.contract.payload import ExpertWrapper
from lorarl.errors import SyncError

# What `model.lora.target_parameters` names for Qwen3-MoE's routed experts.
# The per-expert projections vLLM loads, by the fused parameter they come from (gate first:
# HF's Qwen3MoeExperts splits gate_up_proj's output with chunk(2), gate then up).
VLLM_EXPERT_PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# Parameters vLLM cannot serve LoRA on: the router (`mlp.gate`), embeddings, the output layer.

# The final adapter's vLLM copy, inside the PEFT folder (PEFT ignores subfolders).
VLLM_ADAPTER_SUBDIR = "vllm"

_PEFT_PAIR = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def is_moe_checkpoint(model_path: str | os.PathLike) -> bool:
    """Whether a local checkpoint's config.json describes routed experts."""
    config = os.path.join(model_path, "config.json")
    if not os.path.isfile(config):
        return False  # a hub id: nothing local to read
    with open(config) as fh:
        saved = json.load(fh)
    # transformers 5 saves Qwen3-MoE's num_experts as num_local_experts (an attribute alias).
    return int(saved.get("num_experts") or saved.get("num_local_experts") or 0) > 0


def expert_projections(target_parameters: Iterable[str]) -> list[str]:
    """The per-expert projections (gate_proj, up_proj, down_proj) the fused parameters cover
    (names the config checked): how a backend that keeps experts as linear modules (Megatron)
    reads target_parameters."""
    return [p for name in target_parameters for p in VLLM_EXPERT_PROJECTIONS[name.rsplit(".", 1)[-1]]]


def expert_wrappers(model: torch.nn.Module, prefix_of=lambda name: name) -> dict[str, ExpertWrapper]:
    """Every PEFT ParamWrapper over a 3-D expert parameter, by its saved module name."""
    out = {}
    for name, module in model.named_modules():
        if type(module).__name__ != "ParamWrapper" or getattr(module, "num_experts", 1) <= 1:
            continue
        parameter = module.parameter_name
        if parameter not in VLLM_EXPERT_PROJECTIONS:
            raise SyncError(f"PEFT wraps expert parameter '{name}.{parameter}', which vLLM has no LoRA layout for")
        if not getattr(module, "_did_swap_in_out_features", True):
            raise SyncError(
                f"expert parameter '{name}.{parameter}' is stored (experts, in, out); lorarl exports the "
                "(experts, out, in) layout of transformers' Qwen3-MoE experts only"
            )
        saved = prefix_of(name)
        out[saved] = ExpertWrapper(saved, parameter, module.num_experts)
    return out


def experts_module(wrapper_module: str) -> str:
    """The experts module a (possibly nested) wrapper belongs to: `.base_layer` suffixes removed."""
    while wrapper_module.endswith(".base_layer"):
        wrapper_module = wrapper_module[: -len(".base_layer")]
    return wrapper_module


def expert_factors(a: Tensor, b: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """PEFT's stacked factors A [r*E, in] (expert-major rows) and B [out, r*E] (expert-minor
    columns) as per-expert A [E, r, in] and B [E, out, r], views."""
    rank = a.shape[0] // num_experts
    return a.reshape(num_experts, rank, a.shape[1]), b.reshape(b.shape[0], rank, num_experts).permute(2, 0, 1)


def stacked_expert_factors(a: Tensor, b: Tensor, wrapper: ExpertWrapper) -> list[tuple[str, Tensor, Tensor]]:
    """Per projection vLLM loads from one PEFT stack: (gate_proj | up_proj | down_proj,
    A [E, r, in], B [E, out, r]), views of PEFT's factors. gate and up share A and split B's rows
    (gate first)."""
    e = wrapper.num_experts
    if a.shape[0] % e or b.shape[1] != a.shape[0]:
        raise SyncError(
            f"expert LoRA factors {tuple(a.shape)} / {tuple(b.shape)} of '{wrapper.module}' do not hold {e} "
            "experts of one rank"
        )
    a_e, b_e = expert_factors(a, b, e)
    projections = VLLM_EXPERT_PROJECTIONS[wrapper.parameter]
    rows = b.shape[0] // len(projections)
    return [(proj, a_e, b_e[:, i * rows : (i + 1) * rows]) for i, proj in enumerate(projections)]


def expert_delta(a: Tensor, b: Tensor, num_experts: int, scaling: float) -> Tensor:
    """scaling * B_e @ A_e for every expert, as [E, out, in] (the stacked parameter's layout)."""
    a_e, b_e = expert_factors(a, b, num_experts)
    return torch.bmm(b_e, a_e) * scaling


def to_vllm_layout(tensors: Mapping[str, Tensor], wrappers: Mapping[str, ExpertWrapper]) -> dict[str, Tensor]:
    """PEFT-saved adapter tensors -> the names and shapes vLLM's per-expert loader reads.

    Tensors of non-expert modules pass through unchanged; each wrapper's stacked pair becomes
    per-expert `<experts>.<e>.<proj>.lora_A/B.weight`. gate_proj and up_proj share A_e and split
    B_e's rows in half. Views are cloned so the receiver owns contiguous tensors."""
    out: dict[str, Tensor] = {}
    pairs: dict[str, dict[str, Tensor]] = {}
    for name, tensor in tensors.items():
        match = _PEFT_PAIR.match(name)
        if match is not None and match["module"] in wrappers:
            pairs.setdefault(match["module"], {})[match["ab"]] = tensor
        else:
            out[name] = tensor
    missing = sorted(set(wrappers) - set(pairs))
    if missing:
        raise SyncError(f"the adapter has no LoRA tensors for expert wrapper '{missing[0]}'")
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise SyncError(f"expert wrapper '{module}' has lora_{''.join(ab)} but not both factors")
        base = experts_module(module)
        for proj, a_e, b_e in stacked_expert_factors(ab["A"], ab["B"], wrappers[module]):
            for e in range(a_e.shape[0]):
                stem = f"{base}.{e}.{proj}"
                out[f"{stem}.lora_A.weight"] = a_e[e].contiguous().clone()
                out[f"{stem}.lora_B.weight"] = b_e[e].contiguous().clone()
    return out


def vllm_form(tensors: Mapping[str, Tensor], config: dict, experts: Mapping[str, ExpertWrapper]) -> tuple[dict, dict]:
    """An adapter as vLLM's loader reads it, in tensors of its own: expert stacks split per expert
    (`to_vllm_layout`), the rest copied (the loader scales lora_B in place)."""
    split = to_vllm_layout(tensors, experts) if experts else dict(tensors)  # split experts are copies
    out = {n: t.clone() if n in tensors else t for n, t in split.items()}
    return out, vllm_adapter_config(config) if experts else config


def vllm_adapter_config(peft_config: dict) -> dict:
    """The adapter config beside the per-expert tensors: the expert projections listed as target
    modules (the names the tensors carry), no target_parameters (nothing is stacked any more)."""
    targets = peft_config["target_modules"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    experts = [p for projections in VLLM_EXPERT_PROJECTIONS.values() for p in projections]
    out = {k: v for k, v in peft_config.items() if k != "target_parameters"}
    out["target_modules"] = sorted(set(targets) | set(experts))
    return out


def check_engine_reads_per_expert(expert_names: list[str] | None, is_3d: bool) -> None:
    """Refuse an engine that does not read expert LoRA as `experts.<e>.<proj>` 2-D tensors."""
    if is_3d:
        raise SyncError(
            "this vLLM model reads expert LoRA as stacked 3-D tensors (is_3d_moe_weight); lorarl exports the "
            "per-expert layout, so the engine would misread it; use model.lora.merge=true for this model"
        )
    if expert_names is not None and not any(re.fullmatch(r"experts\.\d+\.\w+", n) for n in expert_names):
        raise SyncError(
            f"this vLLM expects expert LoRA under {expert_names[:3]}, not experts.<e>.<proj>; lorarl cannot "
            "export that layout (use model.lora.merge=true)"
        )
