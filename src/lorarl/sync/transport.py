"""The transport check: vLLM holds exactly the bits lorarl sent.

Every LoRA slot vLLM holds is fingerprinted (lorarl.sync.fingerprint) and compared with the same
reduction of the payload after vLLM's own dtype cast and scaling; a base (or merged) payload is
compared parameter by parameter. It proves the load, not the export: its expected side is the
payload itself, so a payload that means the wrong thing passes here and fails the semantic check
(lorarl.sync.semantic). What it adds over that check: it is exact, so a load that left a slot at
values too close to the new ones for a tolerance to see (a skipped update after a tiny step) is
still named.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lorarl.errors import SyncError
from lorarl.sync.experts import ExpertWrapper, experts_module, stacked_expert_factors
from lorarl.sync.fingerprint import ZERO, Fingerprint, fingerprint_rows, fingerprint_sums_many, resolve, resolve_rows


@dataclass(frozen=True)
class LoraSlot:
    """One LoRA slot vLLM holds for a (possibly fused) module's part: stacked A and B regions."""

    module: str  # vLLM-side module name of the part, e.g. model.layers.0.self_attn.q_proj
    a_shape: tuple[int, int]  # (max_lora_rank, in)
    b_shape: tuple[int, int]  # (out, max_lora_rank)
    a: Fingerprint
    b: Fingerprint


@dataclass(frozen=True)
class AdapterLayout:
    """What the expected fingerprint needs from vLLM: its LoRA dtype, the scaling rule of its
    PEFT helper, and the name its loader gives each PEFT tensor."""

    lora_dtype: torch.dtype
    module_of: object  # callable: PEFT tensor name -> (vLLM module name, is_lora_a)
    scaling_of: object  # callable: (adapter_config, PEFT module name) -> float


def expected_adapter_slots(
    tensors: Iterable[tuple[str, Tensor]],
    adapter_config: dict,
    layout: AdapterLayout,
    slots: Mapping[str, LoraSlot],
    tp_rank: int = 0,
    tp_size: int = 1,
    experts: Mapping[str, ExpertWrapper] | None = None,
) -> dict[str, tuple[Fingerprint, Fingerprint]]:
    """Per vLLM module: the fingerprints its slot must hold after loading this adapter.

    vLLM casts A and B to its LoRA dtype, then multiplies B in that dtype by the module's
    scaling (alpha / r, or PEFT's patterns); B is stored in an (out, max_lora_rank) slot, so a
    B of lower rank is padded to it. Modules the adapter does not name must hold zeros. With
    tensor parallelism each rank holds its slice: B's rows of a column-parallel module (each of
    q/k/v on its own), A's columns of a row-parallel one; the slot's shape says which. Expert
    stacks (`experts`, PEFT module -> wrapper) are read per expert as vLLM's loader splits them
    (lorarl.sync.experts), all experts of a projection in one reduction.
    """
    experts = experts or {}
    stacks: dict[str, dict[str, Tensor]] = {}
    pairs: dict[str, dict[str, Tensor]] = {}
    peft_module: dict[str, str] = {}
    for name, tensor in tensors:
        stem, _, ab = name.removesuffix(".weight").rpartition(".lora_")
        if stem in experts:
            stacks.setdefault(stem, {})[ab] = tensor
            continue
        module, is_a = layout.module_of(name)
        pairs.setdefault(module, {})["A" if is_a else "B"] = tensor
        peft_module[module] = _PEFT_MODULE.sub("", name)
    out = {module: (ZERO, ZERO) for module in slots}
    pending: dict[str, tuple[Tensor, Tensor]] = {}
    for module, ab in pairs.items():
        if module not in slots and _other_ranks_expert(module, slots):
            continue  # expert parallelism: another rank holds (and checks) this expert
        slot = _slot(module, slots)
        a = _tp_shard(ab["A"].detach(), 1, slot.a_shape[1], tp_rank, tp_size).to(layout.lora_dtype)
        b = _tp_shard(ab["B"].detach(), 0, slot.b_shape[0], tp_rank, tp_size).to(layout.lora_dtype)
        scaling = layout.scaling_of(adapter_config, peft_module[module])
        if scaling != 1:
            b = b * scaling  # in the LoRA dtype, as vLLM's LoRALayerWeights.optimize does
        if b.shape[1] < slot.b_shape[1]:
            b = torch.nn.functional.pad(b, (0, slot.b_shape[1] - b.shape[1]))
        pending[module] = (a, b)
    resolved = iter(resolve(fingerprint_sums_many([t for pair in pending.values() for t in pair])))
    out.update({module: (next(resolved), next(resolved)) for module in pending})
    groups = [
        group
        for stem, ab in stacks.items()
        for group in _expert_stack_rows(ab, experts[stem], adapter_config, layout, slots, tp_rank, tp_size)
    ]
    fps = iter(resolve_rows([rows for _, a_rows, b_rows in groups for rows in (a_rows, b_rows)]))
    for held, _, _ in groups:
        a_fps = [next(fps) for _ in held]
        out.update({module: (fa, next(fps)) for module, fa in zip(held, a_fps)})
    return out


def _slot(module: str, slots: Mapping[str, LoraSlot]) -> LoraSlot:
    if module not in slots:
        raise SyncError(
            f"adapter module '{module}' has no LoRA slot in vLLM (its LoRA modules are e.g. "
            f"{', '.join(sorted(slots)[:3])}); the rollout cannot serve it"
        )
    return slots[module]


def _expert_stack_rows(ab, wrapper, adapter_config, layout, slots, tp_rank, tp_size):
    """Per projection of one PEFT expert stack: (the vLLM slot of each expert this rank holds,
    [n, 2] fingerprint sums of their A, the same of their B), as vLLM's loader would store them."""
    if set(ab) != {"A", "B"}:
        raise SyncError(f"expert stack '{wrapper.module}' has lora_{''.join(ab)} but not both factors")
    stem = experts_module(wrapper.module)
    for proj, a_all, b_all in stacked_expert_factors(ab["A"].detach(), ab["B"].detach(), wrapper):
        names = [layout.module_of(f"{stem}.{e}.{proj}.lora_A.weight")[0] for e in range(wrapper.num_experts)]
        mine = [e for e, n in enumerate(names) if n in slots]
        if not mine:
            if _other_ranks_expert(names[0], slots):
                continue  # expert parallelism: another rank holds (and checks) these experts
            _slot(names[0], slots)
        slot = slots[names[mine[0]]]
        a = _tp_shard(a_all[mine], 2, slot.a_shape[1], tp_rank, tp_size).to(layout.lora_dtype)
        b = _tp_shard(b_all[mine], 1, slot.b_shape[0], tp_rank, tp_size).to(layout.lora_dtype)
        scaling = layout.scaling_of(adapter_config, _PEFT_MODULE.sub("", f"{stem}.0.{proj}.lora_A.weight"))
        if scaling != 1:
            b = b * scaling  # in the LoRA dtype, as vLLM's LoRALayerWeights.optimize does
        if b.shape[2] < slot.b_shape[1]:
            b = torch.nn.functional.pad(b, (0, slot.b_shape[1] - b.shape[2]))
        yield [names[e] for e in mine], fingerprint_rows(a), fingerprint_rows(b)


_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.\d+\.[^.]+$")


def _other_ranks_expert(module: str, slots: Mapping[str, LoraSlot]) -> bool:
    """An expert projection this rank has no slot for while it holds other experts of that layer."""
    match = _EXPERT.match(module)
    return match is not None and any(s.startswith(match["experts"] + ".") for s in slots)


def _tp_shard(t: Tensor, dim: int, size: int, tp_rank: int, tp_size: int) -> Tensor:
    """The `size`-long slice along `dim` that tensor-parallel rank `tp_rank` holds, as vLLM's
    LoRA layers slice it: the full tensor when it is not split, and shards shared by several
    ranks when there are fewer than tp_size of them (key/value heads replicated over ranks)."""
    if t.shape[dim] <= size:
        return t
    shards = t.shape[dim] // size
    if t.shape[dim] % size or tp_size % shards:
        raise SyncError(
            f"cannot tell the tensor-parallel slice of a {tuple(t.shape)} LoRA tensor held as {size} along dim {dim}"
        )
    return t.narrow(dim, (tp_rank * shards // tp_size) * size, size)


_PEFT_MODULE = re.compile(r"^base_model\.model\.|\.lora_[AB]\.weight$")


def peft_scaling(adapter_config: dict, peft_module: str) -> float:
    """PEFT's scaling for a module: alpha / r (alpha / sqrt(r) with rsLoRA), patterns first.

    Used where vLLM's helper has no per-module rule; patterns match by name suffix as PEFT's do."""
    rank = _pattern(adapter_config.get("rank_pattern") or {}, peft_module) or adapter_config["r"]
    alpha = _pattern(adapter_config.get("alpha_pattern") or {}, peft_module) or adapter_config["lora_alpha"]
    return alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank


def _pattern(pattern: dict, name: str):
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return None


def check_adapter_slots(
    expected: Mapping[str, tuple[Fingerprint, Fingerprint]], held: Mapping[str, LoraSlot], rank: int | None = None
) -> float:
    """1.0 when every slot vLLM holds matches; otherwise a SyncError naming the first module."""
    who = "" if rank is None else f"rank {rank}: "
    for module in sorted(expected):
        want_a, want_b = expected[module]
        slot = held.get(module)
        if slot is None:
            raise SyncError(f"{who}after the sync vLLM holds no LoRA slot for '{module}'")
        for part, want, got in (("lora_A", want_a, slot.a), ("lora_B", want_b, slot.b)):
            if want != got:
                state = "zeros" if got == ZERO else "other values"
                raise SyncError(
                    f"{who}after the sync vLLM's {part} of '{module}' differs from what the trainer sent "
                    f"(it holds {state}; {len(expected)} modules checked); the rollout is not using the trained adapter"
                )
    return 1.0


def verify_adapter(rollout, payload, rank: int | None = None) -> float:
    """The exact check after an adapter sync: 1.0, or a SyncError naming the first module that
    differs. `rollout` is a lorarl VLLMRollout, `payload` the adapter WeightPayload it was sent."""
    held = rollout.held_adapter_slots()
    expected = expected_adapter_slots(
        payload.tensors,
        payload.adapter_config,
        rollout.adapter_layout(),
        held,
        rollout.tp_rank,
        rollout.tp_size,
        payload.experts,
    )
    return check_adapter_slots(expected, held, rank)


def verify_weights(rollout, rank: int | None = None) -> tuple[float, int]:
    """The exact check after a base (or merged) sync: every parameter vLLM serves and can show
    equals the payload as cast to vLLM's dtype. Returns (1.0, parameters checked); a mismatch is
    a SyncError naming the first. The CPU build keeps linear weights only in its GEMM library's
    packed form, so there only the rest (embeddings, norms) can be checked."""
    who = "" if rank is None else f"rank {rank}: "
    expected = rollout.sent_weight_fingerprints()
    held = rollout.held_weight_fingerprints(rollout.sent_numels())
    checked = 0
    for name in sorted(held):
        if held[name] is None:
            continue
        got, dtype = held[name]
        if got != expected[name]:
            raise SyncError(
                f"{who}after the sync vLLM's '{name}' ({dtype}) differs from what the trainer sent "
                f"({len(held)} weights compared); the rollout is not using the trained weights"
            )
        checked += 1
    return 1.0, checked
