"""Several adapters over one base, each row through its own (lorarl.engines.adapter_routing).

The expected side is each adapter alone: a separate PEFT model per adapter with the same factors,
fed only that adapter's rows, through PEFT's own forward. The routed model must give every row the
logits its adapter's solo model gives it, and every factor the gradient its solo model's loss
gives it. Real tiny Qwen2, real PEFT.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lorarl.engines.adapter_routing import AdapterRouter, Segments, route_adapters

ADAPTERS = {
    "default": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]),
    "a1": LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]),
    "a2": LoraConfig(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]),
}
ROWS = {"default": 3, "a1": 2, "a2": 2}


def _base(path, dtype):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def _randomize(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * 0.05)


def _models(path, dtype):
    """(the routed model with every adapter, one solo PEFT model per adapter with the same factors)."""
    routed = None
    for name, cfg in ADAPTERS.items():
        if routed is None:
            routed = get_peft_model(_base(path, dtype), copy.deepcopy(cfg), adapter_name=name)
        else:
            routed.add_adapter(name, copy.deepcopy(cfg))
    routed.base_model.set_adapter(list(ADAPTERS))  # every adapter trainable
    _randomize(routed, 0)
    solos = {}
    for name, cfg in ADAPTERS.items():
        solo = get_peft_model(_base(path, dtype), copy.deepcopy(cfg))
        state = {
            k.replace(f".{name}.", ".default."): v
            for k, v in routed.state_dict().items()
            if "lora_" in k and f".{name}." in k
        }
        missing = solo.load_state_dict(state, strict=False)
        assert not [k for k in missing.missing_keys if "lora_" in k]
        solos[name] = solo
    router = AdapterRouter()
    assert route_adapters(routed, router) > 0
    return routed, router, solos


def _inputs(vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (sum(ROWS.values()), 12), generator=gen)


def _row_loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1)[..., :50].sum()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)], ids=["float64", "float32"])
def test_each_row_trains_through_its_own_adapter_as_alone(tiny_model_path, dtype, tol):
    """float64 takes the per-segment matmuls (grouped_mm has no float64), float32 the grouped GEMMs."""
    routed, router, solos = _models(tiny_model_path, dtype)
    ids = _inputs(routed.config.vocab_size)
    order = [i for i, name in enumerate(ADAPTERS) for _ in range(ROWS[name])]
    segments = Segments.of(order, list(ADAPTERS))
    with router.route(segments):
        logits = routed(input_ids=ids).logits
    _row_loss(logits).backward()
    for name, start, stop in segments.spans():
        solo = solos[name]
        want = solo(input_ids=ids[start:stop]).logits
        assert (logits[start:stop] - want).abs().max() <= tol * want.abs().max(), name
        _row_loss(want).backward()
        grads = {k: p.grad for k, p in solo.named_parameters() if p.grad is not None}
        for k, p in routed.named_parameters():
            if f".{name}." not in k or "lora_" not in k:
                continue
            g = grads[k.replace(f".{name}.", ".default.")]
            assert p.grad is not None, k
            assert (p.grad - g).abs().max() <= tol * (g.abs().max() + 1e-12), k


def test_a_row_routed_to_the_wrong_adapter_is_seen(tiny_model_path):
    """The comparison above fails when two adapters' rows are exchanged."""
    routed, router, solos = _models(tiny_model_path, torch.float64)
    ids = _inputs(routed.config.vocab_size)[:4]
    swapped = Segments(("a1", "default"), (0, 2, 4))  # rows 0-1 belong to default, 2-3 to a1
    with router.route(swapped), torch.no_grad():
        logits = routed(input_ids=ids).logits
    want = solos["default"](input_ids=ids[:2]).logits
    assert (logits[:2] - want).abs().max() > 1e-3


def test_adapters_off_is_the_base_and_unrouted_is_peft(tiny_model_path):
    routed, router, _ = _models(tiny_model_path, torch.float64)
    ids = _inputs(routed.config.vocab_size)[:3]
    base = _base(tiny_model_path, torch.float64)
    with torch.no_grad():
        with router.route(Segments(("a1",), (0, 3))), routed.disable_adapter():
            off = routed(input_ids=ids).logits
        assert torch.equal(off, base(input_ids=ids).logits)


def test_segments_require_contiguous_rows():
    assert Segments.of([0, 0, 2, 1], ["x", "y", "z"]) == Segments(("x", "z", "y"), (0, 2, 3, 4))
    with pytest.raises(ValueError, match="not contiguous"):
        Segments.of([0, 1, 0], ["x", "y"])
