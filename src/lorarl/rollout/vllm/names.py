"""HF weight names and the parameters vLLM serves them in (q/k/v fused into qkv_proj, ...)."""

from __future__ import annotations

# vLLM fuses these HF projections into one parameter; with LoRA enabled it wraps the fused
# linear and (depending on the version) keeps its weight under `.base_layer`.
FUSED_INTO = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "o_proj": "o_proj",
    "down_proj": "down_proj",
}
# Where each projection sits inside its fused parameter (rows, in this order).
FUSED_ORDER = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1}


# transformers 5's fused expert stacks and the vLLM FusedMoE parameters they fill, same layout
# ([E, 2I, H] gate rows then up rows; [E, H, I]); vllm_worker names those without the
# version-dependent `.routed_experts` level.
_EXPERT_STACKS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}


def served_name(name: str) -> str:
    """The parameter of vLLM's model that HF weight `name` fills (q/k/v into qkv_proj, ...)."""
    module, _, leaf = name.rpartition(".")
    if module.endswith(".experts") and leaf in _EXPERT_STACKS:
        return f"{module}.{_EXPERT_STACKS[leaf]}"
    prefix, _, proj = module.rpartition(".")
    fused = FUSED_INTO.get(proj)
    return name if fused is None else f"{prefix}.{fused}.{leaf}"


def hf_parts(served: str) -> list[str]:
    """The HF weights that fill vLLM parameter `served` (qkv_proj.weight -> q/k/v_proj.weight)."""
    module, _, leaf = served.rpartition(".")
    stacks = {v: k for k, v in _EXPERT_STACKS.items()}
    if module.endswith(".experts") and leaf in stacks:
        return [f"{module}.{stacks[leaf]}"]
    prefix, _, fused = module.rpartition(".")
    parts = sorted((p for p, f in FUSED_INTO.items() if f == fused), key=lambda p: FUSED_ORDER.get(p, 0))
    return [f"{prefix}.{p}.{leaf}" for p in parts] if parts else [served]


def resolve_base_name(name: str, live: frozenset[str]) -> str:
    """The name vLLM's loader needs for plain HF weight `name`, decided by the live engine:
    `.base_layer` goes in only where the live model keeps the wrapped module's weight there (a
    fused projection is looked up under its fused name). Which modules vLLM wraps varies by
    model: vLLM 0.26 wraps Qwen3's embed_tokens (VocabParallelEmbeddingWithLoRA) but not
    Qwen2's, so the rule is read from the live names, never listed here."""
    module, _, leaf = name.rpartition(".")
    if leaf not in ("weight", "bias"):
        return name
    prefix, _, proj = module.rpartition(".")
    fused = FUSED_INTO.get(proj)
    live_module = module if fused is None else f"{prefix}.{fused}"
    if f"{live_module}.base_layer.{leaf}" in live:
        return f"{module}.base_layer.{leaf}"
    return name
