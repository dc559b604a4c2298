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

from lorarl.contract.payload import ExpertWrapper
from lorarl.errors import SyncError
from lorarl.sync.experts import experts_module, stacked_expert_factors
from lorarl.sync.fingerprint import fingerprint_rows, fingerprint_sums_many


@dataclass(frozen=True, eq=False)
class HeldSlots:
    """Every LoRA slot vLLM holds for an adapter, in one order: its name (vLLM's module name of the
    part), its (A, B) slot shapes, and `sums` [N, 4] int64, each row the fingerprint sums of A then
    B (lorarl.sync.fingerprint), on the host. A MoE layer is hundreds of slots, so they stay rows."""

    names: list[str]
    shapes: dict[str, tuple[tuple[int, int], tuple[int, int]]]
    sums: Tensor


@dataclass(frozen=True)
class AdapterLayout:
    """What the expected fingerprint needs from vLLM: its LoRA dtype, the scaling rule of its
    PEFT helper, and the name its loader gives each PEFT tensor."""

    lora_dtype: torch.dtype
    module_of: object  # callable: PEFT tensor name -> (vLLM module name, is_lora_a)
    scaling_of: object  # callable: (adapter_config, PEFT module name) -> float


def expected_adapter_sums(
    tensors: Iterable[tuple[str, Tensor]],
    adapter_config: dict,
    layout: AdapterLayout,
    held: HeldSlots,
    tp_rank: int = 0,
    tp_size: int = 1,
    experts: Mapping[str, ExpertWrapper] | None = None,
) -> Tensor:
    """[N, 4]: the fingerprint sums each of `held`'s slots must hold after loading this adapter.

    vLLM casts A and B to its LoRA dtype, then multiplies B in that dtype by the module's
    scaling (alpha / r, or PEFT's patterns); B is stored in an (out, max_lora_rank) slot, so a
    B of lower rank is padded to it. Modules the adapter does not name must hold zeros. With
    tensor parallelism each rank holds its slice: B's rows of a column-parallel module (each of
    q/k/v on its own), A's columns of a row-parallel one; the slot's shape says which. Expert
    stacks (`experts`, PEFT module -> wrapper) are read per expert as vLLM's loader splits them
    (lorarl.sync.experts), all experts of a projection in one reduction.
    """
    experts = experts or {}
    slots = held.shapes
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
    pending: dict[str, tuple[Tensor, Tensor]] = {}
    for module, ab in pairs.items():
        if module not in slots and _other_ranks_expert(module, slots):
            continue  # expert parallelism: another rank holds (and checks) this expert
        a_shape, b_shape = _slot(module, slots)
        a = _tp_shard(ab["A"].detach(), 1, a_shape[1], tp_rank, tp_size).to(layout.lora_dtype)
        b = _tp_shard(ab["B"].detach(), 0, b_shape[0], tp_rank, tp_size).to(layout.lora_dtype)
        scaling = layout.scaling_of(adapter_config, peft_module[module])
        if scaling != 1:
            b = b * scaling  # in the LoRA dtype, as vLLM's LoRALayerWeights.optimize does
        if b.shape[1] < b_shape[1]:
            b = torch.nn.functional.pad(b, (0, b_shape[1] - b.shape[1]))
        pending[module] = (a, b)
    groups = [(list(pending), _stacked([t for pair in pending.values() for t in pair]))] if pending else []
    for stem, ab in stacks.items():
        groups += _expert_stack_rows(ab, experts[stem], adapter_config, layout, slots, tp_rank, tp_size)
    index = {name: i for i, name in enumerate(held.names)}
    out = torch.zeros(len(held.names), 4, dtype=torch.int64)
    for names, rows in groups:
        out[[index[n] for n in names]] = rows.cpu()
    return out


def _stacked(tensors: list[Tensor]) -> Tensor:
    """[k, 4] sums of (A, B) pairs given as [A0, B0, A1, B1, ...]."""
    return torch.stack([t.to(tensors[0].device) for t in fingerprint_sums_many(tensors)]).reshape(-1, 4)


def _slot(module: str, slots: Mapping[str, tuple]) -> tuple:
    if module not in slots:
        raise SyncError(
            f"adapter module '{module}' has no LoRA slot in vLLM (its LoRA modules are e.g. "
            f"{', '.join(sorted(slots)[:3])}); the rollout cannot serve it"
        )
    return slots[module]


def _expert_stack_rows(ab, wrapper, adapter_config, layout, slots, tp_rank, tp_size):
    """Per projection of one PEFT expert stack: (the vLLM slot of each expert this rank holds,
    [n, 4] fingerprint sums of their A and B), as vLLM's loader would store them."""
    if set(ab) != {"A", "B"}:
        raise SyncError(f"expert stack '{wrapper.module}' has lora_{''.join(ab)} but not both factors")
    stem = experts_module(wrapper.module)
    out = []
    for proj, a_all, b_all in stacked_expert_factors(ab["A"].detach(), ab["B"].detach(), wrapper):
        names = [layout.module_of(f"{stem}.{e}.{proj}.lora_A.weight")[0] for e in range(wrapper.num_experts)]
        mine = [e for e, n in enumerate(names) if n in slots]
        if not mine:
            if _other_ranks_expert(names[0], slots):
                continue  # expert parallelism: another rank holds (and checks) these experts
            _slot(names[0], slots)
        a_shape, b_shape = slots[names[mine[0]]]
        a = _tp_shard(a_all[mine], 2, a_shape[1], tp_rank, tp_size).to(layout.lora_dtype)
        b = _tp_shard(b_all[mine], 1, b_shape[0], tp_rank, tp_size).to(layout.lora_dtype)
        scaling = layout.scaling_of(adapter_config, _PEFT_MODULE.sub("", f"{stem}.0.{proj}.lora_A.weight"))
        if scaling != 1:
            b = b * scaling  # in the LoRA dtype, as vLLM's LoRALayerWeights.optimize does
        if b.shape[2] < b_shape[1]:
            b = torch.nn.functional.pad(b, (0, b_shape[1] - b.shape[2]))
        out.append(([names[e] for e in mine], torch.cat([fingerprint_rows(a), fingerprint_rows(b)], 1)))
    return out


_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.\d+\.[^.]+$")


def _other_ranks_expert(module: str, slots: Mapping[str, tuple]) -> bool:
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


def check_adapter_sums(expected: Tensor, held: HeldSlots, rank: int | None = None) -> float:
    """1.0 when every slot vLLM holds matches; otherwise a SyncError naming the first (by name)."""
    bad = (expected != held.sums).any(1).nonzero().flatten().tolist()
    if not bad:
        return 1.0
    i = min(bad, key=lambda j: held.names[j])
    part, cols = (
        ("lora_A", slice(0, 2)) if bool((expected[i, :2] != held.sums[i, :2]).any()) else ("lora_B", slice(2, 4))
    )
    state = "other values" if bool(held.sums[i, cols].any()) else "zeros"
    raise SyncError(
        f"{'' if rank is None else f'rank {rank}: '}after the sync vLLM's {part} of '{held.names[i]}' differs from "
        f"what the trainer sent (it holds {state}; {len(held.names)} modules checked); the rollout is not using the "
        "trained adapter"
    )


def verify_adapter(rollout, payload, rank: int | None = None) -> float:
    """The exact check after an adapter sync: 1.0, or a SyncError naming the first module that
    differs. `rollout` is a lorarl VLLMRollout, `payload` the adapter WeightPayload it was sent."""
    held = rollout.held_adapter_sums()
    layout = rollout.adapter_layout()
    args = (payload.adapter_config, layout, held, rollout.tp_rank, rollout.tp_size, payload.experts)
    return check_adapter_sums(expected_adapter_sums(payload.tensors, *args), held, rank)


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
