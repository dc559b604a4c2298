"""The LoRA slots vLLM computes with, read inside its worker (handed to it through collective_rpc).

One enumeration (`slot_groups`) serves both checks: the transport check fingerprints each slot's
bits, the semantic check projects each slot's delta. Slots are named as vLLM's own packing names
them: a fused module (qkv_proj, gate_up_proj) keeps one stacked slice per projection, named by the
projection (q_proj, ...); a fused-MoE layer keeps per-expert w1/w2/w3 slices, named by its
per-expert sub-module list. vLLM 0.26 (GPU) and 0.32 (CPU) are supported.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from lorarl.errors import SyncError
from lorarl.rollout.vllm.in_worker import _lora_adapters
from lorarl.sync.fingerprint import fingerprint_rows
from lorarl.sync.semantic import PROJECTIONS, STACK_BYTES, slot_projections
from lorarl.sync.transport import HeldSlots

# A group: (slot names, A [n, rank, in], B [n, out, rank], held by one rank each under expert parallelism).
SlotGroup = tuple[list[str], Tensor, Tensor, bool]


def _index_of(adapters, lora_id: int) -> int:
    index_to_id = getattr(adapters, "lora_index_to_id", None)
    if index_to_id is None or getattr(adapters, "modules", None) is None:
        raise SyncError(
            "this vLLM's LoRA manager has no lora_index_to_id/modules; lorarl cannot read its adapter slots "
            "(set trainer.check_sync=false to run without the sync checks)"
        )
    if lora_id not in index_to_id:
        raise SyncError(f"vLLM holds adapter id {lora_id} in no active slot")
    return index_to_id.index(lora_id)


def _expert_groups(name: str, module, index: int, parts: list[str] | None) -> Iterator[SlotGroup]:
    """A fused-MoE LoRA layer's slots, one group per projection stack.

    vLLM keeps w1 (gate) and w3 (up) in w13_lora_*_stacked[0/1] and w2 (down) in
    w2_lora_*_stacked[0], each [max_loras, local experts, rows, cols]; its packed sub-module
    list runs expert-major as (w1, w2, w3) per expert, which names each slot. Under expert
    parallelism a rank holds experts ep_rank * local ... + local - 1."""
    if getattr(module, "enable_moe_shared_loras", False) or type(module).__name__ == "FusedMoE3DWithLoRA":
        raise SyncError(
            f"vLLM serves {name} with shared or stacked 3-D expert LoRA; lorarl checks the per-expert "
            "layout only (trainer.check_sync=false turns the sync checks off)"
        )
    local = module.w13_lora_a_stacked[0].shape[1]
    spread = bool(getattr(module, "use_ep", False))
    first = getattr(module, "ep_rank", 0) * local if spread else 0
    gated = len(module.w13_lora_a_stacked) == 2
    per_expert = 3 if gated else 2
    if parts is None or len(parts) % per_expert:
        raise SyncError(f"vLLM lists no per-expert LoRA sub-modules for {name}; lorarl cannot name its slots")
    stacks = [(module.w13_lora_a_stacked[0], module.w13_lora_b_stacked[0])]
    stacks.append((module.w2_lora_a_stacked[0], module.w2_lora_b_stacked[0]))
    if gated:
        stacks.append((module.w13_lora_a_stacked[1], module.w13_lora_b_stacked[1]))
    for j, (a, b) in enumerate(stacks):
        names = [parts[(first + e) * per_expert + j] for e in range(local)]
        yield names, a[index], b[index], spread


def _dense_parts(name: str, count: int, packed: dict, by_leaf: dict) -> list[str]:
    parts = packed.get(name)
    if parts is None:
        prefix, _, leaf = name.rpartition(".")
        leaves = by_leaf.get(leaf, [leaf])
        parts = [f"{prefix}.{p}" if prefix else p for p in leaves] if len(leaves) == count else [name]
    if len(parts) != count:
        parts = [name] if count == 1 else [f"{name}[{i}]" for i in range(count)]
    return parts


def slot_groups(worker, lora_id: int) -> Iterator[SlotGroup]:
    """Every LoRA slot vLLM computes with for adapter `lora_id`, in groups of equal shape."""
    _, adapters = _lora_adapters(worker)
    index = _index_of(adapters, lora_id)
    packed = getattr(adapters, "packed_modules", {})
    by_leaf = getattr(adapters, "packed_modules_mapping", {})
    for name, module in adapters.modules.items():
        if hasattr(module, "w13_lora_a_stacked"):
            yield from _expert_groups(name, module, index, packed.get(name))
            continue
        stacks_a = getattr(module, "lora_a_stacked", None)
        stacks_b = getattr(module, "lora_b_stacked", None)
        if stacks_a is None or stacks_b is None:
            continue  # no LoRA stacks (e.g. a classification head): nothing an adapter payload fills
        if "Embedding" in type(module).__name__:
            # vLLM wraps embeddings for LoRA on some models (Qwen3); lorarl never targets them
            # (config validation refuses embed_tokens/lm_head), so those slots stay empty.
            continue
        if isinstance(stacks_a, Tensor):
            stacks_a, stacks_b = (stacks_a,), (stacks_b,)
        for part, a, b in zip(_dense_parts(name, len(stacks_a), packed, by_leaf), stacks_a, stacks_b):
            if a.dim() != 4 or b.dim() != 4:
                raise SyncError(
                    f"this vLLM keeps the LoRA stacks of {name} as {tuple(a.shape)} / {tuple(b.shape)}, not "
                    "(max_loras, 1, rows, cols); lorarl cannot read them (trainer.check_sync=false turns the "
                    "sync checks off)"
                )
            yield [part], a[index], b[index], False


def adapter_slot_sums(worker, lora_id: int) -> HeldSlots:
    """Fingerprint sums of the LoRA slots vLLM computes with for adapter `lora_id` (each group's
    slots in one reduction, one host transfer: a MoE layer is hundreds of them)."""
    groups = [(names, a, b) for names, a, b, _ in slot_groups(worker, lora_id)]
    rows = [torch.cat([fingerprint_rows(a), fingerprint_rows(b)], 1) for _, a, b in groups]
    sums = torch.cat(rows).cpu() if rows else torch.zeros(0, 4, dtype=torch.int64)
    shapes = {n: (tuple(a.shape[1:]), tuple(b.shape[1:])) for names, a, b in groups for n in names}
    return HeldSlots([n for names, _, _ in groups for n in names], shapes, sums)


def lora_projections(
    worker, lora_id: int, wanted: dict[str, tuple[int, int, int]], tp: tuple[int, int], count: int = PROJECTIONS
) -> tuple[Tensor, Tensor, list[str]]:
    """The semantic check's observed side on this rank: ([len(wanted), count] float64 u^T dW v of
    each wanted slot, [len(wanted)] share of its module this rank holds, names of unwanted slots
    that hold a non-zero delta). `wanted` maps a vLLM slot name to (row in the result, full out
    features, full in features); `tp` is (tensor-parallel rank, size). Partial values of sliced
    modules sum to the whole over the tensor-parallel ranks."""
    values = torch.zeros(len(wanted), count, dtype=torch.float64)
    share = torch.zeros(len(wanted), dtype=torch.float64)
    stray = []
    # A dense module's slot waits for the slots of its shape in the other layers: one stack each,
    # a few kernels per shape instead of per module.
    dense: dict[tuple, list[tuple[str, Tensor, Tensor]]] = {}
    groups = []
    for names, a, b, spread in slot_groups(worker, lora_id):
        mine = [i for i, n in enumerate(names) if n in wanted]
        if len(mine) < len(names):
            taken = set(mine)
            stray += [n for i, n in enumerate(names) if i not in taken and bool(a[i].any()) and bool(b[i].any())]
        if len(names) == 1 and mine and not spread:
            dense.setdefault((a.shape, b.shape, a.dtype, a.device), []).append((names[0], a[0], b[0]))
        elif mine:
            groups.append(([names[i] for i in mine], a[mine], b[mine], spread))
    for slots in dense.values():
        _, a, b = slots[0]
        per_stack = max(1, STACK_BYTES // (8 * (a.numel() + b.numel())))  # float64 in slot_projections
        for at in range(0, len(slots), per_stack):
            names, stack_a, stack_b = zip(*slots[at : at + per_stack])
            groups.append((list(names), torch.stack(stack_a), torch.stack(stack_b), False))
    for group, a, b, spread in groups:
        for held, projected, part in slot_projections(group, a, b, wanted, tp, spread, count):
            index = torch.tensor([wanted[n][0] for n in held])
            values[index] = projected
            share[index] += part
    return values, share, stray
