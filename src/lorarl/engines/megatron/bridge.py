"""The weight exports of Megatron-Bridge's `AutoBridge`, one method per payload kind.

`AutoBridge` has `export_hf_weights` / `export_adapter_weights`, not mbridge's similarly shaped
`export_weights`; the adapter names the exact methods it calls (`REQUIRED_METHODS`, checked
against the real class's source in the tests) and checks them when it is built, so a wrong
bridge object fails at start-up with the bridge's name, not mid-run with an AttributeError.

Method names and keyword arguments are those of megatron-bridge 0.6.2
(`megatron/bridge/models/conversion/auto_bridge.py`). Export tensors are collective over the
model-parallel group (every rank must iterate them) and come out owned (cloned), so they may
outlive the next optimizer step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from lorarl.engines.megatron.names import normalize_adapter_names, normalize_base_names
from lorarl.errors import ConfigError

# Methods the adapter calls on the wrapped bridge object during export.
REQUIRED_METHODS = frozenset({"export_hf_weights", "export_adapter_weights", "get_conversion_tasks"})
# Methods the engine calls on the same object while building the model (checked too).
BUILD_METHODS = frozenset({"from_hf_pretrained", "to_megatron_provider"})

Named = Iterator[tuple[str, torch.Tensor]]


def owned(named: Iterable[tuple[str, torch.Tensor]]) -> Named:
    """Clone every tensor: bridges yield views of live parameters (norms, embeddings at TP=1,
    and `cpu=True` is a no-op for tensors already on the CPU), which the next optimizer step
    would change under the receiver."""
    for name, tensor in named:
        yield name, tensor.detach().clone()


def _check_methods(obj: Any) -> None:
    missing = sorted(m for m in REQUIRED_METHODS if not callable(getattr(obj, m, None)))
    if missing:
        raise ConfigError(
            f"backend.bridge=megatron_bridge but the bridge object {type(obj).__module__}.{type(obj).__qualname__} "
            f"lacks {', '.join(missing)}; it is not Megatron-Bridge's AutoBridge"
        )


class MegatronBridgeAdapter:
    """Megatron-Bridge `AutoBridge`: base and adapter exports are separate native calls."""

    def __init__(self, auto_bridge: Any, cpu: bool = False) -> None:
        _check_methods(auto_bridge)
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
        """Frozen base weights, plain HF names (`model.layers.0.self_attn.q_proj.weight`)."""
        return self._export_hf(model, merge=False)

    def export_adapter(self, model: list) -> Named:
        """LoRA tensors only, PEFT names (`base_model.model.<module>.lora_A.weight`)."""
        stream = self.bridge.export_adapter_weights(model, cpu=self.cpu, show_progress=False)
        return owned(normalize_adapter_names(stream))

    def export_merged(self, model: list) -> Named:
        """W + (alpha/r)·B·A for every adapted weight plus the rest, plain HF names."""
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


__all__ = ["REQUIRED_METHODS", "BUILD_METHODS", "MegatronBridgeAdapter", "owned"]
