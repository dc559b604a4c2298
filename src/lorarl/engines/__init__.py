"""Training backends: what each one is, in one table.

`backend.strategy` (set by conf/backend/<name>.yaml) picks a row; nothing else in the code
compares backend names. The engine classes are imported only when a worker builds one, so
choosing FSDP never imports Megatron.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    option: str  # the +backend=<option> that selects it
    engine: str  # "module:Class" implementing lorarl.contract.engine.Engine
    needs_cuda: bool
    # HF projection names in model.lora.target_modules are checked against the checkpoint
    # (Megatron's bridge maps its own names and checks them itself).
    checks_hf_lora_targets: bool
    # Where the LM head runs in an update, for the memory estimate (lorarl.rollout.memory): False, only at
    # the response positions; True, at every position (Megatron's GPT model), its loss then
    # taking whole float32 copies of the logits when they are split over TP ranks.
    head_at_every_position: bool
    # Whether the engine computes the semantic sync check's expected side (`lora_projections`,
    # lorarl.sync.semantic); without it a sync is checked by the transport fingerprint and the probe.
    semantic_sync_check: bool
    # The same for merged sync (`base_projections` too, lorarl.sync.semantic_merged).
    merged_sync_check: bool

    def checks_meaning(self, merge: bool) -> bool:
        """Whether a sync of this kind (merged or adapter) gets the semantic check."""
        return self.merged_sync_check if merge else self.semantic_sync_check

    def engine_class(self) -> type:
        module, name = self.engine.split(":")
        return getattr(importlib.import_module(module), name)


BACKENDS: dict[str, Backend] = {
    "fsdp2": Backend(
        option="fsdp",
        engine="lorarl.engines.fsdp:FSDPEngine",
        needs_cuda=False,
        checks_hf_lora_targets=True,
        head_at_every_position=False,
        semantic_sync_check=True,
        merged_sync_check=True,
    ),
    "megatron": Backend(
        option="megatron",
        engine="lorarl.engines.megatron.engine:MegatronEngine",
        needs_cuda=True,
        checks_hf_lora_targets=False,
        head_at_every_position=True,
        # From the bridge's own fused adapters, TP/EP/PP shares combined
        # (lorarl.engines.megatron.projections); checked on real tensors on CPU, run on GPU only.
        semantic_sync_check=True,
        # Its base side, u^T W_base v from Megatron's own sharded fused base weights
        # (lorarl.engines.megatron.base_projections); checked on real tensors on CPU, not yet run on GPU.
        merged_sync_check=True,
    ),
}


def backend_of(strategy: str) -> Backend:
    """The row of `backend.strategy`."""
    return BACKENDS[strategy]
