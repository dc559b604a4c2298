"""Functions that run inside vLLM's worker, handed to it through `collective_rpc`.

They read or change vLLM internals (its LoRA manager, model runner, layerwise reload), which
differ between vLLM versions: each one supports 0.26 (GPU builds) and 0.32 (CPU build) or fails
with a SyncError saying what is missing and what to use instead. Every function takes vLLM's
worker as its first argument, as collective_rpc passes it.
"""

from __future__ import annotations

import functools

from torch import Tensor

from lorarl.errors import SyncError
from lorarl.sync.experts import check_engine_reads_per_expert
from lorarl.sync.fingerprint import fingerprint_sums_many, resolve
from lorarl.sync.transport import AdapterLayout, peft_scaling


def vllm_worker(worker):
    """collective_rpc hands functions vLLM's worker, sometimes inside a wrapper; the worker."""
    return getattr(worker, "worker", worker)


def _lora_adapters(worker):
    """vLLM's LoRA model manager (the object that owns the adapter slots)."""
    manager = getattr(vllm_worker(worker).model_runner, "lora_manager", None)
    adapters = getattr(manager, "_adapter_manager", None)
    if adapters is None:
        raise SyncError("this vLLM's model runner has no LoRA manager; was the engine started with LoRA?")
    return manager, adapters


def wrapped_param_names(worker) -> list[str]:
    """Live names under `.base_layer` whose LoRA wrapper cannot take the plain HF name.

    vLLM 0.26 (GPU) wrappers have no loader of their own, so `q_proj.weight` must arrive as
    `q_proj.base_layer.weight`; vLLM 0.32's wrappers define `load_weights` and forward to the
    wrapped layer, so plain names are right there and `.base_layer` ones fail."""
    model = vllm_worker(worker).model_runner.get_model()
    out = []
    for module_name, module in model.named_modules():
        base = getattr(module, "_modules", {}).get("base_layer")
        if (
            base is None
            or "load_weights" in type(module).__dict__
            or any("load_weights" in c.__dict__ for c in type(module).__mro__[1:] if c.__name__.endswith("WithLoRA"))
        ):
            continue
        out += [f"{module_name}.base_layer.{n}" for n, _ in base.named_parameters(recurse=False)]
    return out


def param_names(worker) -> list[str]:
    """Every parameter of the served model, `.base_layer` removed (the names a base payload covers)."""
    model = vllm_worker(worker).model_runner.get_model()
    return [_served(name) for name, _ in model.named_parameters()]


def _served(name: str) -> str:
    """A live parameter name without LoRA's `.base_layer` and FusedMoE's `.routed_experts`
    levels (present or not depending on the vLLM version and whether LoRA is on)."""
    return name.replace(".base_layer.", ".").replace(".routed_experts.", ".")


def _cpu_prepacked_experts(model):
    """(name, layer, experts kernel) of every fused-MoE layer vLLM's CPU build keeps prepacked."""
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__name__ == "CPUUnquantizedExperts":
            yield name, module, experts


def prepack_cpu_experts(worker) -> int:
    """vLLM 0.32's CPU build re-lays fused-MoE expert weights for its grouped GEMM (in place, same
    shape) at the first load only: on a weight update its unquantized MoE method skips that step
    (`is_weight_update`), so after reload_weights the kernel reads raw weights as packed ones and
    the MoE layers compute garbage (measured: reloading the unchanged tiny MoE moved its log-probs
    by up to 1.0). Re-run the kernel's own step; returns how many layers it repacked."""
    model = vllm_worker(worker).model_runner.get_model()
    layers = list(_cpu_prepacked_experts(model))
    for _, layer, experts in layers:
        experts.process_weights_after_loading(layer)
    return len(layers)


def forget_lora_mapping(worker) -> None:
    """Drop the LoRA manager's memory of the last batch mapping."""
    _, adapters = _lora_adapters(worker)
    if not hasattr(adapters, "_last_mapping"):
        raise SyncError(
            "this vLLM's LoRA manager has no _last_mapping; lorarl cannot make it refresh its LoRA indices after a sleep"
        )
    adapters._last_mapping = None


def finish_interrupted_reload(worker) -> None:
    """After reload_weights raised part-way: close vLLM's half-done layerwise reload (0.32)."""
    try:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload
    except ImportError:
        return  # vLLM without layerwise reload has no half-done state to close
    worker = vllm_worker(worker)
    runner = worker.model_runner
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(runner.get_model(), runner.model_config)


def lora_name_mapper(mapper):
    """The model's HF->vLLM name mapper as vLLM's own adapter loader uses it: renames kept,
    fused-projection maps dropped (so `q_proj` survives for the LoRA manager to pack).
    vLLM 0.32 calls that variant get_rename_mapper, 0.26 get_unstacked_mapper."""
    if mapper is None:
        return None
    for variant in ("get_rename_mapper", "get_unstacked_mapper"):
        if hasattr(mapper, variant):
            return getattr(mapper, variant)()
    raise SyncError(
        f"this vLLM's {type(mapper).__name__} has neither get_rename_mapper nor get_unstacked_mapper; "
        "use rollout.adapter_transport=tmpfs"
    )


def add_adapter_from_tensors(worker, lora_id: int, tensors: dict[str, Tensor], config: dict) -> None:
    """vLLM's adapter loading minus the directory read.

    Mirrors LRUCacheWorkerLoRAManager._load_adapter + add_adapter (vLLM 0.26 and 0.32);
    these are internals, so a vLLM upgrade may need this revisited (tmpfs needs none).
    """
    from vllm.lora.peft_helper import PEFTHelper

    try:
        from vllm.lora.lora_model import LoRAModel
    except ImportError:  # vLLM 0.26 keeps it in vllm.lora.models
        from vllm.lora.models import LoRAModel

    manager, adapters = _lora_adapters(worker)
    if any(".experts." in name for name in tensors):
        check_engine_reads_per_expert(*expert_lora_layout(worker))
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = adapters.model
    mapper = lora_name_mapper(getattr(model, "hf_to_vllm_mapper", None))
    # Where the tensors already are: vLLM's own loader reads into host memory, but tensors
    # handed over on the GPU are packed and scaled there and copied into the stacks device
    # to device (vLLM pins host copies, which alone cost more than the whole GPU path).
    devices = {t.device for t in tensors.values()}
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id,
        tensors=tensors,
        peft_helper=helper,
        device=str(devices.pop()) if len(devices) == 1 else "cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    adapters.remove_adapter(lora_id)
    adapters.add_adapter(lora)
    adapters.activate_adapter(lora_id)


def expert_lora_layout(worker) -> tuple[list[str] | None, bool]:
    """How the live engine reads expert LoRA: its per-expert sub-module names
    (`packed_modules_mapping["experts"]`, None when it has none) and whether it wants stacked 3-D
    tensors instead (vLLM's `is_3d_moe_weight` models)."""
    _, adapters = _lora_adapters(worker)
    names = getattr(adapters, "packed_modules_mapping", {}).get("experts")
    return (list(names) if names is not None else None), bool(getattr(adapters, "_is_3d_moe_model", False))


def adapter_layout(worker) -> AdapterLayout:
    """vLLM's LoRA dtype, its scaling rule and its PEFT-name -> module-name parser, as its
    loader applies them (in-process engines only: the result holds functions)."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    manager, adapters = _lora_adapters(worker)
    mapper = lora_name_mapper(getattr(adapters.model, "hf_to_vllm_mapper", None))

    # The same names are parsed at every sync by both checks (tens of thousands of expert
    # projections on a MoE model); the parser is pure, so each name is parsed once.
    @functools.cache
    def module_of(name: str) -> tuple[str, bool]:
        try:
            module, is_a = parse_fine_tuned_lora_name(name, mapper)[:2]
        except TypeError as exc:  # a vLLM whose parser takes no name mapper
            raise SyncError(
                f"this vLLM's parse_fine_tuned_lora_name does not take a weights mapper ({exc}); lorarl cannot map "
                "adapter names to its LoRA modules (trainer.check_sync=false turns the sync checks off)"
            ) from None
        return module, is_a

    def scaling_of(config: dict, peft_module: str) -> float:
        helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        if hasattr(helper, "get_rank_and_scaling"):  # 0.32: rank/alpha patterns per module
            return helper.get_rank_and_scaling(peft_module)[1]
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            return peft_scaling(config, peft_module)
        return helper.vllm_lora_scaling_factor

    return AdapterLayout(manager.lora_config.lora_dtype, module_of, scaling_of)


def model_dtype(worker):
    """The dtype vLLM computes in (what a base payload is cast to when loaded)."""
    return vllm_worker(worker).model_runner.model_config.dtype


def weight_fingerprints(worker, numels: dict[str, int]) -> dict[str, tuple]:
    """(fingerprint, dtype) of the first `numels[name]` elements of each named parameter vLLM
    serves (`.base_layer` removed); the prefix skips any padding vLLM adds (vocab rows).
    Parameters vLLM no longer keeps readable (the CPU build repacks linear weights into its
    GEMM library's layout and leaves an empty tensor) come back as None."""
    model = vllm_worker(worker).model_runner.get_model()
    out: dict[str, tuple | None] = {}
    # The CPU build's prepacked expert stacks hold another layout than the one sent: unreadable.
    packed = {
        _served(f"{name}.{p}.") for name, _, _ in _cpu_prepacked_experts(model) for p in ("w13_weight", "w2_weight")
    }
    readable: list[tuple[str, str]] = []
    held: list[Tensor] = []
    for name, param in model.named_parameters():
        name = _served(name)
        if name not in numels:
            continue
        flat = param.detach().reshape(-1)
        if flat.numel() < numels[name] or f"{name}." in packed:
            out[name] = None
            continue
        readable.append((name, str(param.dtype)))
        held.append(flat[: numels[name]])
    out.update({name: (fp, dtype) for (name, dtype), fp in zip(readable, resolve(fingerprint_sums_many(held)))})
    return out
