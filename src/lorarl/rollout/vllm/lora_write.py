"""An adapter written straight into the LoRA slots vLLM computes with: the memory transport's fast path.

vLLM's own loader builds a LoRAModel on every sync: one LoRALayerWeights per module and, on a MoE
model, per expert and projection (6 x E tensors a layer: 37k at Qwen3-30B-A3B's 48 layers), then
packs them, scales B and copies them into its stacks. Once an adapter of the same structure is in
its slot, the rollout writes the new factors into those stacks instead: one copy per dense module
and one per expert projection of a layer (PEFT's expert stacks are views of exactly that layout),
B cast to the LoRA dtype and scaled there, as vLLM's LoRALayerWeights.optimize does.

Checked against vLLM's own placement before it is trusted: once per process the rollout loads two
random adapters through vLLM's loader, then writes the first in place over the second; every slot
must then hold, bit for bit, what vLLM's loader left there for the first (`verify_writer`). A
writer that misses a slot, swaps two, or scales differently fails there, whatever lorarl calls the
slots, and the rollout keeps vLLM's loader and says so once. After that, each sync's transport
and semantic checks read the slots as before.

Without tensor parallelism only (one engine rank holds every slot whole; otherwise vLLM's loader
slices). vLLM's registered LoRAModel still holds the last adapter loaded through its loader:
nothing re-activates it while lorarl's one adapter stays in its slot, and whenever the engine's
slots may be lost (a base reload) the rollout reloads its kept copy through the loader.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from lorarl.contract.payload import ExpertWrapper
from lorarl.errors import SyncError
from lorarl.rollout.vllm.lora_slots import slot_groups
from lorarl.sync.experts import experts_module, stacked_expert_factors
from lorarl.sync.transport import AdapterLayout

# Per slot group, by the vLLM name of its first slot: (A [n, r, in], B [n, out, r]) to write.
Sources = dict[str, tuple[Tensor, Tensor]]


def structure(tensors: Iterable[tuple[str, Tensor]], config: dict, experts: Mapping[str, ExpertWrapper]) -> tuple:
    """What must not change between the adapter in the slots and one written over it."""
    shapes = tuple((name, tuple(t.shape), t.dtype) for name, t in tensors)
    return shapes, repr(sorted(config.items())), tuple(sorted(experts.items()))


def slot_sources(
    tensors: Iterable[tuple[str, Tensor]], config: dict, experts: Mapping[str, ExpertWrapper], layout: AdapterLayout
) -> Sources:
    """The adapter as vLLM's slot groups hold it: named by vLLM's parser, B in the LoRA dtype and
    scaled (views of the sent tensors where no cast or scaling is needed)."""
    pairs: dict[str, dict[str, Tensor]] = {}
    for name, tensor in tensors:
        stem, _, ab = name.removesuffix(".weight").rpartition(".lora_")  # ab: "A" or "B"
        pairs.setdefault(stem, {})[ab] = tensor
    out: Sources = {}
    for stem, ab in pairs.items():
        wrapper = experts.get(stem)
        if wrapper is None:
            module = layout.module_of(f"{stem}.lora_A.weight")[0]
            parts = [(module, stem, ab["A"].unsqueeze(0), ab["B"].unsqueeze(0))]
        else:
            base = experts_module(stem)
            parts = [
                (layout.module_of(f"{base}.0.{proj}.lora_A.weight")[0], f"{base}.0.{proj}", a, b)
                for proj, a, b in stacked_expert_factors(ab["A"], ab["B"], wrapper)
            ]
        for module, peft_stem, a, b in parts:
            b = b.to(layout.lora_dtype)
            scaling = layout.scaling_of(config, peft_stem.removeprefix("base_model.model."))
            out[module] = (a.to(layout.lora_dtype), b * scaling if scaling != 1 else b)
    return out


def write_lora_slots(worker, lora_id: int, sources: Sources) -> None:
    """In vLLM's worker: each source into its slot group, the rank padding zeroed."""
    written = set()
    for names, a, b, spread in slot_groups(worker, lora_id):
        source = sources.get(names[0])
        if len(names) > 1 and names[1] in sources:  # experts sent one by one (the Megatron export)
            parts = [sources[name] for name in names]
            source = (torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts]))
            written.update(names)
        if source is None:
            continue  # a module the adapter does not target: its slot keeps the loader's zeros
        src_a, src_b = source
        rank = src_a.shape[1]
        if spread or src_a.shape[0] != len(names) or src_a.shape[2] != a.shape[2] or src_b.shape[1] != b.shape[1]:
            raise SyncError(
                f"vLLM's LoRA slots of {names[0]} hold {tuple(a.shape)} / {tuple(b.shape)}, not the adapter's "
                f"{tuple(src_a.shape)} / {tuple(src_b.shape)}; it cannot be written in place"
            )
        a[:, :rank].copy_(src_a)
        a[:, rank:].zero_()
        b[:, :, :rank].copy_(src_b)
        b[:, :, rank:].zero_()
        written.add(names[0])
    missing = sorted(set(sources) - written)
    if missing:
        raise SyncError(f"vLLM holds no LoRA slot for {missing[0]}; the adapter cannot be written in place")


def random_like(tensors: Iterable[tuple[str, Tensor]], seed: int) -> dict[str, Tensor]:
    """Seeded random factors of the adapter's names, shapes, dtypes and devices, drawn where they
    live (a 30B-A3B adapter is 0.6B values)."""
    gens: dict[torch.device, torch.Generator] = {}
    out = {}
    for name, t in tensors:
        gen = gens.setdefault(t.device, torch.Generator(device=t.device).manual_seed(seed))
        out[name] = (torch.randn(t.shape, generator=gen, device=t.device) * 0.02).to(t.dtype)
    return out


def verify_writer(
    rollout, tensors: dict[str, Tensor], config: dict, experts: Mapping[str, ExpertWrapper]
) -> str | None:
    """Whether writing in place leaves exactly what vLLM's loader leaves, on random factors of
    this adapter's structure: None when it does, else the first slot that differs. Leaves the
    rollout holding random factors: the caller loads the real adapter next."""
    first, second = random_like(tensors.items(), 1), random_like(tensors.items(), 2)
    rollout.load_through_vllm(first, config, experts)
    want = rollout.held_adapter_sums()
    # The second adapter differs from the first in every slot it fills, so a write that leaves
    # a slot untouched reads as a difference below.
    rollout.load_through_vllm(second, config, experts)
    rollout.write_in_place(first, config, experts)
    got = rollout.held_adapter_sums()
    if got.names != want.names:
        return f"the slots differ: {sorted(set(got.names) ^ set(want.names))[:3]}"
    differ = (got.sums != want.sums).any(1).nonzero().flatten().tolist()
    if differ:
        return f"slot {min(want.names[i] for i in differ)} differs from vLLM's own load"
    return None
