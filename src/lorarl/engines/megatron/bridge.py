"""One weight-export interface over the two HF<->Megatron bridges, one method per payload kind.

The seed bug called mbridge's `export_weights` on Megatron-Bridge's `AutoBridge`, which only
has `export_hf_weights` / `export_adapter_weights`. Here each adapter names the exact methods
it calls (`REQUIRED_METHODS`, checked against the real classes' source in the tests) and
checks them when it is built, so a wrong pairing fails at start-up with the bridge's name,
not mid-run with an AttributeError.

Method names and keyword arguments are those of megatron-bridge 0.6.2
(`megatron/bridge/models/conversion/auto_bridge.py`) and mbridge 0.15.1
(`mbridge/core/bridge.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from lorarl.engines.megatron.names import normalize_adapter_names, normalize_base_names
from lorarl.errors import ConfigError

BRIDGES = ("megatron_bridge", "mbridge")

# Methods each adapter calls on the wrapped bridge object during export.
REQUIRED_METHODS: dict[str, frozenset[str]] = {
    "megatron_bridge": frozenset({"export_hf_weights", "export_adapter_weights", "get_conversion_tasks"}),
    "mbridge": frozenset({"export_weights"}),
}
# Methods the engine calls on the same object while building the model (checked too).
BUILD_METHODS: dict[str, frozenset[str]] = {
    "megatron_bridge": frozenset({"from_hf_pretrained", "to_megatron_provider"}),
    "mbridge": frozenset({"from_pretrained"}),
}

MBRIDGE_NO_ADAPTER = (
    "backend.bridge=mbridge has no LoRA adapter export; set model.lora.merge=true or backend.bridge=megatron_bridge"
)

Named = Iterator[tuple[str, torch.Tensor]]


@runtime_checkable
class WeightBridge(Protocol):
    """Exports a Megatron model's weights under Hugging Face names.

    All three are collective over the model-parallel group: every rank must iterate them.
    Tensors come out owned (cloned), so they may outlive the next optimizer step.
    """

    name: str
    supports_adapter: bool

    def export_base(self, model: list) -> Named:
        """Frozen base weights, plain HF names (`model.layers.0.self_attn.q_proj.weight`)."""
        ...

    def export_adapter(self, model: list) -> Named:
        """LoRA tensors only, PEFT names (`base_model.model.<module>.lora_A.weight`)."""
        ...

    def export_merged(self, model: list) -> Named:
        """W + (alpha/r)·B·A for every adapted weight plus the rest, plain HF names."""
        ...


def owned(named: Iterable[tuple[str, torch.Tensor]]) -> Named:
    """Clone every tensor: bridges yield views of live parameters (norms, embeddings at TP=1,
    and `cpu=True` is a no-op for tensors already on the CPU), which the next optimizer step
    would change under the receiver."""
    for name, tensor in named:
        yield name, tensor.detach().clone()


def _check_methods(obj: Any, bridge: str) -> None:
    missing = sorted(m for m in REQUIRED_METHODS[bridge] if not callable(getattr(obj, m, None)))
    if missing:
        raise ConfigError(
            f"backend.bridge={bridge} but the bridge object {type(obj).__module__}.{type(obj).__qualname__} "
            f"lacks {', '.join(missing)}; it is not a {bridge} bridge (pick the other backend.bridge value)"
        )


class MegatronBridgeAdapter:
    """Megatron-Bridge `AutoBridge`: base and adapter exports are separate native calls."""

    name = "megatron_bridge"
    supports_adapter = True

    def __init__(self, auto_bridge: Any, cpu: bool = False) -> None:
        _check_methods(auto_bridge, self.name)
        self.bridge = auto_bridge
        # False keeps tensors on the GPU for a colocated vLLM; the payload moves them if needed.
        self.cpu = cpu
        self._tasks: list | None = None

    def conversion_tasks(self, model: list) -> list:
        # Each export otherwise rebuilds the tasks, including an all_gather_object over the
        # pipeline group. They hold references to the live parameters, so they stay valid
        # across steps; they must be built after LoRA wrapping (names contain `to_wrap`).
        if self._tasks is None:
            self._tasks = self.bridge.get_conversion_tasks(model)
        return self._tasks

    def export_base(self, model: list) -> Named:
        return self._export_hf(model, merge=False)

    def export_adapter(self, model: list) -> Named:
        stream = self.bridge.export_adapter_weights(model, cpu=self.cpu, show_progress=False)
        return owned(normalize_adapter_names(stream))

    def export_merged(self, model: list) -> Named:
        return self._export_hf(model, merge=True)

    def _export_hf(self, model: list, merge: bool) -> Named:
        stream = self.bridge.export_hf_weights(
            model,
            cpu=self.cpu,
            show_progress=False,
            conversion_tasks=self.conversion_tasks(model),
            merge_adapter_weights=merge,
        )
        return owned(normalize_base_names(stream))


class MBridgeAdapter:
    """Vanilla mbridge (0.15.x): one `export_weights` for full weights, no LoRA support.

    mbridge resolves names from `named_parameters()` and cannot see through LoRA wrappers, so
    a merged export needs the model in merged, unwrapped form while it runs: `merged_view`
    is a context-manager factory the engine passes in to do that (identity when the model
    has no LoRA).
    """

    name = "mbridge"
    supports_adapter = False

    def __init__(self, bridge: Any, merged_view: Callable[[list], AbstractContextManager[Any]] | None = None) -> None:
        _check_methods(bridge, self.name)
        self.bridge = bridge
        self.merged_view = merged_view or (lambda model: contextlib.nullcontext())

    def export_base(self, model: list) -> Named:
        return owned(normalize_base_names(self.bridge.export_weights(model)))

    def export_adapter(self, model: list) -> Named:
        raise ConfigError(MBRIDGE_NO_ADAPTER)

    def export_merged(self, model: list) -> Named:
        # A generator, so the merge is undone only after the last tensor has been read.
        with self.merged_view(model):
            yield from owned(normalize_base_names(self.bridge.export_weights(model)))


__all__ = [
    "BRIDGES",
    "REQUIRED_METHODS",
    "BUILD_METHODS",
    "WeightBridge",
    "MegatronBridgeAdapter",
    "MBridgeAdapter",
    "owned",
]
