"""lorarl.engines.lora_linear against PEFT's LoRA Linear on real PEFT modules (the engine-level
checks, under FSDP2 and mixed precision, are in tests/distributed/fsdp_variants_check.py and
fsdp_mixed_precision_check.py)."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model

from lorarl.engines.lora_linear import fuse_lora_linears


def test_fused_linears_compute_peft_and_leave_what_they_cannot_fuse_to_peft():
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.Tanh(), torch.nn.Linear(20, 6, bias=False))
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, target_modules=["0", "2"]))
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    fused = copy.deepcopy(peft)
    assert fuse_lora_linears(fused) == 2
    x = torch.randn(3, 5, 12, dtype=torch.float64)
    peft, fused = peft.double(), fused.double()
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [peft(xs[0]), fused(xs[1])]
    assert type(outs[1].grad_fn).__name__ == "LoRALinearBackward"
    for out in outs:
        out.square().sum().backward()
    torch.testing.assert_close(outs[1], outs[0])
    torch.testing.assert_close(xs[1].grad, xs[0].grad)
    for (name, p), q in zip(peft.named_parameters(), fused.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, msg=name)
    with fused.disable_adapter():  # the reference pass: PEFT's own forward, base only
        assert type(fused(x).grad_fn).__name__ != "LoRALinearBackward"
        with peft.disable_adapter():
            torch.testing.assert_close(fused(x), peft(x))
    dropout = get_peft_model(
        torch.nn.Sequential(torch.nn.Linear(12, 6)), LoraConfig(r=4, lora_dropout=0.1, target_modules=["0"])
    )
    fuse_lora_linears(dropout)
    assert type(dropout(x.float()).grad_fn).__name__ != "LoRALinearBackward"  # PEFT applies the dropout
