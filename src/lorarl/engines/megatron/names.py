"""LoRA target names and bridge export names for the Megatron backend (Qwen2, Qwen3, Qwen3-MoE).

Pure Python, no Megatron import. Two jobs:
- `resolve_lora_targets`: what a `model.lora.target_modules` list means for Megatron-Bridge's
  `LoRA` (fused linear_qkv / linear_fc1: one adapter covers q,k,v or gate,up) and
  `CanonicalLoRA` (one adapter per projection), and which HF projections the exported adapter
  then covers. Only the seven linear projections take LoRA: embeddings, the output layer,
  Qwen3's per-head `q_norm`/`k_norm` and a MoE router are base weights. On Qwen3-MoE,
  gate/up/down (linear_fc1/linear_fc2) are the experts' projections.
- `expert_lora_name` / `parse_expert_lora_name`: the per-expert PEFT names an expert adapter
  travels under (lorarl.engines.megatron.experts says why this layout).
- `normalize_adapter_names` / `normalize_base_names`: Megatron-Bridge 0.6.2's export names
  (`models/conversion/peft_bridge.py`, `model_bridge.py`) -> the names the vLLM rollout takes.

The layout rules the bridge applies to tensors (q/k/v interleaving, [gate; up] per TP rank,
fused-adapter splitting) are restated as a test reference in tests/megatron_reference.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from lorarl.config.schema import LORA_TYPES  # noqa: F401  (part of this module's names; the schema checks model.lora.type)
from lorarl.errors import ConfigError, SyncError

PEFT_PREFIX = "base_model.model."

# ---------------------------------------------------------------------------------------------
# LoRA target modules
# ---------------------------------------------------------------------------------------------

HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
CANONICAL_TARGETS = (
    "linear_q",
    "linear_k",
    "linear_v",
    "linear_proj",
    "linear_fc1_up",
    "linear_fc1_gate",
    "linear_fc2",
)
# Qwen3's per-head query/key RMSNorm, under HF and Megatron names: base weights only.
QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")

# Each accepted name -> the HF projections it covers. A fused Megatron target always covers
# every projection packed in it: LoRA on linear_qkv has one A and one B for all of q/k/v.
_COVERS: dict[str, tuple[str, ...]] = {
    **{p: (p,) for p in HF_PROJECTIONS},
    "all-linear": HF_PROJECTIONS,
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
    "linear_q": ("q_proj",),
    "linear_k": ("k_proj",),
    "linear_v": ("v_proj",),
    "linear_fc1_gate": ("gate_proj",),
    "linear_fc1_up": ("up_proj",),
}
_HF_TO_FUSED = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
_HF_TO_CANONICAL = dict(
    zip(
        HF_PROJECTIONS,
        ("linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_gate", "linear_fc1_up", "linear_fc2"),
    )
)
_FUSED_TO_HF = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# A Qwen3-MoE router under HF and Megatron names. vLLM's LoRA layers do not wrap the router
# (a replicated linear feeding top-k), so an adapter on it could not be served.
ROUTER_NAMES = ("gate", "router", "shared_expert_gate")


@dataclass(frozen=True)
class LoraTargets:
    """What a `model.lora.target_modules` list means on the Megatron backend."""

    megatron: tuple[str, ...]  # names for Megatron-Bridge LoRA / CanonicalLoRA target_modules
    hf: tuple[str, ...]  # HF projections that get an adapter (what vLLM/PEFT will see)
    widened: tuple[str, ...]  # HF projections adapted although not asked for (fused LoRA)


def resolve_lora_targets(target_modules: Iterable[str], lora_type: str = "lora") -> LoraTargets:
    """Map HF or Megatron target names to Megatron-Bridge targets for `lora` or `canonical_lora`."""
    if isinstance(target_modules, str):
        target_modules = [target_modules]
    names = list(target_modules)
    if not names:
        raise ConfigError("model.lora.target_modules is empty; list modules such as q_proj,v_proj or all-linear")
    asked: list[str] = []
    for name in names:
        if name not in _COVERS:
            raise ConfigError(_unmappable(name))
        asked.extend(_COVERS[name])
    asked_set = set(asked)
    if lora_type == "lora":
        megatron = _ordered({_HF_TO_FUSED[p] for p in asked_set}, FUSED_TARGETS)
        hf = _ordered({h for m in megatron for h in _FUSED_TO_HF[m]}, HF_PROJECTIONS)
    else:
        megatron = _ordered({_HF_TO_CANONICAL[p] for p in asked_set}, CANONICAL_TARGETS)
        hf = _ordered(asked_set, HF_PROJECTIONS)
    widened = tuple(p for p in hf if p not in asked_set)
    return LoraTargets(megatron=megatron, hf=hf, widened=widened)


def _ordered(items: set[str], order: Sequence[str]) -> tuple[str, ...]:
    return tuple(x for x in order if x in items)


def _unmappable(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    accepted = (
        f"HF names ({','.join(HF_PROJECTIONS)}, all-linear) or Megatron names "
        f"({','.join(FUSED_TARGETS)}, {','.join(c for c in CANONICAL_TARGETS if c not in FUSED_TARGETS)})"
    )
    if leaf in QK_NORMS:
        return (
            f"model.lora.target_modules contains {name!r}: Qwen3's per-head q_norm/k_norm are base weights "
            f"(RMSNorm scales, not linears) and never carry LoRA; use {accepted}"
        )
    if leaf in ROUTER_NAMES:
        return (
            f"model.lora.target_modules contains {name!r}: the MoE router cannot carry LoRA (vLLM serves no adapter "
            f"on it); the experts' gate_proj/up_proj/down_proj and attention can; use {accepted}"
        )
    if leaf in ("lm_head", "embed_tokens", "output_layer", "word_embeddings"):
        return (
            f"model.lora.target_modules contains {name!r}: embeddings and the output layer cannot carry LoRA "
            f"on the Megatron backend (and vLLM rejects them); use {accepted}"
        )
    if "." in name or "*" in name:
        return f"model.lora.target_modules contains {name!r}: per-layer paths and wildcards are not supported; use {accepted}"
    return f"model.lora.target_modules contains {name!r}, which maps to no Qwen linear projection; use {accepted}"


# ---------------------------------------------------------------------------------------------
# Bridge export streams -> names the vLLM rollout accepts
# ---------------------------------------------------------------------------------------------

_LORA_KEY = re.compile(
    r"^(?:base_model\.model\.)?(model\.layers\.\d+\.(?:self_attn|mlp|mlp\.experts\.\d+)\.([a-z_]+))"
    r"\.lora_([AB])\.weight$"
)
_EXPERT_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)"
    r"\.lora_([AB])\.weight$"
)


def expert_lora_name(layer: int, expert: int, projection: str, ab: str) -> str:
    """PEFT key of one expert's LoRA tensor, e.g.
    base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight (A [r, in], B [out, r],
    full tensors: vLLM slices them for its own tensor parallelism)."""
    if projection not in EXPERT_PROJECTIONS or ab not in ("A", "B"):
        raise ValueError(f"expert LoRA needs one of {EXPERT_PROJECTIONS} and A or B, got {projection!r}, {ab!r}")
    return f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts.{expert}.{projection}.lora_{ab}.weight"


def parse_expert_lora_name(name: str) -> tuple[int, int, str, str] | None:
    """(layer, expert, projection, "A"|"B") of an expert LoRA key, None for any other key."""
    m = _EXPERT_KEY.match(name)
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)


def normalize_adapter_names(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron-Bridge export_adapter_weights names -> PEFT names vLLM's LoRA parser takes.

    The bridge yields `model.layers.N.self_attn.q_proj.lora_A.weight` (HF module path, no PEFT
    prefix; the same A tensor three times for fused qkv), and for Qwen3-MoE experts
    `model.layers.N.mlp.experts.E.gate_proj.lora_A.weight` (its registry's per-expert HF
    names; the same A for gate and up of one expert). vLLM wants
    `base_model.model.<module>.lora_A.weight` with per-projection modules only: fused
    `qkv_proj`/`gate_up_proj` (mbridge main's naming) would be rejected by vLLM, so they
    fail here with the tensor's name.
    """
    seen: set[str] = set()
    for name, tensor in named:
        m = _LORA_KEY.match(name)
        expert = ".experts." in name
        if not m or m.group(2) not in (EXPERT_PROJECTIONS if expert else HF_PROJECTIONS):
            raise SyncError(
                f"adapter export yielded {name!r}; expected model.layers.N.(self_attn|mlp|mlp.experts.E)."
                "<q|k|v|o|gate|up|down>_proj.lora_A|B.weight"
            )
        key = f"{PEFT_PREFIX}{m.group(1)}.lora_{m.group(3)}.weight"
        if key in seen:
            raise SyncError(f"adapter export yielded {key!r} twice")
        seen.add(key)
        yield key, tensor


def normalize_base_names(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """export_hf_weights(merge_adapter_weights=False) names -> plain HF names.

    Megatron-Bridge inserts `.base_layer` before the last component of every LoRA-wrapped
    weight (`q_proj.base_layer.weight`; biases and fused norms keep their plain names). The
    rollout owns the rule for its own engine (vLLM versions differ), so the payload carries
    plain HF names only.
    """
    seen: set[str] = set()
    for name, tensor in named:
        if ".lora_" in name:
            raise SyncError(f"base export yielded adapter tensor {name!r}; a base payload carries base weights only")
        plain = name.replace(".base_layer.", ".")
        if plain.endswith(".base_layer"):
            plain = plain[: -len(".base_layer")]
        if plain in seen:
            raise SyncError(f"base export yielded {plain!r} twice")
        seen.add(plain)
        yield plain, tensor


__all__ = [
    "PEFT_PREFIX",
    "HF_PROJECTIONS",
    "FUSED_TARGETS",
    "CANONICAL_TARGETS",
    "LORA_TYPES",
    "EXPERT_PROJECTIONS",
    "ROUTER_NAMES",
    "LoraTargets",
    "resolve_lora_targets",
    "expert_lora_name",
    "parse_expert_lora_name",
    "normalize_adapter_names",
    "normalize_base_names",
]
