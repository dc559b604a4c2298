"""What the Megatron GPU tests' torchrun workers share: the raw LoRA shards to cross-check the
bridge's export against, and the files rank 0 leaves for the pytest side to compare."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def lora_shards(engine) -> dict[str, list[torch.Tensor]]:
    """{Megatron LoRA parameter name: its TP shards in rank order} (collective over TP), to
    cross-check the bridge's adapter export against names.megatron_lora_to_peft."""
    import torch.distributed as dist

    group = engine.ps.get_tensor_model_parallel_group()
    out: dict[str, list[torch.Tensor]] = {}
    for chunk in engine.model:
        for name, p in chunk.named_parameters():
            if ".adapter." not in name:
                continue
            local = p.detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(engine.tp)]
            dist.all_gather(parts, local, group=group)
            out[name] = parts
    return out


def save_probe_and_result(out: Path, probe, policy: torch.Tensor, reference: torch.Tensor, result: dict) -> None:
    """The probe sequence with the engine's policy and reference log-probs, and the run's numbers."""
    from safetensors.torch import save_file

    save_file(
        {"ids": probe.input_ids, "mask": probe.response_mask, "policy": policy, "reference": reference},
        str(out / "probe.safetensors"),
    )
    (out / "result.json").write_text(json.dumps(result, indent=1, default=float))
