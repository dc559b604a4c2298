"""One copy of the frozen base per replica: the training model's base parameters are views of
the colocated vLLM engine's weight tensors (lorarl.rollout.vllm.base_views), the LoRA parameters
the trainer's own.

`plan_base` decides (backend.share_base: auto | true | false) and says why; `model_on_views`
builds the HF model with no weights of its own and binds the views. With the base shared the
trainer never loads it, never shards it (FSDP manages the LoRA parameters only, so no base
all-gather; lorarl.engines.fsdp_shard) and never sends it (no base payload: the engine loaded
it from disk, lorarl.sync.session refuses one); vLLM's sleep may release only its KV cache
(lorarl.rollout.vllm.engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lorarl.errors import ConfigError, ModelError


@dataclass(frozen=True)
class BasePlan:
    shared: bool
    reason: str

    def __str__(self) -> str:
        if self.shared:
            return f"base: one copy, the trainer's frozen weights are views of vLLM's ({self.reason})"
        return f"base: two copies, the trainer's and vLLM's ({self.reason})"


def _why_not(run, device_type: str | None, engine_dtype: str | None, moe: bool | None) -> str | None:
    """Why the base cannot be shared in this run, or None. Checks needing the device, the
    engine's resolved dtype or the checkpoint are skipped while those are None (config time)."""
    from lorarl.config.backends import FSDPBackendConfig

    b, r, m = run.backend, run.rollout, run.model
    if run.trainer.placement == "split":
        return "trainer.placement=split puts vLLM on devices of its own, so the trainer cannot view its weights"
    if not isinstance(b, FSDPBackendConfig):
        return "the Megatron backend holds its own copy"
    if m.lora.merge:
        return "model.lora.merge=true writes merged weights into vLLM's base every step"
    if r.tensor_model_parallel_size > 1:
        return f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} splits vLLM's weights over ranks"
    if r.load_format == "dummy":
        return "rollout.load_format=dummy starts vLLM without the base, which the trainer then sends"
    if b.param_offload:
        return "backend.param_offload=true keeps the trainer's sharded base in host memory"
    if device_type == "cuda" and b.mixed_precision != m.dtype:
        return (
            f"backend.mixed_precision={b.mixed_precision} computes the base in another dtype than model.dtype={m.dtype}"
        )
    if engine_dtype is not None and engine_dtype != m.dtype:
        return (
            f"vLLM holds the base in {engine_dtype} (rollout.dtype={r.dtype}) and the trainer in model.dtype={m.dtype}"
        )
    if moe and device_type == "cpu":
        return "vLLM's CPU build re-packs fused-MoE expert weights into its own layout"
    return None


@dataclass(frozen=True)
class LayoutBytes:
    """Per-GPU bytes of the weights and the LoRA training state in the two layouts a data-parallel
    run of `world_size` can take. FSDP shards the LoRA factors, gradients and AdamW state in both;
    the shared layout holds one copy of the base per GPU (vLLM's), the other holds vLLM's copy plus
    FSDP's 1/N shard of the trainer's. Sharing therefore always needs less, by that shard."""

    world_size: int
    weight_bytes: int
    lora_params: int

    @property
    def lora_state(self) -> int:
        return 16 * self.lora_params // self.world_size  # fp32 factors, gradients, AdamW's two moments

    @property
    def shared(self) -> int:
        return self.weight_bytes + self.lora_state

    @property
    def sharded(self) -> int:
        return self.weight_bytes + self.weight_bytes // self.world_size + self.lora_state

    def __str__(self) -> str:
        gib = 1 << 30
        return (
            f"weights and LoRA state per GPU: ~{self.shared / gib:.2f} GiB shared, against "
            f"~{self.sharded / gib:.2f} GiB with FSDP sharding a second copy over {self.world_size}"
        )


def plan_base(
    run, device_type: str | None = None, engine_dtype: str | None = None, moe: bool | None = None
) -> BasePlan:
    """Whether the trainer shares vLLM's base. `true` where it cannot apply is a ConfigError
    naming the key; `auto` there falls back to two copies and the plan says why."""
    setting = getattr(run.backend, "share_base", False)
    why = _why_not(run, device_type, engine_dtype, moe)
    if setting is False:
        return BasePlan(False, why or "backend.share_base=false")
    if why is not None:
        if setting is True:
            raise ConfigError(f"backend.share_base=true cannot apply: {why}; set backend.share_base=auto or false")
        return BasePlan(False, f"{why}; backend.share_base=auto")
    return BasePlan(True, f"backend.share_base={'true' if setting is True else 'auto'}")


def layout_bytes(run, config) -> LayoutBytes:
    """LayoutBytes of `run`: the checkpoint's safetensors bytes, and the LoRA parameters PEFT
    adds to the model of `config` (counted on a model with no storage, so any architecture and
    any target_parameters are counted as the trainer will build them)."""
    from pathlib import Path

    from accelerate import init_empty_weights
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from lorarl.files.peft_io import peft_lora_config

    m = run.model
    weight_bytes = sum(f.stat().st_size for f in Path(m.path).glob("*.safetensors"))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=m.trust_remote_code)
    peft_model = get_peft_model(model, peft_lora_config(m.lora))
    lora = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    return LayoutBytes(run.world_size, weight_bytes, lora)


def model_on_views(model_path: str, dtype: torch.dtype, views: dict[str, torch.Tensor], trust_remote_code: bool):
    """The HF causal LM of `model_path` with every parameter bound to `views[name]` (frozen, the
    same storage) and no weights loaded or allocated; its buffers (rotary tables) are computed
    from the config and placed beside the views. A parameter without a view, or a view of
    another shape or dtype, is a ModelError naming it: a wrong binding must never train."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
        )
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    head = model.get_output_embeddings().weight if tied else None  # tied to the input embedding below
    device = None
    for name, meta in list(model.named_parameters()):
        if meta is head:
            continue
        view = views.get(name)
        if view is None:
            raise ModelError(f"vLLM's engine holds no tensor for {name}; set backend.share_base=false")
        if tuple(view.shape) != tuple(meta.shape) or view.dtype != meta.dtype:
            raise ModelError(
                f"vLLM's tensor for {name} is {tuple(view.shape)} {view.dtype}, the model needs "
                f"{tuple(meta.shape)} {meta.dtype}; set backend.share_base=false"
            )
        bind(model, name, view)
        device = view.device
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    for module in model.modules():
        for key, buf in module.named_buffers(recurse=False):
            module._buffers[key] = buf.to(device)
    return model


def bind(model: torch.nn.Module, name: str, view: torch.Tensor) -> None:
    """Make parameter `name` of `model` a frozen Parameter over `view`'s storage (no copy)."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    module._parameters[leaf] = torch.nn.Parameter(view, requires_grad=False)


def frozen_params(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    """The parameters that do not train (the shared base), for FSDP to leave alone."""
    return {p for p in model.parameters() if not p.requires_grad}


def plan_for_run(run, device_type: str, config=None) -> BasePlan:
    """plan_base with what the driver knows before any worker starts: the device type, the dtype
    vLLM will hold the base in, and whether the checkpoint has routed experts (from `config`, its
    transformers config, read when not given)."""
    from lorarl.rollout.vllm.dtype import engine_dtype

    m, r = run.model, run.rollout
    if m.lora.merge or not hasattr(run.backend, "share_base"):
        return plan_base(run, device_type)  # two copies whatever the checkpoint
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(m.path, trust_remote_code=m.trust_remote_code)
    dtype = engine_dtype(m.path, r.dtype, device_type != "cuda", lora=True)
    if dtype == "auto":  # vLLM serves a 16-bit checkpoint in its own dtype (float32 is resolved above)
        saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = str(saved).removeprefix("torch.") if saved is not None else "unknown"
    moe = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0) > 0
    plan = plan_base(run, device_type, dtype, moe)
    if plan.shared and run.world_size > 1:  # data parallel: what each layout needs per GPU, said once
        return BasePlan(True, f"{layout_bytes(run, config)}; {plan.reason}")
    return plan
