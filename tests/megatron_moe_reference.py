"""A reference for Megatron-Bridge's Qwen3-MoE layouts, for tests only (the MoE half of
tests/megatron_reference.py, which holds the attention rules reused here).

What Megatron-Bridge 0.6.2's Qwen3MoEBridge (`models/qwen/qwen3_moe_bridge.py`) and its PEFT
export (`models/conversion/peft_bridge.py`) do to Qwen3-MoE tensors, in plain torch:
- Experts are named per expert on the HF side (`model.layers.L.mlp.experts.E.gate_proj.weight`,
  the checkpoint layout; transformers 5.x fuses them in memory into `mlp.experts.gate_up_proj`
  [E, 2I, H] = [gate; up] and `down_proj` [E, H, I], and writes them back per expert on save).
- Megatron holds experts as a SequentialMLP with the local layer spec
  (`mlp.experts.local_experts.K.linear_fc1|linear_fc2`, K the index on its expert-parallel
  rank) or a grouped linear with TransformerEngine (`mlp.experts.linear_fc1.weightE`).
  linear_fc1 is [gate; up] on one rank; with expert tensor parallelism ETP each rank holds
  [gate_r; up_r], so the gathered tensor is [g_0, u_0, g_1, u_1, ...].
- The router (`mlp.router.weight` <-> `mlp.gate.weight`) is a base weight.
- Fused LoRA on an expert's linear_fc1: one A [r, H] and B [2I, r]; per expert, gate_proj and
  up_proj get the same A and B split by the base-weight row rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from lorarl.engines.megatron.names import expert_lora_name
from lorarl.errors import ModelError
from tests.megatron_reference import AttentionShape, merge_gate_up, merge_qkv, split_gate_up, split_qkv

# Per-layer non-expert names, Megatron suffix -> HF suffix (local spec norms).
_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_QKV = "self_attention.linear_qkv.weight"
_MC_EXPERT = re.compile(
    r"^decoder\.layers\.(\d+)\.mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$"
)
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def expert_param(layer: int, expert: int, module: str, grouped: bool = False) -> str:
    """Megatron name of one expert's linear (global expert index)."""
    if grouped:
        return f"decoder.layers.{layer}.mlp.experts.{module}.weight{expert}"
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{module}.weight"


def megatron_to_hf_names(mc_name: str) -> tuple[str, ...]:
    """HF names stored in one Megatron Qwen3-MoE parameter (global expert indices)."""
    if mc_name in _GLOBAL:
        return (_GLOBAL[mc_name],)
    m = _MC_EXPERT.match(mc_name)
    if m:
        layer, expert = m.group(1), m.group(2) or m.group(5)
        module = m.group(3) or m.group(4)
        stem = f"model.layers.{layer}.mlp.experts.{expert}"
        return (
            (f"{stem}.gate_proj.weight", f"{stem}.up_proj.weight")
            if module == "linear_fc1"
            else (f"{stem}.down_proj.weight",)
        )
    m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", mc_name)
    if m:
        i, rest = m.groups()
        if rest in _LAYER:
            return (f"model.layers.{i}.{_LAYER[rest]}",)
        if rest == _QKV:
            return tuple(f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkv")
    raise ModelError(f"no Qwen3-MoE Hugging Face name for Megatron parameter {mc_name!r}")


def hf_to_megatron_state(
    hf: Mapping[str, torch.Tensor], shape: AttentionShape, etp: int = 1
) -> dict[str, torch.Tensor]:
    """Full Megatron state (SequentialMLP names, global experts) from a per-expert HF state."""
    out: dict[str, torch.Tensor] = {}
    inverse = {h: mc for mc, h in _GLOBAL.items()}
    for name, t in hf.items():
        if name in inverse:
            out[inverse[name]] = t
            continue
        m = _HF_EXPERT.match(name)
        if m:
            layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
            if proj == "down_proj":
                out[expert_param(layer, expert, "linear_fc2")] = t
            elif proj == "gate_proj":  # up_proj: taken with gate
                up = hf[name.replace("gate_proj", "up_proj")]
                out[expert_param(layer, expert, "linear_fc1")] = merge_gate_up(t, up, etp)
            continue
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
        if not m:
            raise ModelError(f"no Megatron parameter for Qwen3-MoE weight {name!r}")
        i, rest = m.groups()
        direct = {h: mc for mc, h in _LAYER.items()}
        if rest in direct:
            out[f"decoder.layers.{i}.{direct[rest]}"] = t
        elif rest == "self_attn.q_proj.weight":
            qkv = [hf[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"]
            out[f"decoder.layers.{i}.{_QKV}"] = merge_qkv(*qkv, shape)
        elif rest not in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):  # k, v: taken with q
            raise ModelError(f"no Megatron parameter for Qwen3-MoE weight {name!r}")
    return out


def megatron_to_hf_state(
    mc: Mapping[str, torch.Tensor], shape: AttentionShape, etp: int = 1
) -> dict[str, torch.Tensor]:
    """Per-expert HF state from a full Megatron Qwen3-MoE state."""
    out: dict[str, torch.Tensor] = {}
    for name, t in mc.items():
        hf = megatron_to_hf_names(name)
        if len(hf) == 1:
            out[hf[0]] = t
        elif len(hf) == 2:
            out.update(zip(hf, split_gate_up(t, etp)))
        else:
            out.update(zip(hf, split_qkv(t, shape)))
    return out


def fuse_experts(per_expert: Mapping[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert HF state -> transformers 5.x in-memory Qwen3-MoE state
    (`mlp.experts.gate_up_proj` [E, 2I, H] = [gate; up] per expert, `down_proj` [E, H, I])."""
    out = {k: v for k, v in per_expert.items() if not _HF_EXPERT.match(k)}
    layers = sorted({int(m.group(1)) for k in per_expert if (m := _HF_EXPERT.match(k))})
    for i in layers:
        stem = f"model.layers.{i}.mlp.experts"
        out[f"{stem}.gate_up_proj"] = torch.stack(
            [
                torch.cat([per_expert[f"{stem}.{e}.gate_proj.weight"], per_expert[f"{stem}.{e}.up_proj.weight"]], 0)
                for e in range(num_experts)
            ]
        )
        out[f"{stem}.down_proj"] = torch.stack([per_expert[f"{stem}.{e}.down_proj.weight"] for e in range(num_experts)])
    return out


def expert_lora_to_peft(
    layer: int,
    expert: int,
    fc1: tuple[torch.Tensor, torch.Tensor],
    fc2: tuple[torch.Tensor, torch.Tensor],
    etp: int = 1,
) -> dict[str, torch.Tensor]:
    """One expert's gathered fused LoRA (A, B) of linear_fc1 and linear_fc2 -> per-expert PEFT
    tensors: A repeated for gate and up, B split by the [gate_r; up_r] per-ETP-rank rule."""
    a1, b1 = fc1
    gate_b, up_b = split_gate_up(b1, etp)
    a2, b2 = fc2
    out = {}
    for proj, a, b in (("gate_proj", a1, gate_b), ("up_proj", a1, up_b), ("down_proj", a2, b2)):
        out[expert_lora_name(layer, expert, proj, "A")] = a.clone()
        out[expert_lora_name(layer, expert, proj, "B")] = b.clone()
    return out
