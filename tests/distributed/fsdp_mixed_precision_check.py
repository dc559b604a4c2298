"""Under torchrun (gloo): a bf16 base with float32 LoRA, sharded by the engine's `shard` with the
GPU's mixed-precision policy, whose first forward is the reference pass (adapter off), must
still get float32 LoRA gradients from the first training backward; with PEFT's LoRA linears and
with lorarl's fused ones (backend.fused_lora, computing in the gathered bf16 weights as on GPU),
which must give the same gradients up to bf16 rounding.

    torchrun --standalone --nproc_per_node=1 tests/distributed/fsdp_mixed_precision_check.py MODEL_DIR
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import AutoModelForCausalLM

from lorarl.engines.fsdp_shard import shard
from lorarl.engines.lora_linear import fuse_lora_linears


def lora_gradients(model_dir: str, fused: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.config.use_cache = False
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"]))
    for p in peft_model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
            torch.nn.init.normal_(p, std=0.05)  # B is zero at init: give both paths real gradients
    if fused:
        assert fuse_lora_linears(peft_model) > 0
    mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard(peft_model, mesh, torch.device("cpu"), mp_policy=mp)
    ids = torch.randint(3, 40, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), peft_model.disable_adapter():  # the reference pass, first
        peft_model(input_ids=ids, use_cache=False)
    peft_model.train()
    peft_model(input_ids=ids, use_cache=False).logits.float().square().mean().backward()
    grads = [p.grad for p in peft_model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads), {
        None if g is None else g.dtype for g in grads
    }
    return [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]


def main() -> None:
    dist.init_process_group("gloo")
    peft_grads = lora_gradients(sys.argv[1], fused=False)
    fused_grads = lora_gradients(sys.argv[1], fused=True)
    for a, b in zip(peft_grads, fused_grads, strict=True):
        torch.testing.assert_close(b, a, rtol=0.02, atol=0.02 * float(a.abs().max()))
    print(f"OK: {len(peft_grads)} LoRA gradients in float32, PEFT's and the fused linears' alike")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
