"""The rollout's LoRA slots: which adapter each holds, how a synced adapter gets into one, and how a
request names it. A mixin of VLLMRollout (lorarl.rollout.vllm.engine), kept apart from sampling and base
weights.

A run has one adapter, in slot 0. A sweep's group trains one adapter per job over one base
(lorarl.engines.adapter_routing), and vLLM serves them all from one engine: `max_loras` slots, slot
k under the fixed id k + 1 and its own name, each replaced in place on every sync. With as many
slots as adapters vLLM never evicts one, so nothing written into a slot is lost and every request
finds its adapter resident. `RolloutSlot` shows one slot as a rollout of its own, so the sync and
its checks (lorarl.sync) run unchanged per adapter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from lorarl.contract.payload import PayloadKind, SyncStats, WeightPayload
from lorarl.errors import ConfigError, SyncError, one_line
from lorarl.files.peft_io import save_peft_adapter
from lorarl.rollout.vllm import in_worker, lora_write
from lorarl.sync.experts import vllm_form

# Fixed names and ids, replaced in place on every sync: with a new id per sync, requests could
# keep naming an old one; with the same id and no in-place flag, vLLM keeps the adapter it holds.
ADAPTER_NAME = "lorarl-policy"
# Never read while the adapter is resident; named so an eviction fails loudly.
_MEMORY_ADAPTER_PATH = "/nonexistent/lorarl-in-memory-adapter"


def lora_id(slot: int) -> int:
    """vLLM's id of slot `slot` (vLLM wants ids > 0)."""
    return slot + 1


def lora_name(slot: int) -> str:
    """vLLM's name of slot `slot`: its prefix-cache keys carry it, so no two slots share KV."""
    return ADAPTER_NAME if slot == 0 else f"{ADAPTER_NAME}-{slot}"


@dataclass
class SlotState:
    """What the rollout knows of one LoRA slot; never inferred from vLLM."""

    loaded: bool = False  # an adapter payload was applied; requests naming the slot carry it
    rejected: str | None = None  # why the last adapter failed to load; generation refuses meanwhile
    copy: tuple[dict[str, Tensor], dict, dict] | None = None  # memory transport's (tensors, config, experts)
    structure: tuple | None = None  # what vLLM's loader last put in the slot (lora_write.structure)
    folder: Path | None = None  # tmpfs transport's PEFT folder


class AdapterSlots:
    """Needs from the rollout: `llm`, `run_in_worker`, `adapter_transport`, `base_loaded`,
    `lora_enabled`, `max_lora_rank`, `tp_size`, `_adapter_dir`, `_cpu_moe_lora`, and `_slots`
    (one SlotState per vLLM LoRA slot, made by the rollout)."""

    @property
    def has_adapter(self) -> bool:
        """Slot 0 holds an applied adapter (a run's one adapter)."""
        return self.holds(0)

    @property
    def adapter_rejected(self) -> str | None:
        return self._slots[0].rejected

    def holds(self, slot: int) -> bool:
        return self._slots[slot].loaded

    def slot(self, slot: int) -> RolloutSlot:
        return RolloutSlot(self, slot)

    def lora_request(self, slot: int = 0):
        """The request a generate call carries for slot `slot`: its adapter, or None without one.

        Raises when the slot's last adapter was rejected: serving the one before it would be silent."""
        if self._cpu_moe_lora:
            raise ConfigError(
                "vLLM's CPU build cannot generate with a MoE model when LoRA is enabled (its fused-MoE LoRA kernel "
                "is Triton-only); set model.lora.merge=true on CPU, or run adapter sync on a GPU"
            )
        state = self._slots[slot]
        if state.rejected is not None:
            raise SyncError(
                f"the rollout holds no valid adapter: vLLM rejected the last one ({state.rejected}); "
                "sync a valid adapter before generating"
            )
        if not state.loaded:
            return None
        from vllm.lora.request import LoRARequest

        # Without load_inplace: a request must use the resident adapter, not reload it.
        path = str(state.folder) if self.adapter_transport == "tmpfs" else _MEMORY_ADAPTER_PATH
        return LoRARequest(lora_name(slot), lora_id(slot), path)

    def _apply_adapter(self, payload: WeightPayload, slot: int) -> SyncStats:
        if not self.lora_enabled:
            raise SyncError(
                "adapter payload sent to a rollout started without LoRA (merged mode); "
                "send merged weights as a base payload or set model.lora.rank for vLLM"
            )
        if not self.base_loaded:
            raise SyncError("base weights are not in the engine; send a base payload first")
        if not 0 <= slot < len(self._slots):
            raise SyncError(f"adapter slot {slot} does not exist: the engine serves {len(self._slots)}")
        assert payload.adapter_config is not None
        if payload.max_rank > self.max_lora_rank:
            raise SyncError(
                f"adapter rank {payload.max_rank} exceeds the engine's max_lora_rank "
                f"{self.max_lora_rank}; start the rollout with model.lora.rank >= {payload.max_rank}"
            )
        stats = SyncStats(PayloadKind.ADAPTER)
        start = time.perf_counter()
        # Copy out: the receiver owns its tensors, so a trainer (or a reused transfer
        # buffer) writing in place cannot change the adapter vLLM serves. The memory transport
        # copies on the tensors' own device: vLLM then builds, packs and scales the adapter
        # there, where on the host it pinned, concatenated and multiplied ~0.3 GB (7B, r=64).
        home = "cpu" if self.adapter_transport == "tmpfs" else None
        owned = {}
        for name, tensor in payload.tensors:
            owned[name] = tensor.detach().to(home or tensor.device, copy=True).contiguous()
            stats.num_tensors += 1
            stats.bytes += tensor.numel() * tensor.element_size()
        config, experts = dict(payload.adapter_config), dict(payload.experts)
        state = self._slots[slot]
        if self.adapter_transport == "tmpfs":
            assert self._adapter_dir is not None
            state.folder = self._adapter_dir / str(slot)
            save_peft_adapter(state.folder, *vllm_form(owned, config, experts))
            state.copy = None
        else:
            state.copy = (owned, config, experts)
        stats.transfer_s = time.perf_counter() - start
        stats.load_s = self._load_adapter(slot, in_place=self._may_write_in_place(slot))
        return stats

    def _may_write_in_place(self, slot: int) -> bool:
        """Whether the kept adapter can go straight into vLLM's slot (lorarl.rollout.vllm.lora_write):
        memory transport, no tensor parallelism, the same structure in the slot, a checked writer."""
        state = self._slots[slot]
        if state.copy is None or self.tp_size > 1 or not state.loaded:
            return False
        if lora_write.structure(state.copy[0].items(), *state.copy[1:]) != state.structure:
            return False
        if self._writes_in_place is None:
            try:  # leaves random factors in the slot: the kept adapter is loaded next, either way
                why = lora_write.verify_writer(self.slot(slot), *state.copy)
            except Exception as exc:
                why = one_line(exc)
            self._writes_in_place = why is None
            if why is not None:
                print(f"rollout: adapters load through vLLM's loader at every sync (writing in place: {why})")
        return self._writes_in_place

    def load_through_vllm(self, tensors: dict[str, Tensor], config: dict, experts: dict, slot: int = 0) -> None:
        """vLLM's own adapter loader, from tensors in memory (PEFT's expert stacks split per expert)."""
        self._slots[slot].structure = lora_write.structure(tensors.items(), config, experts)
        self.run_in_worker(in_worker.add_adapter_from_tensors, lora_id(slot), *vllm_form(tensors, config, experts))

    def write_in_place(self, tensors: dict[str, Tensor], config: dict, experts: dict, slot: int = 0) -> None:
        """The adapter written into the slot the last load filled (lorarl.rollout.vllm.lora_write)."""
        sources = lora_write.slot_sources(tensors.items(), config, experts, self.adapter_layout())
        self.run_in_worker(lora_write.write_lora_slots, lora_id(slot), sources)

    def _load_adapter(self, slot: int, in_place: bool = False) -> float:
        """Put slot `slot`'s current adapter into the engine under its id, replacing any old one.

        On failure the slot holds no valid adapter: vLLM's copy is removed (it may be the previous
        adapter, or half of the new one) and generation with it refuses until a load succeeds."""
        start = time.perf_counter()
        engine = self.llm
        state = self._slots[slot]
        state.loaded = False
        try:
            if self.adapter_transport == "tmpfs":
                from vllm.lora.request import LoRARequest

                request = LoRARequest(lora_name(slot), lora_id(slot), str(state.folder), load_inplace=True)
                engine.llm_engine.add_lora(request)
            else:
                assert state.copy is not None
                (self.write_in_place if in_place else self.load_through_vllm)(*state.copy, slot=slot)
            loaded = engine.llm_engine.list_loras()
            wanted = {lora_id(k) for k, s in enumerate(self._slots) if s.loaded or k == slot}
            if loaded != wanted:
                raise SyncError(f"vLLM holds adapters {sorted(loaded)}, expected {sorted(wanted)}")
        except Exception as exc:
            self._reject(one_line(exc), slot)
            if isinstance(exc, SyncError):
                raise SyncError(f"after the adapter sync {exc}") from exc
            raise SyncError(f"vLLM rejected the adapter: {one_line(exc)}") from exc
        state.loaded, state.rejected = True, None
        return time.perf_counter() - start

    def _reload_adapters(self) -> float:
        """Every slot that held an adapter, loaded again (vLLM drops them when base weights are replaced)."""
        return sum(self._load_adapter(slot) for slot, state in enumerate(self._slots) if state.loaded)

    def _reject(self, why: str, slot: int) -> None:
        state = self._slots[slot]
        state.rejected, state.copy = why, None
        try:
            self.llm.llm_engine.remove_lora(lora_id(slot))
        except Exception:  # noqa: BLE001 - not holding it is the state wanted
            pass
        if lora_id(slot) in self.llm.llm_engine.list_loras():
            raise SyncError(f"vLLM rejected the adapter ({why}) and still holds adapters it could not drop")


class RolloutSlot:
    """One LoRA slot of a VLLMRollout seen as a rollout of its own: what the weight sync, its checks
    and its probe call (lorarl.sync), aimed at this slot; everything else is the rollout's."""

    def __init__(self, rollout, slot: int):
        self.rollout, self.index = rollout, slot

    def __getattr__(self, name: str):
        return getattr(self.rollout, name)

    @property
    def has_adapter(self) -> bool:
        return self.rollout.holds(self.index)

    @property
    def adapter_rejected(self) -> str | None:
        return self.rollout._slots[self.index].rejected

    def lora_request(self):
        return self.rollout.lora_request(self.index)

    def apply(self, payload: WeightPayload) -> SyncStats:
        return self.rollout.apply(payload, slot=self.index)

    def load_through_vllm(self, tensors: dict[str, Tensor], config: dict, experts: dict) -> None:
        self.rollout.load_through_vllm(tensors, config, experts, slot=self.index)

    def write_in_place(self, tensors: dict[str, Tensor], config: dict, experts: dict) -> None:
        self.rollout.write_in_place(tensors, config, experts, slot=self.index)

    def held_adapter_sums(self):
        return self.rollout.held_adapter_sums(self.index)

    def lora_projections(self, wanted: dict[str, tuple[int, int, int]]):
        return self.rollout.lora_projections(wanted, self.index)

    def prompt_logprobs_many(self, sequences, start: int) -> list[list[float]]:
        return self.rollout.prompt_logprobs_many(sequences, start, slot=self.index)
