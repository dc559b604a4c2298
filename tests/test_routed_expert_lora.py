"""backend.routed_expert_lora on real PEFT and real tensors: expert LoRA applied to the routed
tokens computes what PEFT's fold into the expert stacks computes, forward and backward.

The expected side is PEFT's own forward (W + s B A folded into every stack by its
parametrization) on the same model; the routed one must give the same logits and the same
gradients for every LoRA factor and for the input embeddings, in float64. The same comparison
sees a gate/up swap and a permutation of two experts' factors. The grouped-GEMM path CUDA takes
is compared with this per-expert one in tests/gpu/test_moe_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from lorarl.engines.routed_expert_lora import route_expert_lora, routed_experts
from lorarl.sync.experts import expert_factors
from tests.test_moe_lora import lora_moe, small_moe


def logits_and_grads(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds).logits
    (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), {**grads, "inputs_embeds": embeds.grad}


@pytest.fixture(scope="module")
def model_and_ids():
    base = small_moe().double()
    base.config._experts_implementation = "eager"  # transformers' per-expert loop: grouped_mm has no float64
    model = lora_moe(base, rank=3, alpha=5, seed=0)
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(1))
    return model, ids


def test_routed_forward_and_gradients_are_pefts(model_and_ids):
    model, ids = model_and_ids
    want_logits, want_grads = logits_and_grads(model, ids)
    with model.disable_adapter():
        base_logits = model(input_ids=ids).logits.detach()
    assert route_expert_lora(model) == 2  # one experts module (two nested wrappers) per layer
    got_logits, got_grads = logits_and_grads(model, ids)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-10, atol=1e-10)
    assert sorted(got_grads) == sorted(want_grads) and any("experts" in n for n in got_grads)
    for name, want in want_grads.items():
        assert want.abs().max() > 0, name  # every factor moves the loss: a zero gradient would pass anything
        torch.testing.assert_close(got_grads[name], want, rtol=1e-9, atol=1e-12, msg=name)
    # The experts' own stacks stay frozen: no gradient reaches them.
    assert all(p.grad is None for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj")))
    # Without the adapter (the reference pass) PEFT's own forward runs: the base model's logits.
    with model.disable_adapter():
        torch.testing.assert_close(model(input_ids=ids).logits, base_logits, rtol=0, atol=0)


@pytest.mark.parametrize("fault", ["gate_up_swap", "expert_permutation"])
def test_the_comparison_sees_a_misplaced_factor(model_and_ids, fault):
    """The routed experts of layer 0 with one fault in their LoRA factors differ from PEFT's."""
    model, ids = model_and_ids
    peft_experts = model.get_submodule("base_model.model.model.layers.0.mlp.experts")
    experts = peft_experts.base_layer.base_layer
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(9, experts.gate_up_proj.shape[-1], generator=gen, dtype=torch.float64)
    index = torch.stack([torch.randperm(experts.num_experts, generator=gen)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        want = type(peft_experts).forward(peft_experts, hidden, index, weights)
        lora = {}
        for w in (peft_experts, peft_experts.base_layer):
            a, b = expert_factors(w.lora_A["default"].weight, w.lora_B["default"].weight, w.num_experts)
            lora[w.parameter_name] = (a, b, w.scaling["default"])
        torch.testing.assert_close(routed_experts(experts, hidden, index, weights, lora), want)
        a, b, s = lora["gate_up_proj"]
        half = b.shape[1] // 2
        if fault == "gate_up_swap":
            b = torch.cat([b[:, half:], b[:, :half]], dim=1)
        else:
            a, b = a[[1, 0, *range(2, a.shape[0])]], b[[1, 0, *range(2, b.shape[0])]]
        got = routed_experts(experts, hidden, index, weights, {**lora, "gate_up_proj": (a, b, s)})
    assert not torch.allclose(got, want, rtol=1e-6, atol=1e-8)


def test_the_fsdp_engine_routes_expert_lora_when_asked(lorarl_cache):
    from lorarl.config.compose import compose
    from lorarl.driver.prepare import engine_spec
    from lorarl.engines.fsdp import load_lora_model
    from lorarl.models.tiny import default_tiny_model_path, ensure_tiny_model

    tiny_moe_path = ensure_tiny_model(default_tiny_model_path(arch="qwen3_moe"), arch="qwen3_moe")

    def routed(flag: bool) -> int:
        run = compose(["+backend=fsdp", "model=qwen3_moe_tiny", f"model.path={tiny_moe_path}", "trainer.device=cpu",
                       f"backend.routed_expert_lora={str(flag).lower()}"])  # fmt: skip
        model = load_lora_model(engine_spec(run, "cpu"))
        return sum("forward" in vars(m) for m in model.modules() if type(m).__name__ == "ParamWrapper")

    assert routed(False) == 0 and routed(True) == 2
