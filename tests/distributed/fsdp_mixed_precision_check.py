"""Under torchrun (gloo): a bf16 base with float32 LoRA, sharded by the engine's `shard` with the
GPU's mixed-precision policy, whose first forward is the reference pass (adapter off), must
still get float32 LoRA gradients from the first training backward.

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


def main() -> None:
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
    model.config.use_cache = False
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"]))
    for p in peft_model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
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
    print(f"OK: {len(grads)} LoRA gradients in float32")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
