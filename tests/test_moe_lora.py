"""Qwen3-MoE with LoRA on the fused experts, on real tensors, real PEFT and the real vLLM CPU build.

The export is checked three ways: its per-expert factors reproduce PEFT's own expert deltas
(and the merged weights give the adapted model's logits); vLLM's live engine loads it into the
slots it names for every expert, matched bit for bit by the fingerprint, which fails when one
expert's LoRA is corrupted. The tiny MoE trains end to end with merged sync in
tests/test_token_share_e2e.py (the CPU build cannot generate with a MoE model once LoRA is
enabled, which the rollout refuses in one line).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lorarl.contract.payload import WeightPayload
from lorarl.errors import ConfigError, SyncError
from lorarl.sync import transport
from lorarl.sync.experts import (
    QWEN3_MOE_EXPERT_PARAMETERS,
    check_engine_reads_per_expert,
    check_target_parameters,
    expert_delta,
    expert_wrappers,
    is_moe_checkpoint,
    to_vllm_layout,
)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="session")
def tiny_moe_path(lorarl_cache: Path) -> Path:
    from lorarl.models.tiny import default_tiny_model_path, ensure_tiny_model

    return ensure_tiny_model(default_tiny_model_path(arch="qwen3_moe"), arch="qwen3_moe")


def lora_moe(base, rank: int, alpha: int, seed: int):
    """PEFT LoRA on attention + every expert, with random (non-zero) A and B."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=ATTENTION, target_parameters=list(QWEN3_MOE_EXPERT_PARAMETERS)
    )
    model = get_peft_model(base, config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def small_moe(intermediate: int = 48):
    """A random Qwen3-MoE whose shapes are all distinct (2I != H != I), so a transposed or
    swapped factor cannot pass by shape."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=40,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        moe_intermediate_size=intermediate,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        max_position_embeddings=64,
    )
    return Qwen3MoeForCausalLM(config).eval()


def test_per_expert_export_reproduces_peft_deltas_and_merged_logits():
    from peft import get_peft_model_state_dict

    model = lora_moe(small_moe(), rank=3, alpha=5, seed=0)
    wrappers = expert_wrappers(model)
    assert sorted(w.parameter for w in wrappers.values()) == ["down_proj", "down_proj", "gate_up_proj", "gate_up_proj"]
    exported = to_vllm_layout(get_peft_model_state_dict(model), wrappers)
    scaling = 5 / 3
    for wrapper in wrappers.values():
        peft_delta = model.get_submodule(wrapper.module).get_delta_weight("default")  # [E, out, in]
        stem = wrapper.module.removesuffix(".base_layer")
        projections = ["gate_proj", "up_proj"] if wrapper.parameter == "gate_up_proj" else ["down_proj"]
        for e in range(wrapper.num_experts):
            rebuilt = torch.cat(
                [
                    exported[f"{stem}.{e}.{p}.lora_B.weight"] @ exported[f"{stem}.{e}.{p}.lora_A.weight"]
                    for p in projections
                ]
            )
            torch.testing.assert_close(rebuilt * scaling, peft_delta[e], rtol=1e-5, atol=1e-6)
        sd = model.state_dict()
        a, b = sd[f"{wrapper.module}.lora_A.default.weight"], sd[f"{wrapper.module}.lora_B.default.weight"]
        torch.testing.assert_close(expert_delta(a, b, wrapper.num_experts, scaling), peft_delta)
    # Every attention tensor passes through; each expert projection has its own A and B.
    layers, experts = 2, 4
    assert len(exported) == layers * (len(ATTENTION) * 2 + experts * 3 * 2)
    assert exported["base_model.model.model.layers.1.mlp.experts.3.up_proj.lora_B.weight"].shape == (48, 3)
    assert exported["base_model.model.model.layers.1.mlp.experts.3.down_proj.lora_A.weight"].shape == (3, 48)

    # Merged weights (what merged sync pushes) give the adapted model's logits.
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        merged = small_moe()
        state = merged.state_dict()
        for wrapper in wrappers.values():
            a = model.state_dict()[f"{wrapper.module}.lora_A.default.weight"]
            b = model.state_dict()[f"{wrapper.module}.lora_B.default.weight"]
            name = wrapper.module.removeprefix("base_model.model.").removesuffix(".base_layer")
            state[f"{name}.{wrapper.parameter}"] += expert_delta(a, b, wrapper.num_experts, scaling)
        for name, module in model.named_modules():
            if name.endswith(tuple(ATTENTION)) and hasattr(module, "get_delta_weight"):
                state[name.removeprefix("base_model.model.") + ".weight"] += module.get_delta_weight("default")
        merged.load_state_dict(state)
        got = merged(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-4
    assert (want - small_moe()(input_ids=ids).logits).abs().max() > 1e-2  # the adapter does change them


@pytest.mark.parametrize(
    "target", ["mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight", "mlp.experts.w13"]
)
def test_unservable_expert_targets_are_refused_in_one_line(target):
    with pytest.raises(ConfigError) as err:
        check_target_parameters([target])
    assert target in str(err.value) and "\n" not in str(err.value)


def test_moe_presets_compose_and_the_router_as_a_target_module_is_refused():
    from lorarl.config.compose import compose

    for preset in ("qwen3_moe_tiny", "qwen3_30b_a3b"):
        lora = compose(["+backend=fsdp", f"model={preset}"]).model.lora
        assert list(lora.target_parameters) == list(QWEN3_MOE_EXPERT_PARAMETERS)
        assert list(lora.target_modules) == ATTENTION
    with pytest.raises(ConfigError, match="router"):
        compose(["+backend=fsdp", "model=qwen3_moe_tiny", "model.lora.target_modules=[q_proj,gate]"])


def test_an_engine_wanting_stacked_expert_lora_is_refused():
    check_engine_reads_per_expert(["experts.0.gate_proj", "experts.0.down_proj", "experts.0.up_proj"], is_3d=False)
    with pytest.raises(SyncError, match="3-D"):
        check_engine_reads_per_expert(None, is_3d=True)
    with pytest.raises(SyncError, match="experts.w1"):
        check_engine_reads_per_expert(["experts.w1", "experts.w2", "experts.w3"], is_3d=False)


def test_expert_adapter_loads_into_the_live_cpu_engine_exactly(tiny_moe_path: Path):
    """Rank 1: vLLM's own slots, names and shapes for every expert hold what the trainer sent."""
    from peft import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from lorarl.rollout.vllm import engine_args
    from lorarl.rollout.vllm.engine import VLLMRollout

    model = lora_moe(AutoModelForCausalLM.from_pretrained(tiny_moe_path), rank=1, alpha=3, seed=2)
    tensors = to_vllm_layout(get_peft_model_state_dict(model), expert_wrappers(model))
    config = {"r": 1, "lora_alpha": 3, "target_modules": ATTENTION + ["gate_proj", "up_proj", "down_proj"]}
    payload = WeightPayload.adapter(tensors, config)
    hf = json.loads((tiny_moe_path / "config.json").read_text())
    hidden, width, experts = hf["hidden_size"], hf["moe_intermediate_size"], hf["num_local_experts"]
    assert is_moe_checkpoint(tiny_moe_path)
    args = engine_args.build(tiny_moe_path, lora_rank=1, max_model_len=128, seed=0, on_cpu=True)
    with VLLMRollout(args, adapter_transport="memory") as rollout:
        rollout.apply(payload)
        held = rollout.held_adapter_sums().shapes  # slot name -> (A shape, B shape)
        for layer in range(hf["num_hidden_layers"]):
            for e in range(experts):
                stem = f"model.layers.{layer}.mlp.experts.{e}"
                assert held[f"{stem}.gate_proj"][0] == (1, hidden)
                assert held[f"{stem}.up_proj"][1] == (width, 1)
                assert held[f"{stem}.down_proj"] == ((1, width), (hidden, 1))
        # Every tensor the trainer sent names a slot vLLM holds, and all of them match exactly.
        layout = rollout.adapter_layout()
        assert {layout.module_of(name)[0] for name in tensors} <= set(held)
        assert transport.verify_adapter(rollout, payload) == 1.0

        # One expert's B corrupted in the payload: the fingerprint names that expert.
        bad = dict(tensors)
        key = "base_model.model.model.layers.1.mlp.experts.5.up_proj.lora_B.weight"
        bad[key] = bad[key].clone()
        bad[key][7, 0] += 1e-3
        with pytest.raises(SyncError, match=r"experts\.5\.up_proj"):
            transport.verify_adapter(rollout, WeightPayload.adapter(bad, config))

        # Experts sent one by one (as the Megatron export sends them) are written in place too.
        moved = WeightPayload.adapter({k: v * 2 for k, v in tensors.items()}, config)
        rollout.apply(moved)
        assert rollout._writes_in_place is True
        assert transport.verify_adapter(rollout, moved) == 1.0

        with pytest.raises(ConfigError, match="model.lora.merge=true") as err:
            rollout.sample([[1, 2, 3]], max_tokens=2)
        assert "\n" not in str(err.value)


def test_expert_stacks_are_written_in_place_exactly_as_vllms_loader_places_them(tiny_moe_path: Path, monkeypatch):
    """The payload keeps PEFT's stacks (two pairs per layer, not 6 x E); after vLLM's loader has
    placed one adapter, the next is written into its slots, and leaves what the loader leaves. A
    writer that exchanges gate and up in one layer fails its check against the loader, and the
    rollout keeps the loader."""
    from peft import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from lorarl.rollout.vllm import engine_args, lora_write
    from lorarl.rollout.vllm.engine import VLLMRollout

    base = AutoModelForCausalLM.from_pretrained(tiny_moe_path)
    model = lora_moe(base, rank=2, alpha=5, seed=3)
    wrappers = expert_wrappers(model)
    config = {
        "r": 2,
        "lora_alpha": 5,
        "target_modules": ATTENTION,
        "target_parameters": list(QWEN3_MOE_EXPERT_PARAMETERS),
    }

    def payload(seed: int) -> WeightPayload:
        gen = torch.Generator().manual_seed(seed)
        state = get_peft_model_state_dict(model)
        return WeightPayload.adapter(
            {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in state.items()}, config, wrappers
        )

    hf = json.loads((tiny_moe_path / "config.json").read_text())
    first, second, third = payload(1), payload(2), payload(3)
    assert len(first.tensors) == hf["num_hidden_layers"] * (2 * len(ATTENTION) + 4)
    args = engine_args.build(tiny_moe_path, lora_rank=2, max_model_len=128, seed=0, on_cpu=True)
    with VLLMRollout(args, adapter_transport="memory") as rollout:
        rollout.apply(first)
        assert rollout._writes_in_place is None  # the first adapter goes through vLLM's loader
        assert transport.verify_adapter(rollout, first) == 1.0
        rollout.apply(second)
        assert rollout._writes_in_place is True
        written = rollout.held_adapter_sums()
        assert transport.verify_adapter(rollout, second) == 1.0
        rollout.load_through_vllm(dict(second.tensors), second.adapter_config, wrappers)
        loaded = rollout.held_adapter_sums()
        assert loaded.names == written.names and torch.equal(loaded.sums, written.sums)

        real = lora_write.slot_sources

        def gate_up_exchanged(*a):
            sources = real(*a)
            gate, up = (f"model.layers.1.mlp.experts.0.{p}" for p in ("gate_proj", "up_proj"))
            sources[gate], sources[up] = sources[up], sources[gate]
            return sources

        monkeypatch.setattr(lora_write, "slot_sources", gate_up_exchanged)
        rollout._writes_in_place = None  # as in a new process
        rollout.apply(third)
        assert rollout._writes_in_place is False
        assert transport.verify_adapter(rollout, third) == 1.0
