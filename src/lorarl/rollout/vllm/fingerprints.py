"""What the sync checks read from a VLLMRollout: fingerprints of the weights it was sent and of the
weights and LoRA slots vLLM holds (lorarl.sync.transport), the deltas those slots apply
(lorarl.sync.semantic) and the merged weights it serves (lorarl.sync.semantic_merged). A mixin of VLLMRollout, kept apart from how it samples and applies payloads."""

from __future__ import annotations

from torch import Tensor

from lorarl.errors import SyncError
from lorarl.rollout.vllm import in_worker, lora_slots, weights
from lorarl.rollout.vllm.adapters import lora_id
from lorarl.rollout.vllm.names import FUSED_ORDER, served_name
from lorarl.sync.fingerprint import Fingerprint, combine, resolve
from lorarl.sync.transport import AdapterLayout, HeldSlots


class FingerprintReads:
    """Needs `_sent` (per HF name of the last base payload: fingerprint sums and numel),
    `lora_enabled`, `holds`, `_layout` and `run_in_worker` from the rollout."""

    def sent_weight_fingerprints(self) -> dict[str, Fingerprint]:
        """Per parameter vLLM serves, the fingerprint the last base payload should have left
        there (q/k/v and gate/up combined in vLLM's fused order). Needs fingerprint_base=True."""
        parts: dict[str, list[tuple[int, Fingerprint, int]]] = {}
        fps = resolve([sums for sums, _ in self._sent.values()])
        for (name, (_, numel)), fp in zip(self._sent.items(), fps):
            proj = name.rpartition(".")[0].rpartition(".")[2]
            parts.setdefault(served_name(name), []).append((FUSED_ORDER.get(proj, 0), fp, numel))
        return {name: combine((fp, n) for _, fp, n in sorted(p, key=lambda x: x[0])) for name, p in parts.items()}

    def held_weight_fingerprints(self, numels: dict[str, int]) -> dict[str, tuple | None]:
        """(fingerprint, dtype) of the parameters vLLM serves (None where it keeps them unreadable)."""
        return self.run_in_worker(in_worker.weight_fingerprints, numels)

    def sent_numels(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, (_, numel) in self._sent.items():
            out[served_name(name)] = out.get(served_name(name), 0) + numel
        return out

    def adapter_layout(self) -> AdapterLayout:
        """vLLM's LoRA dtype, scaling rule and adapter name parser (read once)."""
        if not self.lora_enabled:
            raise SyncError("adapter_layout asked of a rollout without LoRA (merged mode)")
        if self._layout is None:
            self._layout = self.run_in_worker(in_worker.adapter_layout)
        return self._layout

    def held_adapter_sums(self, slot: int = 0) -> HeldSlots:
        """Fingerprint sums of the LoRA stacks vLLM computes with for slot `slot`, one row per module part."""
        if not self.holds(slot):
            raise SyncError("the rollout holds no adapter to fingerprint; sync one first")
        return self.run_in_worker(lora_slots.adapter_slot_sums, lora_id(slot))

    def lora_projections(
        self, wanted: dict[str, tuple[int, int, int]], slot: int = 0
    ) -> tuple[Tensor, Tensor, list[str]]:
        """The semantic check's observed side, whole: per wanted vLLM slot name (-> row, full out,
        full in), u^T dW v from the slots vLLM computes with, the share of the module held, and the
        slots holding a delta nobody asked for. With tensor parallelism the ranks of this engine
        add up their slices (collective over them)."""
        if not self.holds(slot):
            raise SyncError("the rollout holds no adapter to check; sync one first")
        values, share, stray = self.run_in_worker(
            lora_slots.lora_projections, lora_id(slot), wanted, (self.tp_rank, self.tp_size)
        )
        if self.tp_size > 1:
            import torch.distributed as dist
            from vllm.distributed.parallel_state import get_tp_group

            group = get_tp_group().cpu_group
            for t in (values, share):
                dist.all_reduce(t, group=group)
        return values, share, stray

    def weight_projections(self, wanted: dict[str, tuple[int, int, int]]) -> tuple[Tensor, Tensor, float]:
        """The merged check's observed side, whole: per wanted HF module path (-> row, full out,
        full in), u^T W v of the weight vLLM serves, the share of the module held, and the unit
        roundoff the reading adds. With tensor parallelism the ranks of this engine add up their
        slices (collective over them)."""
        values, share, roundoff = self.run_in_worker(weights.weight_projections, wanted, (self.tp_rank, self.tp_size))
        if self.tp_size > 1:
            import torch
            import torch.distributed as dist
            from vllm.distributed.parallel_state import get_tp_group

            group = get_tp_group().cpu_group
            for t in (values, share):
                dist.all_reduce(t, group=group)
            worst = torch.tensor([roundoff], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
            roundoff = float(worst)
        return values, share, roundoff
