"""A reference implementation of Megatron-Bridge's HF <-> Megatron layouts, for tests only.

What Megatron-Bridge 0.6.2 does to tensors when it converts Qwen2/Qwen3 dense weights and
exports fused LoRA adapters, restated in plain torch so CPU tests can check the exported
names and tensors end to end (tests/test_megatron_names.py runs the bridge's own released
source against these functions), and the GPU tests can cross-check the bridge's adapter
export (tests/gpu/test_megatron_gpu.py). Sources: `models/conversion/param_mapping.py`
(merge_qkv_weights / split_qkv_weights, GatedMLPMapping), `models/conversion/peft_bridge.py`
(fused-adapter export), `models/qwen/qwen2_bridge.py` and `qwen3_bridge.py` (name tables),
and megatron-core's sharding of column- and row-parallel linears.

Layouts:
- `linear_qkv` rows are interleaved per query group:
  [q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...]; the bias likewise.
  A column-parallel shard holds whole groups, so TP shards concatenate to the global layout.
- `linear_fc1` rows are [gate; up] on one rank; with TP each rank holds [gate_r; up_r],
  so the gathered tensor is [g_0, u_0, g_1, u_1, ...].
- Qwen3's `q_norm`/`k_norm` (RMSNorm over one head) are `self_attention.q_layernorm` /
  `k_layernorm`: plain base weights, the same under both layer specs, never LoRA-wrapped.
- Fused LoRA on a linear: output = W x + (alpha / r) * B (A x). Splitting the fused B by the
  base-weight row rule and repeating A gives per-projection adapters whose merged weights are
  exactly the row blocks of the fused merge, because row selection commutes with @ A.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lorarl.engines.megatron.names import PEFT_PREFIX
from lorarl.errors import ConfigError, ModelError, SyncError

# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionShape:
    """The head geometry that decides how q/k/v rows interleave inside `linear_qkv`."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                f"model config: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_query_groups}"
            )

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_query_groups * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    @classmethod
    def from_hf_config(cls, config: Any) -> AttentionShape:
        """From a transformers Qwen2Config (or anything with the same attribute names)."""
        heads = _cfg(config, "num_attention_heads")
        groups = _cfg(config, "num_key_value_heads", heads)
        head_dim = _cfg(config, "head_dim", None) or _cfg(config, "hidden_size") // heads
        return cls(num_attention_heads=heads, num_query_groups=groups, head_dim=head_dim)


def _cfg(config: Any, key: str, *default: Any) -> Any:
    if isinstance(config, Mapping):
        if key in config or not default:
            return config[key]
        return default[0]
    return getattr(config, key, *default)


# ---------------------------------------------------------------------------------------------
# Fused tensor layouts
# ---------------------------------------------------------------------------------------------


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: AttentionShape) -> torch.Tensor:
    """HF q/k/v rows (weights [out, F] with any F, or biases [out]) -> Megatron interleaved rows."""
    g, hd, hpg = shape.num_query_groups, shape.head_dim, shape.heads_per_group
    _check_rows("q", q, shape.q_size)
    _check_rows("k", k, shape.kv_size)
    _check_rows("v", v, shape.kv_size)
    rest = q.shape[1:]
    qg = q.reshape(g, hpg * hd, *rest)
    kg = k.reshape(g, hd, *rest)
    vg = v.reshape(g, hd, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(shape.qkv_size, *rest)


def split_qkv(qkv: torch.Tensor, shape: AttentionShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron interleaved `linear_qkv` rows -> (q, k, v) in HF row order."""
    g, hd, hpg = shape.num_query_groups, shape.head_dim, shape.heads_per_group
    _check_rows("linear_qkv", qkv, shape.qkv_size)
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (hpg + 2) * hd, *rest)
    q, k, v = torch.split(grouped, [hpg * hd, hd, hd], dim=1)
    return (
        q.reshape(shape.q_size, *rest),
        k.reshape(shape.kv_size, *rest),
        v.reshape(shape.kv_size, *rest),
    )


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor, tp_size: int = 1) -> torch.Tensor:
    """HF gate/up rows -> gathered `linear_fc1` rows ([g_0, u_0, g_1, u_1, ...] for TP ranks)."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    _check_even("gate_proj", gate, tp_size)
    gates = torch.chunk(gate, tp_size, dim=0)
    ups = torch.chunk(up, tp_size, dim=0)
    return torch.cat([t for pair in zip(gates, ups) for t in pair], dim=0)


def split_gate_up(fc1: torch.Tensor, tp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered `linear_fc1` rows -> (gate, up); each TP shard is [gate_r; up_r]."""
    _check_even("linear_fc1", fc1, 2 * tp_size)
    shards = torch.chunk(fc1, tp_size, dim=0)
    halves = [torch.chunk(s, 2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)


def _check_rows(what: str, t: torch.Tensor, rows: int) -> None:
    if t.shape[0] != rows:
        raise ValueError(f"{what} has {t.shape[0]} rows, the attention shape needs {rows}")


def _check_even(what: str, t: torch.Tensor, parts: int) -> None:
    if t.shape[0] % parts:
        raise ValueError(f"{what} has {t.shape[0]} rows, not divisible into {parts} equal parts")


# ---------------------------------------------------------------------------------------------
# Base weight names (Megatron-Bridge Qwen2Bridge / Qwen3Bridge .mapping_registry)
# ---------------------------------------------------------------------------------------------

SPECS = ("transformer_engine", "local")

# Per-layer 1:1 names, Megatron suffix -> HF suffix. The norms depend on the layer spec:
# TransformerEngine fuses them into the following linear (`layer_norm_weight`); the local
# spec keeps separate modules. Megatron-Bridge registers both as aliases.
_LAYER_NORMS = {
    "transformer_engine": {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    },
    "local": {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    },
}
_LAYER_DIRECT = {
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    # Qwen3 only (Qwen3Bridge): per-head RMSNorm on queries and keys, one module name in both specs.
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_LAYER_FUSED = {
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
_GLOBAL = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_MC_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def _check_spec(spec: str) -> None:
    if spec not in SPECS:
        raise ConfigError(f"backend.transformer_impl={spec!r} is not valid; use one of: {', '.join(SPECS)}")


def megatron_to_hf_names(mc_name: str, spec: str = "transformer_engine") -> tuple[str, ...]:
    """HF names stored in one Megatron parameter (three for qkv, two for fc1, else one)."""
    _check_spec(spec)
    if mc_name in _GLOBAL:
        return (_GLOBAL[mc_name],)
    m = _MC_LAYER.match(mc_name)
    if m:
        i, rest = m.groups()
        table = {**_LAYER_NORMS[spec], **_LAYER_DIRECT}
        if rest in table:
            return (f"model.layers.{i}.{table[rest]}",)
        if rest in _LAYER_FUSED:
            return tuple(f"model.layers.{i}.{h}" for h in _LAYER_FUSED[rest])
    raise ModelError(f"no Qwen Hugging Face name for Megatron parameter {mc_name!r}")


def hf_to_megatron_name(hf_name: str, spec: str = "transformer_engine") -> tuple[str, int | None]:
    """(Megatron parameter, index of this tensor inside the fused one or None)."""
    _check_spec(spec)
    for mc, hf in _GLOBAL.items():
        if hf == hf_name:
            return mc, None
    m = _HF_LAYER.match(hf_name)
    if m:
        i, rest = m.groups()
        for mc, hf in {**_LAYER_NORMS[spec], **_LAYER_DIRECT}.items():
            if hf == rest:
                return f"decoder.layers.{i}.{mc}", None
        for mc, parts in _LAYER_FUSED.items():
            if rest in parts:
                return f"decoder.layers.{i}.{mc}", parts.index(rest)
    raise ModelError(f"no Megatron parameter for Qwen Hugging Face weight {hf_name!r}")


def hf_to_megatron_state(
    hf: Mapping[str, torch.Tensor], shape: AttentionShape, spec: str = "transformer_engine", tp_size: int = 1
) -> dict[str, torch.Tensor]:
    """Full (TP-gathered) Megatron state dict from a Qwen2/Qwen3 HF state dict."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        mc, idx = hf_to_megatron_name(name, spec)
        if idx is None:
            out[mc] = t
        else:
            parts.setdefault(mc, {})[idx] = t
    for mc, p in parts.items():
        if mc.endswith("linear_fc1.weight"):
            _need(mc, p, 2)
            out[mc] = merge_gate_up(p[0], p[1], tp_size)
        else:
            _need(mc, p, 3)
            out[mc] = merge_qkv(p[0], p[1], p[2], shape)
    return out


def megatron_to_hf_state(
    mc: Mapping[str, torch.Tensor], shape: AttentionShape, spec: str = "transformer_engine", tp_size: int = 1
) -> dict[str, torch.Tensor]:
    """Qwen2/Qwen3 HF state dict from a full (TP-gathered) Megatron state dict."""
    out: dict[str, torch.Tensor] = {}
    for name, t in mc.items():
        hf = megatron_to_hf_names(name, spec)
        if len(hf) == 1:
            out[hf[0]] = t
        elif len(hf) == 2:
            out.update(zip(hf, split_gate_up(t, tp_size)))
        else:
            out.update(zip(hf, split_qkv(t, shape)))
    return out


def _need(mc: str, parts: Mapping[int, torch.Tensor], n: int) -> None:
    if sorted(parts) != list(range(n)):
        raise ModelError(f"{mc} needs {n} Hugging Face tensors, got parts {sorted(parts)}")


# ---------------------------------------------------------------------------------------------
# LoRA tensors: Megatron adapter parameters -> PEFT per-projection tensors
# ---------------------------------------------------------------------------------------------

FUSED_TO_HF = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
# Megatron-core parallel type of each base linear. Column-parallel: W is split on its output
# rows; LoRA A (ColumnParallelLinear(in, r, gather_output=True)) is split on r (dim 0), B
# (ColumnParallelLinear(r, out)) on out (dim 0). Row-parallel: W is split on its input columns;
# A (RowParallelLinear(in, r)) is split on in (dim 1), B (ColumnParallelLinear(r, out,
# gather_output=True)) on out (dim 0). Source: megatron.bridge.peft.utils.ParallelLinearAdapter
# and the shape table in megatron.bridge.peft.lora_merge.LoRAMerge.merge.
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
ROW_PARALLEL = ("linear_proj", "linear_fc2")
_PARENT = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}
HF_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
# CanonicalLoRA sub-adapters inside the fused wrapper (LoRALinearSplitQKV / LoRALinearSplitFC1UpGate).
_CANONICAL_SUB = {
    "adapter_q": "q_proj",
    "adapter_k": "k_proj",
    "adapter_v": "v_proj",
    "adapter_gate": "gate_proj",
    "adapter_up": "up_proj",
}

_MC_ADAPTER = re.compile(
    r"^(?:module\.)*decoder\.layers\.(\d+)\.(self_attention|mlp)\.(linear_qkv|linear_proj|linear_fc1|linear_fc2)"
    r"\.adapter\.(?:(adapter_[a-z]+)\.)?(linear_in|linear_out)\.weight$"
)


def peft_name(layer: int, projection: str, ab: str) -> str:
    """PEFT key vLLM's LoRA loader accepts, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    if ab not in ("A", "B"):
        raise ValueError(f"ab must be 'A' or 'B', got {ab!r}")
    return f"{PEFT_PREFIX}model.layers.{layer}.{HF_PARENT[projection]}.{projection}.lora_{ab}.weight"


def gather_lora_shards(
    module: str, a_shards: Sequence[torch.Tensor], b_shards: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full (A, B) of one adapter from its TP shards in rank order."""
    if module not in COLUMN_PARALLEL + ROW_PARALLEL:
        raise ValueError(f"unknown Megatron linear {module!r}")
    if len(a_shards) != len(b_shards) or not a_shards:
        raise ValueError(f"{module}: need the same non-zero number of A and B shards")
    a_dim = 0 if module in COLUMN_PARALLEL else 1
    return torch.cat(list(a_shards), dim=a_dim), torch.cat(list(b_shards), dim=0)


def split_fused_lora(
    module: str,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    shape: AttentionShape | None = None,
    tp_size: int = 1,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One fused adapter (gathered A [r, in], B [out, r]) -> {hf projection: (A, B)}.

    A is repeated for every projection packed in the fused linear; B is split by the same
    row rule as the base weight (`tp_size` matters only for linear_fc1's per-rank [g; u]).
    Every returned tensor owns its storage: safetensors refuses tensors that share memory
    (the rollout's tmpfs transport saves a PEFT folder), and views would pin the fused B.
    """
    if module == "linear_qkv":
        if shape is None:
            raise ValueError("linear_qkv needs the attention shape to de-interleave B")
        parts = dict(zip(("q_proj", "k_proj", "v_proj"), split_qkv(lora_b, shape)))
    elif module == "linear_fc1":
        parts = dict(zip(("gate_proj", "up_proj"), split_gate_up(lora_b, tp_size)))
    elif module in FUSED_TO_HF:
        parts = {FUSED_TO_HF[module][0]: lora_b}
    else:
        raise ValueError(f"unknown Megatron linear {module!r}")
    return {p: (_own(lora_a), _own(b)) for p, b in parts.items()}


def _own(t: torch.Tensor) -> torch.Tensor:
    return t.clone(memory_format=torch.contiguous_format)


def megatron_lora_to_peft(
    shards: Mapping[str, Sequence[torch.Tensor]], shape: AttentionShape
) -> dict[str, torch.Tensor]:
    """PEFT tensors from Megatron LoRA parameters given as {megatron name: [TP shards]}.

    Accepts the fused `LoRA` names (`...linear_qkv.adapter.linear_in.weight`) and the
    `CanonicalLoRA` ones (`...linear_qkv.adapter.adapter_q.linear_in.weight`), with or without
    `module.` wrapper prefixes. This is our own reference for what Megatron-Bridge's
    export_adapter_weights computes; the GPU tests use it to cross-check the bridge.
    """
    grouped: dict[tuple[int, str, str | None], dict[str, Sequence[torch.Tensor]]] = {}
    for name, parts in shards.items():
        m = _MC_ADAPTER.match(name)
        if not m:
            raise SyncError(
                f"{name!r} is not a Megatron LoRA parameter name (…adapter[.adapter_x].linear_in|linear_out.weight)"
            )
        layer, _, module, sub, side = m.groups()
        if sub is not None and sub not in _CANONICAL_SUB:
            raise SyncError(f"{name!r}: unknown CanonicalLoRA sub-adapter {sub!r}")
        grouped.setdefault((int(layer), module, sub), {})[side] = parts
    out: dict[str, torch.Tensor] = {}
    for (layer, module, sub), sides in sorted(grouped.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or "")):
        if set(sides) != {"linear_in", "linear_out"}:
            raise SyncError(f"layer {layer} {module} {sub or ''}: LoRA needs both linear_in and linear_out")
        tp = len(sides["linear_out"])
        a, b = gather_lora_shards(module, sides["linear_in"], sides["linear_out"])
        if sub is not None:
            # Canonical sub-adapters are plain column-parallel linears over one projection.
            pieces = {_CANONICAL_SUB[sub]: (_own(a), _own(b))}
        else:
            pieces = split_fused_lora(module, a, b, shape, tp_size=tp)
        for proj, (pa, pb) in pieces.items():
            out[peft_name(layer, proj, "A")] = pa
            out[peft_name(layer, proj, "B")] = pb
    return out


_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.\d+\.(?:self_attn|mlp)\.([a-z_]+)\.lora_[AB]\.weight$")


def lora_module_of(peft_key: str) -> str:
    """HF projection of a PEFT key (q_proj ...)."""
    m = _LORA_KEY.match(peft_key)
    if not m:
        raise SyncError(f"{peft_key!r} is not a LoRA tensor name")
    return m.group(1)
