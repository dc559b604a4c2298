"""Qwen3-MoE on the Megatron backend, with real tensors: names, layouts, expert LoRA export.

As tests/test_megatron_names.py does for dense Qwen, rules that come from Megatron-Bridge run
its own released source (tests/megatron_source.py) against tests/megatron_moe_reference.py and
what lorarl ships; the HF side is a real transformers Qwen3-MoE, the vLLM side vLLM's own
expert mapping and LoRA name parser. The expert-parallel gather runs over two real gloo ranks.
"""

from __future__ import annotations

import ast
import types

import pytest
import torch
import torch.distributed as dist

from lorarl.config.backends import MegatronBackendConfig
from lorarl.engines.megatron import config_map as C
from lorarl.engines.megatron import experts as X
from lorarl.engines.megatron import names as N
from lorarl.errors import ConfigError, SyncError
from tests import megatron_moe_reference as M
from tests import megatron_reference as R
from tests.megatron_checks import backend_config, check_megatron, lora_config
from tests.megatron_source import Sources, literal, load_functions, sources_or_skip

E, H, I, RANK, ALPHA = 4, 32, 16, 4, 8.0  # noqa: E741 - I is Qwen3-MoE's moe_intermediate_size
SHAPE = R.AttentionShape(num_attention_heads=4, num_query_groups=2, head_dim=8)


@pytest.fixture(scope="module")
def src(request) -> Sources:
    return sources_or_skip(request)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _registry(src: Sources) -> dict[str, tuple[str, ...]]:
    """Megatron -> HF name patterns of Qwen3MoEBridge.mapping_registry in the released source."""
    tree = ast.parse((src.mb / "models/qwen/qwen3_moe_bridge.py").read_text())
    out: dict[str, tuple[str, ...]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "param_mappings" for t in node.targets
        ):
            out.update({k: (v,) for k, v in ast.literal_eval(node.value).items()})
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
            "QKVMapping",
            "GatedMLPMapping",
            "AutoMapping",
        ):
            if not all(isinstance(k.value, ast.Constant) for k in node.keywords):
                continue  # the loop that wraps param_mappings entries, read above
            kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            parts = {"QKVMapping": ("q", "k", "v"), "GatedMLPMapping": ("gate", "up"), "AutoMapping": ("hf_param",)}
            out[kw["megatron_param"]] = tuple(kw[p] for p in parts[node.func.id])
    return out


def _tiny_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=96, hidden_size=H, intermediate_size=48, moe_intermediate_size=I, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=E, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=True, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    return Qwen3MoeForCausalLM(cfg).eval()


# ---------------------------------------------------------------------------------------------
# base names and layouts
# ---------------------------------------------------------------------------------------------


def test_names_match_qwen3_moe_bridge_registry(src):
    registry = _registry(src)
    assert registry["decoder.layers.*.mlp.router.weight"] == ("model.layers.*.mlp.gate.weight",)
    checked = 0
    for mc_pattern, hf_pattern in registry.items():
        for layer, expert in ((0, 0), (5, 3)):
            if mc_pattern.endswith("weight*"):  # grouped experts: weight<expert>
                mc = mc_pattern.replace("*", str(layer), 1)[:-1] + str(expert)
            else:
                mc = mc_pattern.replace("*", str(layer), 1).replace("*", str(expert))
            expected = tuple(h.replace("*", str(layer), 1).replace("*", str(expert)) for h in hf_pattern)
            if "layer_norm_weight" in mc:  # TE fused norm name; the local spec's alias is tested below
                assert expected == (f"model.layers.{layer}.input_layernorm.weight",)
                mc = f"decoder.layers.{layer}.input_layernorm.weight"
            assert M.megatron_to_hf_names(mc) == expected, mc
            checked += 1
    assert checked == 2 * len(registry) == 2 * 14


def test_transformers_fuses_experts_in_memory_and_saves_them_per_expert(tmp_path):
    """The layout facts the reference and the per-expert export rely on, on the installed
    transformers: in memory gate_up_proj[e] = [gate_e; up_e], on disk experts.E.*_proj."""
    from safetensors.torch import load_file

    model = _tiny_moe()
    model.save_pretrained(str(tmp_path))
    disk = load_file(str(tmp_path / "model.safetensors"))
    assert disk["model.layers.1.mlp.experts.3.gate_proj.weight"].shape == (I, H)
    assert "model.layers.1.mlp.experts.gate_up_proj" not in disk
    memory = model.state_dict()
    assert memory["model.layers.1.mlp.experts.gate_up_proj"].shape == (E, 2 * I, H)
    fused = M.fuse_experts({k: v for k, v in disk.items()}, E)
    for k, v in memory.items():
        if k != "lm_head.weight":
            assert torch.equal(fused[k], v), k


@pytest.mark.parametrize("etp", [1, 2])
def test_state_round_trip_real_qwen3_moe(tmp_path, etp):
    from safetensors.torch import load_file

    _tiny_moe(1).save_pretrained(str(tmp_path))
    hf = load_file(str(tmp_path / "model.safetensors"))
    mc = M.hf_to_megatron_state(hf, SHAPE, etp)
    # per layer: qkv, proj, q/k norms, two norms, router, E x (fc1, fc2); then embedding, final norm
    assert len(mc) == 2 * (7 + 2 * E) + 2
    assert mc[M.expert_param(1, 3, "linear_fc1")].shape == (2 * I, H)
    back = M.megatron_to_hf_state(mc, SHAPE, etp)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


# ---------------------------------------------------------------------------------------------
# expert LoRA
# ---------------------------------------------------------------------------------------------


def _expert_fc1_lora(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.randn(RANK, H, generator=gen, dtype=torch.float64),
        torch.randn(2 * I, RANK, generator=gen, dtype=torch.float64),
    )


def _bridge_fc1_split(src: Sources, tp: int):
    ps = types.SimpleNamespace(get_tensor_model_parallel_world_size=lambda: tp)
    fn = load_functions(
        src.mb / "models/conversion/peft_bridge.py",
        ["_split_fused_fc1_linear_out_weight"],
        {"torch": torch, "parallel_state": ps},
        class_name="MegatronPeftBridge",
    )["_split_fused_fc1_linear_out_weight"]
    return lambda b: fn(None, b, is_expert=True)


def test_expert_lora_export_merges_like_megatron(src):
    """Per expert, the exported gate/up/down adapters merged into the HF weights equal the
    Megatron-side merge of the fused linear_fc1 / linear_fc2 adapters, converted back; the
    gate/up split is the bridge's own (expert path, ETP = 1)."""
    gen = _gen(3)
    split = _bridge_fc1_split(src, tp=4)  # attention TP does not matter for experts
    scale = ALPHA / RANK
    for expert in range(E):
        gate = torch.randn(I, H, generator=gen, dtype=torch.float64)
        up = torch.randn(I, H, generator=gen, dtype=torch.float64)
        down = torch.randn(H, I, generator=gen, dtype=torch.float64)
        a1, b1 = _expert_fc1_lora(gen)
        a2, b2 = (
            torch.randn(RANK, I, generator=gen, dtype=torch.float64),
            torch.randn(H, RANK, generator=gen, dtype=torch.float64),
        )
        peft = M.expert_lora_to_peft(0, expert, (a1, b1), (a2, b2))
        assert len(peft) == 6
        theirs = split(b1)
        assert torch.equal(peft[N.expert_lora_name(0, expert, "gate_proj", "B")], theirs[0])
        assert torch.equal(peft[N.expert_lora_name(0, expert, "up_proj", "B")], theirs[1])
        fc1 = R.merge_gate_up(gate, up) + scale * b1 @ a1
        fc2 = down + scale * b2 @ a2
        merged = M.megatron_to_hf_state(
            {M.expert_param(0, expert, "linear_fc1"): fc1, M.expert_param(0, expert, "linear_fc2"): fc2}, SHAPE
        )
        for proj, base in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            a = peft[N.expert_lora_name(0, expert, proj, "A")]
            b = peft[N.expert_lora_name(0, expert, proj, "B")]
            hf_name = f"model.layers.0.mlp.experts.{expert}.{proj}.weight"
            torch.testing.assert_close(base + scale * b @ a, merged[hf_name], rtol=0, atol=1e-10)


def test_bridge_expert_split_is_wrong_under_expert_tp(src):
    """Why backend.expert_tensor_parallel_size > 1 is refused: with ETP = 2 the gathered
    expert B is [g_0, u_0, g_1, u_1]; the bridge's expert path splits it as [g; u] and mixes
    gate rows into up. The reference split (per-rank rule) gets it right."""
    gate_b = torch.randn(I, RANK, generator=_gen(4))
    up_b = torch.randn(I, RANK, generator=_gen(5))
    gathered = R.merge_gate_up(gate_b, up_b, tp_size=2)
    theirs = _bridge_fc1_split(src, tp=2)(gathered)
    assert not torch.equal(theirs[0], gate_b) and not torch.equal(theirs[1], up_b)
    ours = R.split_gate_up(gathered, 2)
    assert torch.equal(ours[0], gate_b) and torch.equal(ours[1], up_b)
    with pytest.raises(ConfigError, match=r"backend\.expert_tensor_parallel_size=2: .* silently wrong") as e:
        check_megatron(lora_config(), _backend(expert_tensor_parallel_size=2), num_experts=128)
    assert "\n" not in str(e.value)


def _bridge_expert_adapter_names(src: Sources, layers: int) -> list[str]:
    """What export_adapter_weights names Qwen3-MoE expert adapters: its `_make_lora_param_name`
    over Qwen3MoEBridge's per-expert HF names (the local spec's SequentialMLP path)."""
    path = src.mb / "models/conversion/peft_bridge.py"
    make = load_functions(
        path,
        ["_make_lora_param_name"],
        {
            "MEGATRON_TO_HF_LORA_SUFFIX": literal(path, "MEGATRON_TO_HF_LORA_SUFFIX"),
            "Optional": __import__("typing").Optional,
        },
        class_name="MegatronPeftBridge",
    )["_make_lora_param_name"]
    registry = _registry(src)
    out = []
    for mc, hf in registry.items():
        if ".local_experts." not in mc:
            continue
        for layer in range(layers):
            for expert in range(E):
                for h in hf:
                    base = h.replace("*", str(layer), 1).replace("*", str(expert))
                    out += [make(None, base, ".linear_in.weight"), make(None, base, ".linear_out.weight")]
    return out


def test_expert_adapter_names_are_what_vllm_loads(src):
    """The bridge's expert adapter names -> lorarl's payload names -> vLLM's LoRA name parser
    gives modules whose `experts.E.<proj>` suffix is in vLLM's own Qwen3-MoE expert mapping
    (the 2D fused-MoE LoRA layout both vLLM 0.26 and 0.32 load)."""
    from vllm.lora.utils import parse_fine_tuned_lora_name
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    raw = _bridge_expert_adapter_names(src, layers=2)
    assert len(raw) == 2 * E * 3 * 2
    out = dict(N.normalize_adapter_names((n, torch.zeros(1)) for n in raw))
    expected = {
        w.rstrip(".")
        for _, w, _, _ in RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", E)
    }
    for name in out:
        layer, expert, proj, ab = N.parse_expert_lora_name(name)
        assert name == N.expert_lora_name(layer, expert, proj, ab)
        module, is_a = parse_fine_tuned_lora_name(name)
        assert module.split(".mlp.", 1)[1] in expected and is_a == (ab == "A")
    assert {N.parse_expert_lora_name(n)[1] for n in out} == set(range(E))


@pytest.mark.parametrize(
    "bad",
    [
        "model.layers.0.mlp.experts.1.gate_up_proj.lora_A.weight",  # fused name vLLM's 2D loader rejects
        "model.layers.0.mlp.experts.1.q_proj.lora_A.weight",
        "model.layers.0.mlp.gate.lora_A.weight",  # router
    ],
)
def test_normalize_rejects_bad_expert_names(bad):
    with pytest.raises(SyncError, match="adapter export yielded"):
        list(N.normalize_adapter_names([(bad, torch.zeros(1))]))


@pytest.mark.parametrize("bad", ["gate", "mlp.gate", "router", "shared_expert_gate"])
def test_router_targets_refused(bad):
    with pytest.raises(ConfigError, match="MoE router cannot carry LoRA") as e:
        N.resolve_lora_targets(["q_proj", bad])
    assert repr(bad) in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# expert parallelism
# ---------------------------------------------------------------------------------------------


def _full_expert_adapter(seed: int) -> dict[str, torch.Tensor]:
    gen = _gen(seed)
    out = {
        f"base_model.model.model.layers.{i}.self_attn.o_proj.lora_A.weight": torch.randn(RANK, H, generator=gen)
        for i in range(2)
    }
    for layer in range(2):
        for expert in range(E):
            a1, b1 = _expert_fc1_lora(gen)
            a2, b2 = torch.randn(RANK, I, generator=gen), torch.randn(H, RANK, generator=gen)
            out.update({k: v.float() for k, v in M.expert_lora_to_peft(layer, expert, (a1, b1), (a2, b2)).items()})
    return out


def _local_part(
    full: dict[str, torch.Tensor], ep: X.ExpertParallel, local_numbers: bool = False
) -> dict[str, torch.Tensor]:
    """This rank's experts, numbered as the bridge exports them (locally) or globally."""
    keep, start = set(ep.local_experts()), ep.local_experts().start
    out = {}
    for k, v in full.items():
        p = N.parse_expert_lora_name(k)
        if p is None:
            out[k] = v
        elif p[1] in keep:
            out[N.expert_lora_name(p[0], p[1] - start, p[2], p[3]) if local_numbers else k] = v
    return out


def _gather_worker(rank: int, world: int, init: str, seed: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        ep = X.ExpertParallel(E, world, rank)
        gather = X.torch_all_gather(dist.group.WORLD, world)
        full = _full_expert_adapter(seed)
        for numbering in ("local", "global"):
            got = X.gather_expert_adapter(_local_part(full, ep, numbering == "local"), ep, gather)
            torch.save(got, f"{out}.{numbering}.{rank}")
    finally:
        dist.destroy_process_group()


def test_expert_parallel_gather_over_two_gloo_ranks(tmp_path):
    """Each rank exports only its experts (the bridge's SequentialMLP path, numbered locally);
    after the gather both ranks hold the whole adapter, every tensor under its global number."""
    import torch.multiprocessing as mp

    full = _full_expert_adapter(seed=11)
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_gather_worker, args=(2, init, 11, str(tmp_path / "got")), nprocs=2, join=True)
    for numbering in ("local", "global"):
        for rank in range(2):
            got = torch.load(tmp_path / f"got.{numbering}.{rank}", weights_only=True)
            assert got.keys() == full.keys()
            for k in full:
                assert torch.equal(got[k], full[k]), (numbering, rank, k)


def test_bridge_numbers_expert_adapters_locally(src):
    """Megatron-Bridge's own `_megatron_local_name_to_global` at expert parallel 2, rank 1 of
    8 experts: a base expert weight gets its global number, the same expert's adapter keeps
    the local one (hence the renumbering in gather_expert_adapter)."""
    import re
    import typing

    group = types.SimpleNamespace(size=lambda: 2, rank=lambda: 1)
    fn = load_functions(
        src.mb / "models/conversion/model_bridge.py",
        ["_megatron_local_name_to_global"],
        {
            "re": re, "Optional": typing.Optional, "List": list, "MegatronModule": object,
            "TransformerConfig": object, "_get_pp_group": lambda models: types.SimpleNamespace(size=lambda: 1),
            "_get_ep_group": lambda models: group, "get_pg_size": lambda g: g.size(),
        },
    )["_megatron_local_name_to_global"]  # fmt: skip
    config = types.SimpleNamespace(num_moe_experts=8)
    base = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    adapter = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.adapter.linear_in.weight"
    assert fn([], config, base) == "decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight"
    assert fn([], config, adapter) == adapter


def test_gather_is_a_no_op_when_complete_and_refuses_partial_sets():
    full = _full_expert_adapter(seed=2)

    def never(_t):
        raise AssertionError("no collective expected")

    assert X.gather_expert_adapter(full, X.ExpertParallel(E, 2, 1), never).keys() == full.keys()
    wrong = _local_part(full, X.ExpertParallel(E, 4, 1))  # expert 1 alone, on rank 1 of 2
    with pytest.raises(SyncError, match=r"rank 1/2 holds experts 1\.\.1; expected all 4, or this rank's 2\.\.3"):
        X.gather_expert_adapter(wrong, X.ExpertParallel(E, 2, 1), never)


# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------


def _backend(**kw) -> MegatronBackendConfig:
    return backend_config(**kw)


MOE_30B = {
    "num_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 151936,
    "num_experts": 128,
}
MOE_235B = {
    "num_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "vocab_size": 151936,
    "num_experts": 128,
}


def test_provider_plan_sets_expert_parallel_and_local_moe_kernels_off(src):
    plan = C.provider_plan(_backend(expert_model_parallel_size=8), "bfloat16")
    assert plan.settings["expert_model_parallel_size"] == 8 and plan.settings["expert_tensor_parallel_size"] == 1
    assert plan.settings["moe_grouped_gemm"] is False and plan.settings["moe_permute_fusion"] is False
    assert plan.settings["moe_router_dtype"] == "fp32"
    fields = set(src.api(src.mb / "models/gpt_provider.py", "GPTModelProvider").fields)
    assert set(plan.settings) <= fields, set(plan.settings) - fields
    # Qwen3MoEBridge turns both kernels on; the local spec must turn them off again.
    text = (src.mb / "models/qwen/qwen3_moe_bridge.py").read_text()
    assert "provider.moe_grouped_gemm = True" in text and "provider.moe_permute_fusion = True" in text


@pytest.mark.parametrize(
    "backend_kw, lora_kw, model_kw, world, message",
    [
        (
            {"expert_model_parallel_size": 3},
            {},
            MOE_30B,
            3,
            r"expert_model_parallel_size=3 does not divide the model's 128 experts",
        ),
        (
            {"expert_model_parallel_size": 2},
            {},
            {"num_experts": 0},
            2,
            r"expert_model_parallel_size=2 needs a mixture-of-experts model",
        ),
        (
            {"tensor_model_parallel_size": 2},
            {},
            MOE_30B,
            2,
            r"tensor_model_parallel_size=2 on a mixture-of-experts model needs backend\.sequence_parallel=true",
        ),
        (
            {"expert_model_parallel_size": 8},
            {"merge": True},
            MOE_30B,
            8,
            r"model\.lora\.merge=true with backend\.expert_model_parallel_size=8",
        ),
        ({"expert_model_parallel_size": 8}, {}, MOE_30B, 4, r"= 8 must divide the 4 devices"),
        (
            {"expert_model_parallel_size": 0},
            {},
            MOE_30B,
            1,
            r"backend\.expert_model_parallel_size=0 must be an integer >= 1",
        ),
        (
            {"override_transformer_config": {"expert_tensor_parallel_size": 2}},
            {},
            MOE_30B,
            1,
            r"duplicates backend\.expert_tensor_parallel_size",
        ),
    ],
)
def test_check_megatron_rejects_moe_layouts(backend_kw, lora_kw, model_kw, world, message):
    with pytest.raises(ConfigError, match=message) as e:
        check_megatron(lora_config(**lora_kw), _backend(**backend_kw), world_size=world, **model_kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "preset, shape", [("qwen3_30b_a3b_gsm8k_megatron", MOE_30B), ("qwen3_235b_a22b_gsm8k_megatron", MOE_235B)]
)
def test_moe_megatron_presets_pass_every_check(preset, shape):
    """The experiment presets compose, validate, and pass the Megatron checks against the
    published Qwen3-MoE shapes (config.json on the hub) at their own device count."""
    from lorarl.config.compose import compose
    from lorarl.config.validate import check_model_shape

    run = compose([f"+experiment={preset}"])
    assert run.backend.strategy == "megatron" and run.backend.expert_tensor_parallel_size == 1
    assert run.backend.expert_model_parallel_size >= 8 and not run.model.lora.merge
    check_model_shape(
        run,
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        num_layers=shape["num_layers"],
        vocab_size=shape["vocab_size"],
        num_experts=shape["num_experts"],
    )
    targets = N.resolve_lora_targets(run.model.lora.target_modules, run.model.lora.type)
    assert {"linear_fc1", "linear_fc2"} <= set(targets.megatron)  # the experts carry LoRA


def test_expert_tp_refused_when_the_config_is_composed():
    """Refused before any GPU starts, naming the key."""
    from lorarl.config.compose import compose

    with pytest.raises(ConfigError, match=r"^backend\.expert_tensor_parallel_size=2: "):
        compose(["+backend=megatron", "backend.expert_tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"^model\.lora\.merge=true with backend\.expert_model_parallel_size=2"):
        compose(
            [
                "+backend=megatron",
                "backend.expert_model_parallel_size=2",
                "model.lora.merge=true",
                "trainer.n_gpus_per_node=2",
            ]
        )


def test_gpu_check_hand_merge_matches_per_expert_merge(tmp_path):
    """The GPU test's HF side merges the per-expert adapter into transformers' fused experts by
    hand; on a real tiny Qwen3-MoE that must give the logits of the model whose per-expert
    checkpoint weights were merged one by one (and differ from the base)."""
    from safetensors.torch import load_file

    from tests.gpu.test_megatron_moe_gpu import hand_merged_state

    model = _tiny_moe(2)  # float32: transformers' grouped expert matmul has no float64 kernel
    model.save_pretrained(str(tmp_path))
    disk = {k: v.double() for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    gen, scale = _gen(8), ALPHA / RANK
    adapter, per_expert = {}, dict(disk)
    for layer in range(2):
        for expert in range(E):
            fc1 = (
                torch.randn(RANK, H, generator=gen, dtype=torch.float64),
                torch.randn(2 * I, RANK, generator=gen, dtype=torch.float64),
            )
            fc2 = (
                torch.randn(RANK, I, generator=gen, dtype=torch.float64),
                torch.randn(H, RANK, generator=gen, dtype=torch.float64),
            )
            adapter.update(M.expert_lora_to_peft(layer, expert, fc1, fc2))
    for name, a in adapter.items():
        if name.endswith("lora_A.weight"):
            weight = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            per_expert[weight] = per_expert[weight] + scale * adapter[name.replace("lora_A", "lora_B")] @ a
    ids = torch.randint(0, 96, (2, 9), generator=gen)
    with torch.no_grad():
        base_logits = model(ids).logits
        model.load_state_dict({**model.state_dict(), **hand_merged_state(model.state_dict(), adapter, scale, I)})
        hand = model(ids).logits
        model.load_state_dict({**model.state_dict(), **M.fuse_experts(per_expert, E)})
        reference = model(ids).logits
    assert (hand - base_logits).abs().max() > 1e-2
    torch.testing.assert_close(hand, reference, rtol=0, atol=1e-6)


def test_bridge_adapter_export_of_experts_through_lorarl(src, tmp_path):
    """MegatronBridgeAdapter over an object with exactly AutoBridge's real methods, yielding the
    expert adapter as Megatron-Bridge does (its names; one A tensor object for an expert's
    gate and up): PEFT names out, every tensor its own copy (safetensors refuses shared
    storage), and the per-expert payload passes lorarl.sync's checks."""
    from safetensors.torch import save_file

    from lorarl.contract.payload import PayloadKind, WeightPayload
    from lorarl.engines.megatron.bridge import MegatronBridgeAdapter
    from lorarl.engines.megatron.config_map import peft_adapter_config
    from tests.megatron_source import spec_object

    raw = _bridge_expert_adapter_names(src, layers=1)
    shared_a = {}

    def export_adapter_weights(bound):
        for name in raw:
            layer, expert, proj, ab = N.parse_expert_lora_name(name)
            if ab == "A" and proj != "down_proj":  # fused linear_fc1: one A for gate and up
                yield name, shared_a.setdefault((layer, expert), torch.randn(RANK, H))
            else:
                yield (
                    name,
                    torch.randn(RANK, I if proj == "down_proj" else H)
                    if ab == "A"
                    else torch.randn(H if proj == "down_proj" else I, RANK),
                )

    api = src.api(src.mb / "models/conversion/auto_bridge.py", "AutoBridge")
    adapter = MegatronBridgeAdapter(spec_object(api, {"export_adapter_weights": export_adapter_weights}, []))
    out = dict(adapter.export_adapter(["model"]))
    assert len(out) == E * 6 and all(k.startswith("base_model.model.model.layers.0.mlp.experts.") for k in out)
    gate_a, up_a = (out[N.expert_lora_name(0, 2, p, "A")] for p in ("gate_proj", "up_proj"))
    assert torch.equal(gate_a, up_a) and gate_a.data_ptr() != up_a.data_ptr()
    save_file(out, str(tmp_path / "adapter_model.safetensors"))
    payload = WeightPayload.adapter(out, peft_adapter_config(lora_config(rank=RANK, alpha=16)))
    assert payload.kind is PayloadKind.ADAPTER and len(payload.tensors) == E * 6
