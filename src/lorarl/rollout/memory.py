"""Whether the rollout must sleep during the update: GPU memory the update needs vs what is free.

vLLM's level-1 sleep copies the base to host RAM and back every step (0.77 s of a 9 s step at
7B on one H200), and an adapter-only update never changes that base. So with
`rollout.free_cache_engine=null` the engine stays awake whenever the update fits beside it,
and sleeps only when it does not. The estimate is deliberately generous (what autograd keeps
per token and layer in a Qwen2/Qwen3 decoder, the LM head's logits, the LoRA optimizer
state) and a margin is added: a wrong "awake" is an out-of-memory error, a wrong "sleep" only
costs the time it costs today. Once an update has run asleep, its measured peak decides again
(`plan_from_peak`): on one H200 the estimate was 15% above the measured peak at 7B (an
8192-token budget, where the margin alone put the engine to sleep though the update fit beside
it with 17 GiB to spare) and 49% above it at 0.5B (54.1 against 36.3 GiB,
tests/gpu_logs/sleep_plan).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
MARGIN_FACTOR = 1.25  # allocator fragmentation and what the estimate leaves out
MARGIN_BYTES = 2 * GIB  # CUDA/NCCL workspaces, the probe's forwards, the payload copies
MEASURED_MARGIN_FACTOR = 1.1  # allocator fragmentation over a peak that was measured


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    # A mixture of experts (every layer's MLP routed): experts, each one's width, experts per token.
    experts: int = 0
    expert_intermediate: int = 0
    experts_per_token: int = 0

    @classmethod
    def of(cls, hf_config) -> ModelDims:
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0
        # Qwen-MoE's expert width; Mixtral-style configs give it as intermediate_size.
        width = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
        return cls(
            hidden=hf_config.hidden_size,
            intermediate=hf_config.intermediate_size,
            layers=hf_config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=hf_config.vocab_size,
            experts=experts,
            expert_intermediate=width if experts else 0,
            experts_per_token=hf_config.num_experts_per_tok if experts else 0,
        )

    def expert_stack_numel(self) -> int:
        """One layer's routed experts: gate_up [E, 2I, H] and down [E, H, I]."""
        return 3 * self.experts * self.hidden * self.expert_intermediate


def weight_numel(d: ModelDims, tied_head: bool = False) -> int:
    """The model's weights: every decoder layer's projections (with Qwen2's q/k/v biases) and
    norms, the final norm, the embedding and the LM head, once more unless `tied_head`. The
    estimate below counts the head apart even when tied (generous); the benchmarks' MFU counts
    what the checkpoint holds (bench.step_report.param_count)."""
    q, kv, h = d.heads * d.head_dim, d.kv_heads * d.head_dim, d.hidden
    mlp = d.expert_stack_numel() + d.experts * h if d.experts else 3 * h * d.intermediate  # experts + router
    per_layer = h * (q + 2 * kv) + (q + 2 * kv) + q * h + mlp + 2 * h
    return d.layers * per_layer + (1 if tied_head else 2) * d.vocab * h + h


def layer_activation_bytes(d: ModelDims, dtype_bytes: int) -> int:
    """Bytes autograd keeps per token for one decoder layer's backward (LoRA adds only rank-wide
    intermediates; the frozen base keeps its inputs for the activation gradients)."""
    h, q, kv, b = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim, dtype_bytes
    norms = 2 * (8 + b) * h  # two RMSNorms: float32 input and normalised copy, cast output
    attention = b * (q + 2 * kv) + 2 * b * (q + kv) + 4 * b * q + b * q  # projections, rotary, SDPA, o_proj input
    mlp = 4 * b * d.intermediate  # gate, up, SiLU(gate), the product fed to down_proj
    if d.experts:  # per routed copy of the token: its input, gate and up, SiLU(gate), the product, the output
        mlp = d.experts_per_token * b * (2 * h + 5 * d.expert_intermediate) + 8 * d.experts  # + router softmax
    return norms + attention + mlp


def lora_numel(d: ModelDims, rank: int, targets: list[str], expert_targets: list[str] = ()) -> int:
    """LoRA parameters on `targets` (projection names) and on the fused expert stacks
    `expert_targets` names (model.lora.target_parameters: A [r*E, in] and B [out, r*E] each)."""
    q, kv, h, inter = d.heads * d.head_dim, d.kv_heads * d.head_dim, d.hidden, d.intermediate
    e, i = d.experts, d.expert_intermediate
    stacks = {"gate_up_proj": e * (h + 2 * i), "down_proj": e * (i + h)}
    experts = d.layers * rank * sum(stacks.get(t.rsplit(".", 1)[-1], 0) for t in expert_targets)
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    per_layer = sum(rank * sum(shapes[t]) for t in targets if t in shapes)
    if not per_layer and not experts:  # unknown names: all seven
        return rank * 7 * (h + inter) * d.layers
    return per_layer * d.layers + experts


def update_bytes(
    d: ModelDims,
    *,
    tokens: int,
    response_tokens: int,
    checkpointing: bool,
    rank: int,
    targets: list[str],
    dtype_bytes: int = 2,
    model_parallel: int = 1,
    head_at_every_position: bool = False,
    vocab_parallel: bool = False,
    gathered_weights_held: bool = False,
    attention_scores_width: int = 0,
    expert_targets: list[str] = (),
    folded_expert_lora: bool = False,
) -> int:
    """Peak extra GPU memory of one micro-batch's forward + backward (`tokens` padded positions,
    `response_tokens` of them under the LM head, or all of them with `head_at_every_position`;
    their loss in float32 blocks, or with `vocab_parallel` in whole float32 copies), plus the
    LoRA weights, gradients and AdamW state (float32: 16 bytes per parameter), plus
    with `gathered_weights_held` every layer's gathered weights, which FSDP2 keeps from forward
    to backward under `backend.reshard_after_forward=false` (one full copy, whatever the world
    size: at 7B +14.5 GiB measured, bench/results/update_profile_2026-12-04c), plus with
    `attention_scores_width` the attention probabilities of an attention that materialises them
    over rows that wide (Megatron's local spec: its softmax's float32 output and the copy in the
    model's dtype that the value matmul keeps, per token and head; quadratic in the length), plus
    with `folded_expert_lora` (PEFT's fold of expert LoRA into the stacks) the folded stack autograd
    keeps for each layer whose backward is pending and the stack's gradient (two with checkpointing)."""
    per_layer = layer_activation_bytes(d, dtype_bytes) + d.heads * attention_scores_width * (4 + dtype_bytes)
    if checkpointing:  # each layer keeps its input; one layer is recomputed in full at a time
        activations = tokens * (d.layers * dtype_bytes * d.hidden + per_layer)
    else:
        activations = tokens * d.layers * per_layer
    head_tokens = tokens if head_at_every_position else response_tokens
    if vocab_parallel:
        # The logits, a float32 copy and the copy scaled by the temperature, which the
        # vocab-parallel cross entropy turns into its softmax in place and keeps for the backward.
        logits = head_tokens * d.vocab * (dtype_bytes + 8)
    else:
        logits = 3 * head_tokens * d.vocab * dtype_bytes  # logits, their gradient, a float32 block
    held = weight_numel(d) * dtype_bytes if gathered_weights_held else 0
    if folded_expert_lora:
        held += (1 if checkpointing else d.layers) * d.expert_stack_numel() * dtype_bytes
        held += d.expert_stack_numel() * dtype_bytes  # the folded stack's gradient, one layer at a time
    lora = 16 * lora_numel(d, rank, targets, expert_targets)
    return (activations + logits + held + lora) // model_parallel


@dataclass(frozen=True)
class SleepPlan:
    sleeps: bool
    reason: str

    def __str__(self) -> str:
        return f"rollout {'sleeps' if self.sleeps else 'stays awake'} during the update ({self.reason})"


def plan_sleep(setting: bool | None, free_bytes: int = 0, need_bytes: int = 0) -> SleepPlan:
    """`setting` is rollout.free_cache_engine: true / false decide; null decides by memory."""
    if setting is not None:
        return SleepPlan(setting, f"rollout.free_cache_engine={str(setting).lower()}")
    want = MARGIN_FACTOR * need_bytes + MARGIN_BYTES
    fits = free_bytes >= want
    return SleepPlan(
        not fits,
        f"{free_bytes / GIB:.1f} GiB free beside the awake engine, the update needs ~{need_bytes / GIB:.1f} GiB "
        f"({want / GIB:.1f} with margin); rollout.free_cache_engine=true/false overrides",
    )


def plan_from_peak(free_bytes: int, peak_bytes: int, tokens: int, max_tokens: int) -> SleepPlan:
    """The plan from an update that ran: `peak_bytes` it allocated beyond what was there before
    (log-prob passes included), with `tokens` padded positions in its largest micro-batch, scaled
    to the largest micro-batch the run allows (`max_tokens`, lorarl.driver.prepare.run_update_tokens). Activations and
    logits grow with the tokens; what does not (the LoRA optimizer state) only adds to the
    scaled need, so the scaling errs towards sleeping."""
    largest = max(max_tokens, tokens)
    need = peak_bytes * largest / max(tokens, 1)
    want = MEASURED_MARGIN_FACTOR * need + MARGIN_BYTES
    fits = free_bytes >= want
    return SleepPlan(
        not fits,
        f"{free_bytes / GIB:.1f} GiB free beside the awake engine; the last update peaked at "
        f"{peak_bytes / GIB:.1f} GiB over micro-batches of up to {tokens} tokens, ~{need / GIB:.1f} GiB at "
        f"{largest} ({want / GIB:.1f} with margin); rollout.free_cache_engine=true/false overrides",
    )
