"""Several adapters over one base on a GPU, bf16, at Qwen2.5-0.5B's widths: the grouped GEMMs
(lorarl.engines.adapter_routing) against each adapter alone through PEFT.

    pytest -m gpu tests/gpu/test_adapter_routing_gpu.py

A two-layer random Qwen2 with the 0.5B's hidden 896, 14 heads / 2 KV heads and FFN 4864, three
adapters of ranks 8, 16 and 64 on the seven projections, rows of the three mixed in one batch. The
grouped path adds in other orders than PEFT's per-adapter matmuls, so outputs and factor gradients
are compared by relative norm (bf16: 2e-2), as the routed expert LoRA's GPU test does; the rows
sent through another adapter must change their adapter effect (output minus the base's) by more
than half. CPU float32
and float64 equality: tests/test_adapter_routing.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu
RANKS = {"default": 8, "a1": 16, "a2": 64}
ROWS = {"default": 3, "a1": 2, "a2": 3}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _base():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=896, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
        num_hidden_layers=2, vocab_size=4096, max_position_embeddings=512,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_grouped_adapters_equal_each_adapter_alone_in_bf16():
    from peft import LoraConfig, get_peft_model

    from lorarl.engines.adapter_routing import AdapterRouter, Segments, route_adapters

    base = _base()
    routed = None
    for name, r in RANKS.items():
        cfg = LoraConfig(r=r, lora_alpha=32, target_modules=TARGETS)
        routed = get_peft_model(copy.deepcopy(base), cfg, adapter_name=name) if routed is None else routed
        if name != "default":
            routed.add_adapter(name, cfg)
    routed.base_model.set_adapter(list(RANKS))
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for n, p in routed.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.float32).to(p.dtype) * 0.02)
    router = AdapterRouter()
    route_adapters(routed, router)
    ids = torch.randint(3, 4096, (sum(ROWS.values()), 64), generator=gen, device="cuda")
    order = [i for i, name in enumerate(RANKS) for _ in range(ROWS[name])]
    segments = Segments.of(order, list(RANKS))
    with router.route(segments):
        out = routed(input_ids=ids).logits
        out.float().square().mean().backward()
    for name, start, stop in segments.spans():
        solo = get_peft_model(copy.deepcopy(base), LoraConfig(r=RANKS[name], lora_alpha=32, target_modules=TARGETS))
        state = {k.replace(f".{name}.", ".default."): v for k, v in routed.state_dict().items() if f".{name}." in k}
        solo.load_state_dict(state, strict=False)
        want = solo(input_ids=ids[start:stop]).logits
        assert _relative(out[start:stop], want) <= 2e-2, name
        (want.float().square().sum() / out.numel()).backward()
        grads = {k: p.grad for k, p in solo.named_parameters() if p.grad is not None}
        for k, p in routed.named_parameters():
            if f".{name}." in k and "lora_" in k:
                assert _relative(p.grad, grads[k.replace(f".{name}.", ".default.")]) <= 2e-2, k
    with torch.no_grad():
        with router.route(Segments(("a1", "default", "a2"), (0, 3, 5, 8))):
            swapped = routed(input_ids=ids).logits
        with routed.disable_adapter():
            plain = routed(input_ids=ids).logits
    # Rows 0-2 through a1's adapter instead of their own: their adapter effect is not the right one.
    assert _relative(swapped[:3] - plain[:3], out.detach()[:3] - plain[:3]) > 0.5
