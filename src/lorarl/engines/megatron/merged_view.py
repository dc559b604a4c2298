"""LoRA merged into its Megatron base weights for exporters that know only plain names (mbridge).

Split out of the engine: used only by backend.bridge=mbridge (merged sync), GPU only.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def merged_lora_view(model: list):
    """UNVERIFIED: LoRA merged into its base weights and the wrappers taken out of the tree.

    For exporters that walk named_parameters() and know only plain Megatron names (mbridge).
    Each base weight is backed up to CPU and restored on exit, so the bf16 base does not drift
    from repeated merge/unmerge. Uses Megatron-Bridge's own LoRAMerge for the TP-aware product.
    """
    from megatron.bridge.peft.lora_merge import LoRAMerge
    from megatron.core import parallel_state

    merger = LoRAMerge()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module, torch.nn.Module, torch.Tensor]] = []
    try:
        for chunk in model:
            for parent in list(chunk.modules()):
                for child_name, child in list(parent.named_children()):
                    adapter = getattr(child, "adapter", None)
                    base = getattr(child, "to_wrap", None)
                    if base is None or adapter is None or not hasattr(adapter, "linear_in"):
                        continue
                    backup = base.weight.detach().to("cpu", copy=True)
                    with torch.no_grad():
                        merged = merger.merge(
                            base.weight.float(),
                            adapter.linear_out.weight.float(),
                            adapter.linear_in.weight.float(),
                            adapter.alpha,
                            adapter.dim,
                            tp_group=tp_group,
                        )
                        base.weight.copy_(merged.to(base.weight.dtype))
                    setattr(parent, child_name, base)
                    swapped.append((parent, child_name, child, base, backup))
        yield model
    finally:
        for parent, child_name, wrapper, base, backup in reversed(swapped):
            with torch.no_grad():
                base.weight.copy_(backup.to(base.weight.device))
            setattr(parent, child_name, wrapper)


__all__ = ["merged_lora_view"]
