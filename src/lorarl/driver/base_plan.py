"""Whether the trainer shares vLLM's frozen base (backend.share_base: auto | true | false), decided
on the driver before any worker starts, and why.

The config alone rules some runs out, checked when the config is made
(lorarl.config.validate.base_not_shareable); here the reasons that need the device, the dtype vLLM
will hold the base in and the checkpoint (routed experts) are added, and for a data-parallel run
what each layout needs per GPU. The worker builds what the plan says: its vLLM engine keeps the
weights readable and the training model is bound to views of them (lorarl.rollout.vllm.base_views,
lorarl.engines.shared_base).
"""

from __future__ import annotations

from dataclasses import dataclass

from lorarl.config.validate import base_not_shareable, check_share_base
from lorarl.contract.specs import BasePlan


def _why_not_on(run, device_type: str | None, engine_dtype: str | None, moe: bool | None) -> str | None:
    """Why the base cannot be shared on this device, with this engine dtype and checkpoint, or None.
    Each check is skipped while what it needs is None (config time)."""
    b, r, m = run.backend, run.rollout, run.model
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
    why = base_not_shareable(run) or _why_not_on(run, device_type, engine_dtype, moe)
    if setting is False:
        return BasePlan(False, why or "backend.share_base=false")
    if why is not None:
        check_share_base(run, why)
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
