"""What lorarl.sync.transport reads from a VLLMRollout: fingerprints of the weights it was sent and of
the weights (and LoRA stacks) vLLM holds. A mixin of VLLMRollout, kept apart from how it samples and
applies payloads."""

from __future__ import annotations

from lorarl.errors import SyncError
from lorarl.rollout import vllm_worker
from lorarl.rollout.vllm_names import FUSED_ORDER, served_name
from lorarl.sync.fingerprint import Fingerprint, combine, resolve
from lorarl.sync.transport import AdapterLayout, LoraSlot

ADAPTER_ID = 1


class FingerprintReads:
    """Needs `_sent` (per HF name of the last base payload: fingerprint sums and numel),
    `lora_enabled`, `has_adapter`, `_layout` and `run_in_worker` from the rollout."""

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
        return self.run_in_worker(vllm_worker.weight_fingerprints, numels)

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
            self._layout = self.run_in_worker(vllm_worker.adapter_layout)
        return self._layout

    def held_adapter_slots(self) -> dict[str, LoraSlot]:
        """Fingerprints of the LoRA stacks vLLM computes with, per module part."""
        if not self.has_adapter:
            raise SyncError("the rollout holds no adapter to fingerprint; sync one first")
        return self.run_in_worker(vllm_worker.adapter_slots, ADAPTER_ID)
