"""Qwen3-MoE expert LoRA on the Megatron backend: names, parallel layouts, expert-parallel export.

Pure torch (plus torch.distributed for the gather); no Megatron import.

- The one naming rule: an expert's adapter travels per expert, under the names of the HF
  checkpoint's per-expert linears (`model.layers.L.mlp.experts.E.gate_proj`, as Qwen3-MoE
  checkpoints store them on disk and transformers 5.x saves them), which is also what vLLM's
  2D fused-MoE LoRA loader expects for Qwen3-MoE (`experts.E.gate_proj|up_proj|down_proj`,
  its expert params mapping in 0.26 and 0.32) and what Megatron-Bridge 0.6.2's Qwen3MoEBridge
  export yields. Full tensors: vLLM slices them itself under its own tensor parallelism.
- Which expert layouts export correctly (checked by the config, lorarl.config.backends and
  lorarl.config.validate.check_model_shape): expert tensor parallelism
  > 1 does not. Megatron-Bridge 0.6.2 splits an expert's fused [gate; up] LoRA B as if it were
  unsharded (`_split_fused_fc1_linear_out_weight(is_expert=True)` uses a TP size of 1), but a
  gathered ETP-sharded B is [g_0, u_0, g_1, u_1, ...]: gate and up come out mixed, silently
  (Megatron-Bridge #5635). Refused up front, not detected late.
- Expert parallelism (`gather_expert_adapter`): with the local layer spec experts are a
  SequentialMLP, and the bridge's adapter export yields on each expert-parallel rank only the
  experts that rank holds, numbered locally: base weights get the expert-parallel gather and
  global numbers (`_megatron_local_name_to_global`), adapter parameters get neither, so rank 1
  of 2 names its expert 64 "experts.0", a silent mislabel. The trainer renumbers and gathers, so
  every rank holds the whole adapter under global expert numbers, as for dense models.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lorarl.engines.megatron.names import expert_lora_name, parse_expert_lora_name
from lorarl.errors import SyncError

# ---------------------------------------------------------------------------------------------
# Parallel layouts
# ---------------------------------------------------------------------------------------------


def num_experts_of(hf_config: Any) -> int:
    """Routed experts of an HF config (Qwen3-MoE: num_experts), 0 for a dense model."""
    return int(getattr(hf_config, "num_experts", None) or 0)


# ---------------------------------------------------------------------------------------------
# Expert-parallel export
# ---------------------------------------------------------------------------------------------

AllGather = Callable[[torch.Tensor], list[torch.Tensor]]


@dataclass(frozen=True)
class ExpertParallel:
    """Where experts live: expert-parallel rank r holds experts [r * E/ep, (r + 1) * E/ep),
    megatron-core's contiguous assignment (vLLM's expert-parallel LoRA loader uses the same)."""

    num_experts: int
    ep_size: int
    ep_rank: int

    def __post_init__(self) -> None:
        if self.num_experts % self.ep_size or not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"{self.num_experts} experts cannot be split over rank {self.ep_rank} of {self.ep_size}")

    @property
    def local(self) -> int:
        return self.num_experts // self.ep_size

    def local_experts(self, rank: int | None = None) -> range:
        r = self.ep_rank if rank is None else rank
        return range(r * self.local, (r + 1) * self.local)


def torch_all_gather(group: Any, size: int) -> AllGather:
    """all_gather over a torch.distributed process group of `size` ranks, in rank order."""
    import torch.distributed as dist

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return parts

    return gather


def gather_expert_adapter(
    tensors: Mapping[str, torch.Tensor], ep: ExpertParallel, all_gather: AllGather
) -> dict[str, torch.Tensor]:
    """The whole adapter on every expert-parallel rank, from each rank's own experts.

    Collective over the expert-parallel group whenever this rank's expert tensors are its local
    experts only, numbered 0..E/ep-1 (as Megatron-Bridge 0.6.2 exports them) or already by
    their global numbers; a no-op when every expert is present (grouped experts, which the
    bridge gathers itself, or ep_size 1). The case is the same on every rank of a run, so all
    ranks take the same branch. Anything else is a SyncError naming what was found.
    Non-expert tensors (attention) pass through unchanged.
    """
    own = {n: parse_expert_lora_name(n) for n in tensors}
    experts = {n: p for n, p in own.items() if p is not None}
    present = {p[1] for p in experts.values()}
    if not experts or present == set(range(ep.num_experts)):
        return dict(tensors)
    local = set(ep.local_experts())
    if ep.ep_size == 1 or present not in (local, set(range(ep.local))):
        raise SyncError(
            f"the expert adapter export on expert-parallel rank {ep.ep_rank}/{ep.ep_size} holds experts "
            f"{_span(present)}; expected all {ep.num_experts}, or this rank's {_span(local)} numbered "
            f"globally or 0..{ep.local - 1} locally"
        )
    start = min(present)  # 0 when numbered locally
    # One fixed order of (layer, local slot, projection, A|B), the same on every rank.
    slots = sorted(experts, key=lambda n: (experts[n][0], experts[n][1] - start, experts[n][2], experts[n][3]))
    dtypes = {tensors[n].dtype for n in slots}
    if len(dtypes) != 1:
        raise SyncError(f"expert LoRA tensors have mixed dtypes {sorted(map(str, dtypes))}; cannot gather them")
    flat = torch.cat([tensors[n].reshape(-1) for n in slots])
    shapes = [tensors[n].shape for n in slots]
    sizes = [tensors[n].numel() for n in slots]
    out = {n: t for n, t in tensors.items() if n not in experts}
    for rank, buf in enumerate(all_gather(flat)):
        if buf.numel() != flat.numel():
            raise SyncError(
                f"expert-parallel rank {rank} sent {buf.numel()} expert LoRA values, this rank has {flat.numel()}"
            )
        first = ep.local_experts(rank).start
        for n, piece, shape in zip(slots, torch.split(buf, sizes), shapes):
            layer, expert, proj, ab = experts[n]
            out[expert_lora_name(layer, first + expert - start, proj, ab)] = piece.reshape(shape).clone()
    return out


def _span(experts: set[int]) -> str:
    if not experts:
        return "none"
    lo, hi = min(experts), max(experts)
    return f"{lo}..{hi}" if len(experts) == hi - lo + 1 else f"{len(experts)} scattered ({lo}..{hi})"


__all__ = [
    "num_experts_of",
    "ExpertParallel",
    "torch_all_gather",
    "gather_expert_adapter",
]
