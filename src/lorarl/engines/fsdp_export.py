"""Gathering what the FSDP engine sends to vLLM: an adapter's LoRA tensors under PEFT names
(bucketed: one all-gather of the LoRA shards, never touching base weights; layered: one FSDP
unit unsharded at a time), and the base weights under HF names, merged with the adapter if asked.
Collective: every rank calls, every rank gets the whole."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lorarl.engines.fsdp_shard import fsdp_units, own_params
from lorarl.sync.experts import expert_delta

PEFT_PREFIX = "base_model.model."


def adapter_layered(
    model, adapter: str, device: torch.device, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Adapter `adapter`'s LoRA tensors under PEFT names, one FSDP unit unsharded at a time."""
    mine = f".{adapter}."
    out = {}
    with torch.no_grad():
        for prefix, unit in fsdp_units(model):
            own = [(n, p) for n, p in own_params(unit) if "lora_" in n and mine in n]
            if not own:
                continue
            unit.unshard()
            # Unsharded params are swapped in only while unsharded: read them now.
            for n, p in own_params(unit):
                if "lora_" in n and mine in n:
                    out[peft_name(prefix + n)] = p.detach().to(device, dtype=dtype, copy=True)
            unit.reshard()
    return out


def adapter_bucketed(
    model, adapter: str, device: torch.device, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Adapter `adapter`'s LoRA tensors under PEFT names from one all-gather of its LoRA shards:
    every rank pads its dim-0 chunk to ceil(rows/world)."""
    world = dist.get_world_size()
    mine = f".{adapter}."
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad and mine in n]
    pieces, layout = [], []
    for name, p in params:
        rows = p.shape[0]
        chunk = math.ceil(rows / world)
        local = p.to_local() if isinstance(p, DTensor) else p
        local = (
            local.detach().reshape(local.shape[0], -1)
            if local.numel()
            else local.detach().new_zeros((0, int(math.prod(p.shape[1:]))))
        )
        padded = local.new_zeros((chunk, local.shape[1]))
        padded[: local.shape[0]] = local
        pieces.append(padded.reshape(-1).float())
        layout.append((name, tuple(p.shape), chunk))
    # On the compute device: with CPU offload the shards live in host memory, and NCCL
    # gathers device tensors only.
    flat = torch.cat(pieces).to(device)
    gathered = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
    dist.all_gather_into_tensor(gathered, flat)
    gathered = gathered.view(world, -1)
    out, offset = {}, 0
    for name, shape, chunk in layout:
        cols = int(math.prod(shape[1:]))
        width = chunk * cols
        # Un-pad and reshape where the gather landed: reassembling the strided blocks on the
        # CPU made this 6x slower than the layered gather on 2 x H200 at 7B
        # (bench/results/gpu_2026-11-30).
        block = gathered[:, offset : offset + width].reshape(world * chunk, cols)[: shape[0]]
        out[peft_name(name)] = block.reshape(shape).to(dtype=dtype, copy=True)
        offset += width
    return out


def base_stream(model, experts: dict, scale: float, merge: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Plain-HF-named base weights, one FSDP unit unsharded at a time; merged W + s BA (PEFT's
    adapter `default`: merged sync trains one) if asked."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    with torch.no_grad():
        for prefix, unit in fsdp_units(model):
            unit.unshard()
            own = dict(own_params(unit))
            for name, p in own.items():
                if "lora_" in name:
                    continue
                expert = _expert_wrapper_of(experts, prefix + name) if merge else None
                if merge and name.endswith(".base_layer.weight"):
                    stem = name[: -len(".base_layer.weight")]
                    a, b = own[f"{stem}.lora_A.default.weight"], own[f"{stem}.lora_B.default.weight"]
                    tensor = (p.float() + scale * (b.float() @ a.float())).to(p.dtype)
                elif expert is not None:
                    stem = expert.module[len(prefix) :]
                    a, b = own[f"{stem}.lora_A.default.weight"], own[f"{stem}.lora_B.default.weight"]
                    delta = expert_delta(a.float(), b.float(), expert.num_experts, scale)
                    tensor = (p.float() + delta).to(p.dtype)
                else:
                    # A copy on the trainer's device: the unsharded storage is freed at
                    # reshard while vLLM may still hold the tensor, and the colocated engine
                    # loads from the same device. Copying to the host made the 7B base
                    # stream take 10.8 s on 2 x H200 (bench/results/gpu_2026-11-30).
                    tensor = p.detach().clone()
                hf_name = _hf_name(prefix + name)
                yield hf_name, tensor
                if hf_name == "model.embed_tokens.weight" and tied:
                    # HF state dicts list a tied head under its own name too; vLLM's
                    # in-place reload only refreshes lm_head when it is sent. Its own copy:
                    # consumers that save the stream refuse tensors sharing memory.
                    yield "lm_head.weight", tensor.clone()
            unit.reshard()


def _expert_wrapper_of(experts: dict, param_name: str):
    """The PEFT wrapper over a stacked expert parameter (full name), or None."""
    stem, _, leaf = param_name.rpartition(".")
    for wrapper in experts.values():
        if wrapper.parameter == leaf and stem.startswith(wrapper.module + "."):
            return wrapper
    return None


def peft_name(param_name: str) -> str:
    """PEFT's saved adapter name: the adapter's name (`default`, or a group's own) is dropped."""
    return _ADAPTER_IN_NAME.sub(r".lora_\1.", param_name)


_ADAPTER_IN_NAME = re.compile(r"\.lora_(A|B)\.[^.]+\.")


def _hf_name(param_name: str) -> str:
    name = param_name[len(PEFT_PREFIX) :] if param_name.startswith(PEFT_PREFIX) else param_name
    # PEFT nests one wrapper per targeted parameter of a module (both expert stacks): one
    # `.base_layer` per level, adjacent, so a single replace would leave every second one.
    while ".base_layer." in name:
        name = name.replace(".base_layer.", ".")
    return name
