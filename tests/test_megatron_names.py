"""HF <-> Megatron layouts and LoRA splitting for Qwen2 and Qwen3, with real tensors.

Where a rule comes from Megatron-Bridge, the test runs Megatron-Bridge 0.6.2's own source for
it (extracted from the released wheel, see tests/megatron_source.py) against the reference in
tests/megatron_reference.py and the name rules lorarl ships (lorarl.engines.megatron.names). The only
stand-in is `parallel_state.get_tensor_model_parallel_world_size` for the fc1 splitter, which
reads the TP size from megatron-core's process groups.
"""

from __future__ import annotations

import ast
import json
import types

import pytest
import torch

from lorarl.config.schema import LoraConfig
from lorarl.engines.megatron import names as N
from lorarl.engines.megatron.config_map import peft_adapter_config
from lorarl.errors import ConfigError, ModelError, SyncError
from tests import megatron_reference as R
from tests.megatron_source import Sources, field_default, literal, load_functions, sources_or_skip

SHAPES = [
    R.AttentionShape(num_attention_heads=4, num_query_groups=2, head_dim=8),
    R.AttentionShape(num_attention_heads=14, num_query_groups=2, head_dim=64),  # Qwen2.5-0.5B
    R.AttentionShape(num_attention_heads=4, num_query_groups=4, head_dim=16),  # MHA
    R.AttentionShape(num_attention_heads=8, num_query_groups=1, head_dim=4),  # MQA
]


@pytest.fixture(scope="module")
def src(request) -> Sources:
    return sources_or_skip(request)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _config(shape: R.AttentionShape, hidden: int) -> types.SimpleNamespace:
    # The attributes Megatron-Bridge's layout helpers read from a TransformerConfig.
    return types.SimpleNamespace(
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        hidden_size=hidden,
    )


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s.num_attention_heads}g{s.num_query_groups}")
def test_qkv_round_trip_weights_and_biases(shape):
    g = _gen(1)
    q = torch.randn(shape.q_size, 24, generator=g)
    k = torch.randn(shape.kv_size, 24, generator=g)
    v = torch.randn(shape.kv_size, 24, generator=g)
    fused = R.merge_qkv(q, k, v, shape)
    assert fused.shape == (shape.qkv_size, 24)
    for a, b in zip(R.split_qkv(fused, shape), (q, k, v)):
        assert torch.equal(a, b)
    qb, kb, vb = q[:, 0].clone(), k[:, 0].clone(), v[:, 0].clone()
    fused_b = R.merge_qkv(qb, kb, vb, shape)
    assert fused_b.shape == (shape.qkv_size,)
    for a, b in zip(R.split_qkv(fused_b, shape), (qb, kb, vb)):
        assert torch.equal(a, b)


def test_qkv_interleave_is_per_group():
    shape = R.AttentionShape(num_attention_heads=4, num_query_groups=2, head_dim=1)
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])  # heads 0..3; group 0 = heads 0,1
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    assert R.merge_qkv(q, k, v, shape).flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]


def test_qkv_wrong_rows_rejected():
    shape = SHAPES[0]
    with pytest.raises(ValueError, match="rows"):
        R.merge_qkv(
            torch.zeros(shape.q_size + 1, 3), torch.zeros(shape.kv_size, 3), torch.zeros(shape.kv_size, 3), shape
        )


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_round_trip(tp):
    g = _gen(2)
    gate, up = torch.randn(16, 5, generator=g), torch.randn(16, 5, generator=g)
    fc1 = R.merge_gate_up(gate, up, tp)
    shards = torch.chunk(fc1, tp)
    for r, shard in enumerate(shards):  # each rank holds [gate_r; up_r]
        assert torch.equal(shard[: 16 // tp], gate[r * 16 // tp : (r + 1) * 16 // tp])
        assert torch.equal(shard[16 // tp :], up[r * 16 // tp : (r + 1) * 16 // tp])
    a, b = R.split_gate_up(fc1, tp)
    assert torch.equal(a, gate) and torch.equal(b, up)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s.num_attention_heads}g{s.num_query_groups}")
def test_qkv_matches_megatron_bridge_source(src, shape):
    path = src.mb / "models/conversion/param_mapping.py"
    real = load_functions(
        path,
        ["merge_qkv_weights", "split_qkv_weights", "merge_qkv_biases", "split_qkv_biases"],
        {"torch": torch, "Optional": __import__("typing").Optional, "Tuple": tuple, "TransformerConfig": object},
    )
    hidden = 24
    cfg = _config(shape, hidden)
    g = _gen(3)
    q = torch.randn(shape.q_size, hidden, generator=g)
    k = torch.randn(shape.kv_size, hidden, generator=g)
    v = torch.randn(shape.kv_size, hidden, generator=g)
    assert torch.equal(R.merge_qkv(q, k, v, shape), real["merge_qkv_weights"](cfg, q, k, v))
    fused = real["merge_qkv_weights"](cfg, q, k, v)
    for ours, theirs in zip(R.split_qkv(fused, shape), real["split_qkv_weights"](cfg, fused)):
        assert torch.equal(ours, theirs)
    assert torch.equal(
        R.merge_qkv(q[:, 0], k[:, 0], v[:, 0], shape), real["merge_qkv_biases"](cfg, q[:, 0], k[:, 0], v[:, 0])
    )
    for ours, theirs in zip(
        R.split_qkv(fused[:, 0].contiguous(), shape), real["split_qkv_biases"](cfg, fused[:, 0].contiguous())
    ):
        assert torch.equal(ours, theirs)
    # LoRA B of the fused linear_qkv: trailing dim is the rank (feature_dim in the bridge).
    lora_b = torch.randn(shape.qkv_size, 6, generator=g)
    for ours, theirs in zip(R.split_qkv(lora_b, shape), real["split_qkv_weights"](cfg, lora_b, feature_dim=6)):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fc1_lora_split_matches_megatron_bridge_source(src, tp):
    path = src.mb / "models/conversion/peft_bridge.py"
    ps = types.SimpleNamespace(get_tensor_model_parallel_world_size=lambda: tp)
    split = load_functions(
        path,
        ["_split_fused_fc1_linear_out_weight"],
        {"torch": torch, "parallel_state": ps},
        class_name="MegatronPeftBridge",
    )["_split_fused_fc1_linear_out_weight"]
    b = torch.randn(2 * 24, 4, generator=_gen(4))
    theirs = split(None, b, is_expert=False)
    ours = R.split_gate_up(b, tp)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


# ---------------------------------------------------------------------------------------------
# base names
# ---------------------------------------------------------------------------------------------


def _qwen2_registry(src: Sources) -> dict[str, tuple[str, ...]]:
    return _bridge_registry(src, "qwen2")


def _bridge_registry(src: Sources, family: str) -> dict[str, tuple[str, ...]]:
    """Megatron -> HF names from Qwen2Bridge / Qwen3Bridge.mapping_registry in the released
    source; the multi-token-prediction (`mtp.`) entries are left out (dense decoders only)."""
    tree = ast.parse((src.mb / f"models/qwen/{family}_bridge.py").read_text())
    out: dict[str, tuple[str, ...]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "param_mappings" for t in node.targets
        ):
            out.update({k: (v,) for k, v in ast.literal_eval(node.value).items()})
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("QKVMapping", "GatedMLPMapping")
        ):
            kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            parts = ("q", "k", "v") if node.func.id == "QKVMapping" else ("gate", "up")
            out[kw["megatron_param"]] = tuple(kw[p] for p in parts)
    return {k: v for k, v in out.items() if not k.startswith("mtp.")}


@pytest.mark.parametrize("family, entries", [("qwen2", 10), ("qwen3", 11)])
def test_names_match_qwen_bridge_registry(src, family, entries):
    # Qwen3: no q/k/v bias (-1), q_layernorm and k_layernorm (+2).
    registry = _bridge_registry(src, family)
    assert len(registry) == entries
    if family == "qwen3":
        assert registry["decoder.layers.*.self_attention.q_layernorm.weight"] == (
            "model.layers.*.self_attn.q_norm.weight",
        )
        assert registry["decoder.layers.*.self_attention.k_layernorm.weight"] == (
            "model.layers.*.self_attn.k_norm.weight",
        )
        assert "decoder.layers.*.self_attention.linear_qkv.bias" not in registry
    aliases = dict(
        __import__("tests.megatron_source", fromlist=["class_literal"]).class_literal(
            src.mb / "models/conversion/mapping_registry.py", "MegatronMappingRegistry", "_SEPARATE_LAYERNORM_REWRITES"
        )
    )
    for mc_pattern, hf_pattern in registry.items():
        for layer in (0, 7):
            mc = mc_pattern.replace("*", str(layer))
            expected = tuple(h.replace("*", str(layer)) for h in hf_pattern)
            assert R.megatron_to_hf_names(mc, "transformer_engine") == expected
            for i, h in enumerate(expected):
                assert R.hf_to_megatron_name(h, "transformer_engine") == (mc, None if len(expected) == 1 else i)
            # The local spec keeps separate norm modules: the bridge's alias table names them.
            suffix = mc.split(f"decoder.layers.{layer}.", 1)[-1]
            if suffix in aliases:
                local = f"decoder.layers.{layer}.{aliases[suffix]}"
                assert R.megatron_to_hf_names(local, "local") == expected
                assert R.hf_to_megatron_name(expected[0], "local") == (local, None)
            elif "layernorm" in suffix:  # q/k norms: one module name in both specs
                assert R.megatron_to_hf_names(mc, "local") == expected


def _tiny_qwen2(tie: bool = True, seed: int = 0):
    return _tiny("qwen2", tie, seed)


def _tiny(arch: str, tie: bool = True, seed: int = 0):
    """A real HF Qwen2 or Qwen3 with SHAPE's heads (4 heads, 2 KV groups, head_dim 8)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    torch.manual_seed(seed)
    cfg = config_cls(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tie,
    )  # fmt: skip
    model = model_cls(cfg).eval()
    if arch == "qwen3":
        with torch.no_grad():  # RMSNorm scales start at 1; make q_norm/k_norm visible in the logits
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("spec", R.SPECS)
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_state_round_trip_real_qwen(arch, spec, tie):
    model = _tiny(arch, tie)
    hf = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    shape = R.AttentionShape.from_hf_config(model.config)
    mc = R.hf_to_megatron_state(hf, shape, spec)
    # per layer, Qwen2: qkv weight + bias, proj, fc1, fc2 and two norms; Qwen3: no qkv bias, but
    # q_layernorm and k_layernorm. Then embedding, final norm (+ output).
    assert len(mc) == 2 * (7 if arch == "qwen2" else 8) + (2 if tie else 3)
    assert mc["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (shape.qkv_size, 32)
    if arch == "qwen3":
        assert "decoder.layers.1.self_attention.linear_qkv.bias" not in mc
        assert torch.equal(
            mc["decoder.layers.1.self_attention.k_layernorm.weight"], hf["model.layers.1.self_attn.k_norm.weight"]
        )
    back = R.megatron_to_hf_state(mc, shape, spec)
    assert back.keys() == hf.keys()
    for k in hf:
        assert torch.equal(back[k], hf[k]), k


def test_unknown_names_rejected():
    with pytest.raises(ModelError, match="model.layers.0.self_attn.rotary"):
        R.hf_to_megatron_name("model.layers.0.self_attn.rotary.inv_freq")
    with pytest.raises(ModelError, match="decoder.layers.0.self_attention.core_attention"):
        R.megatron_to_hf_names("decoder.layers.0.self_attention.core_attention.x")
    with pytest.raises(ConfigError, match="backend.transformer_impl"):
        R.megatron_to_hf_names("output_layer.weight", spec="te")


# ---------------------------------------------------------------------------------------------
# LoRA targets
# ---------------------------------------------------------------------------------------------


def test_target_defaults_are_megatron_bridge_defaults(src):
    assert tuple(field_default(src.mb / "peft/lora.py", "LoRA", "target_modules")) == N.FUSED_TARGETS
    assert set(field_default(src.mb / "peft/canonical_lora.py", "CanonicalLoRA", "target_modules")) == set(
        N.CANONICAL_TARGETS
    )


@pytest.mark.parametrize(
    "given, lora_type, megatron, hf, widened",
    [
        (["all-linear"], "lora", N.FUSED_TARGETS, N.HF_PROJECTIONS, ()),
        (list(N.HF_PROJECTIONS), "lora", N.FUSED_TARGETS, N.HF_PROJECTIONS, ()),
        (list(N.FUSED_TARGETS), "lora", N.FUSED_TARGETS, N.HF_PROJECTIONS, ()),
        (["q_proj", "v_proj"], "lora", ("linear_qkv",), ("q_proj", "k_proj", "v_proj"), ("k_proj",)),
        (["gate_proj"], "lora", ("linear_fc1",), ("gate_proj", "up_proj"), ("up_proj",)),
        (
            ["linear_q", "linear_fc1_up"],
            "lora",
            ("linear_qkv", "linear_fc1"),
            ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
            ("k_proj", "v_proj", "gate_proj"),
        ),
        (["all-linear"], "canonical_lora", N.CANONICAL_TARGETS, N.HF_PROJECTIONS, ()),
        (["q_proj", "v_proj"], "canonical_lora", ("linear_q", "linear_v"), ("q_proj", "v_proj"), ()),
        (
            ["linear_qkv", "linear_fc1"],
            "canonical_lora",
            ("linear_q", "linear_k", "linear_v", "linear_fc1_up", "linear_fc1_gate"),
            ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
            (),
        ),
        (["o_proj", "down_proj", "o_proj"], "lora", ("linear_proj", "linear_fc2"), ("o_proj", "down_proj"), ()),
    ],
)
def test_resolve_targets(given, lora_type, megatron, hf, widened):
    t = N.resolve_lora_targets(given, lora_type)
    assert (t.megatron, t.hf, t.widened) == (megatron, hf, widened)
    # CanonicalLoRA asserts on fused names (canonical_lora.py _init_target_match_state).
    if lora_type == "canonical_lora":
        assert not any(m in ("linear_qkv", "linear_fc1") for m in t.megatron)


@pytest.mark.parametrize(
    "bad", ["lm_head", "embed_tokens", "model.embed_tokens", "qkv_proj", "self_attn.q_proj", "*.linear_qkv", "mlp"]
)
def test_unmappable_targets_rejected(bad):
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules") as e:
        N.resolve_lora_targets(["q_proj", bad])
    assert repr(bad) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("norm", ["q_norm", "k_norm", "q_layernorm", "k_layernorm", "self_attn.k_norm"])
@pytest.mark.parametrize("lora_type", ["lora", "canonical_lora"])
def test_qwen3_qk_norms_are_never_lora_targets(norm, lora_type):
    with pytest.raises(ConfigError, match="q_norm/k_norm are base weights") as e:
        N.resolve_lora_targets(["q_proj", norm], lora_type)
    assert repr(norm) in str(e.value) and "\n" not in str(e.value)
    # all-linear on a Qwen3 model: the seven projections, nothing else.
    assert N.resolve_lora_targets(["all-linear"], lora_type).hf == N.HF_PROJECTIONS


def test_empty_targets():
    # model.lora.type is checked by the config (tests/test_megatron_config.py).
    with pytest.raises(ConfigError, match="model.lora.target_modules is empty"):
        N.resolve_lora_targets([], "lora")


# ---------------------------------------------------------------------------------------------
# LoRA tensors: merged-weight equality
# ---------------------------------------------------------------------------------------------

HIDDEN, FFN, RANK, ALPHA = 32, 48, 4, 8.0
SHAPE = SHAPES[0]  # 4 heads, 2 groups, head_dim 8 -> hidden 32
OUT_FEATURES = {"linear_qkv": SHAPE.qkv_size, "linear_proj": HIDDEN, "linear_fc1": 2 * FFN, "linear_fc2": HIDDEN}
IN_FEATURES = {"linear_qkv": HIDDEN, "linear_proj": SHAPE.q_size, "linear_fc1": HIDDEN, "linear_fc2": FFN}
PARENT = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}


def _shard(module: str, full_w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tp: int):
    """What each TP rank holds in megatron-core for a LoRA-wrapped linear (W, A, B shards)."""
    if module in R.COLUMN_PARALLEL:
        return list(torch.chunk(full_w, tp, 0)), list(torch.chunk(a, tp, 0)), list(torch.chunk(b, tp, 0))
    return list(torch.chunk(full_w, tp, 1)), list(torch.chunk(a, tp, 1)), list(torch.chunk(b, tp, 0))


def _megatron_local_merge(module: str, w: list, a: list, b: list, scale: float) -> torch.Tensor:
    """Per-rank merge exactly as megatron.bridge.peft.lora_merge.LoRAMerge does it, then the
    merged shards gathered into the full Megatron weight."""
    if module in R.COLUMN_PARALLEL:  # W_r + s * B_r @ gather(A)
        a_full = torch.cat(a, 0)
        return torch.cat([wr + scale * br @ a_full for wr, br in zip(w, b)], 0)
    b_full = torch.cat(b, 0)  # W_r + s * gather(B) @ A_r
    return torch.cat([wr + scale * b_full @ ar for wr, ar in zip(w, a)], 1)


def _random_lora_layer(layer: int, tp: int, gen: torch.Generator, canonical: bool = False):
    """HF base weights of one layer, and the Megatron LoRA parameter shards (fused or canonical)."""
    hf = {
        "q_proj": torch.randn(SHAPE.q_size, HIDDEN, generator=gen, dtype=torch.float64),
        "k_proj": torch.randn(SHAPE.kv_size, HIDDEN, generator=gen, dtype=torch.float64),
        "v_proj": torch.randn(SHAPE.kv_size, HIDDEN, generator=gen, dtype=torch.float64),
        "o_proj": torch.randn(HIDDEN, SHAPE.q_size, generator=gen, dtype=torch.float64),
        "gate_proj": torch.randn(FFN, HIDDEN, generator=gen, dtype=torch.float64),
        "up_proj": torch.randn(FFN, HIDDEN, generator=gen, dtype=torch.float64),
        "down_proj": torch.randn(HIDDEN, FFN, generator=gen, dtype=torch.float64),
    }
    base = {
        "linear_qkv": R.merge_qkv(hf["q_proj"], hf["k_proj"], hf["v_proj"], SHAPE),
        "linear_proj": hf["o_proj"],
        "linear_fc1": R.merge_gate_up(hf["gate_proj"], hf["up_proj"], tp),
        "linear_fc2": hf["down_proj"],
    }
    shards: dict[str, list[torch.Tensor]] = {}
    merged: dict[str, torch.Tensor] = {}
    scale = ALPHA / RANK
    for module in N.FUSED_TARGETS:
        prefix = f"module.decoder.layers.{layer}.{PARENT[module]}.{module}.adapter"
        if canonical and module in ("linear_qkv", "linear_fc1"):
            subs = {
                "linear_qkv": [("adapter_q", SHAPE.q_size), ("adapter_k", SHAPE.kv_size), ("adapter_v", SHAPE.kv_size)],
                "linear_fc1": [("adapter_gate", FFN), ("adapter_up", FFN)],
            }[module]
            w_shards = list(torch.chunk(base[module], tp, 0))
            deltas = {}
            for sub, out in subs:
                a = torch.randn(RANK, HIDDEN, generator=gen, dtype=torch.float64)
                b = torch.randn(out, RANK, generator=gen, dtype=torch.float64)
                shards[f"{prefix}.{sub}.linear_in.weight"] = list(torch.chunk(a, tp, 0))
                shards[f"{prefix}.{sub}.linear_out.weight"] = list(torch.chunk(b, tp, 0))
                deltas[sub] = scale * b @ a
            # LoRALinearSplitQKV interleaves q/k/v adapter outputs per group; FC1UpGate cats [gate, up].
            if module == "linear_qkv":
                delta = R.merge_qkv(deltas["adapter_q"], deltas["adapter_k"], deltas["adapter_v"], SHAPE)
            else:
                delta = R.merge_gate_up(deltas["adapter_gate"], deltas["adapter_up"], tp)
            merged[module] = torch.cat(w_shards, 0) + delta
            continue
        a = torch.randn(RANK, IN_FEATURES[module], generator=gen, dtype=torch.float64)
        b = torch.randn(OUT_FEATURES[module], RANK, generator=gen, dtype=torch.float64)
        w, a_s, b_s = _shard(module, base[module], a, b, tp)
        shards[f"{prefix}.linear_in.weight"] = a_s
        shards[f"{prefix}.linear_out.weight"] = b_s
        merged[module] = _megatron_local_merge(module, w, a_s, b_s, scale)
    return hf, shards, merged


@pytest.mark.parametrize("canonical", [False, True], ids=["lora", "canonical_lora"])
@pytest.mark.parametrize("tp", [1, 2])
def test_split_lora_merged_weight_equality(tp, canonical):
    gen = _gen(10 + tp)
    all_shards, expected = {}, {}
    for layer in range(2):
        hf, shards, merged = _random_lora_layer(layer, tp, gen, canonical)
        all_shards.update(shards)
        # Megatron-merged weights, back to HF layout with the base-weight rules.
        mc = {f"decoder.layers.{layer}.{PARENT[m]}.{m}.weight": w for m, w in merged.items()}
        expected.update(R.megatron_to_hf_state(mc, SHAPE, tp_size=tp))
        for proj, w in hf.items():
            expected[f"base:model.layers.{layer}.{R.HF_PARENT[proj]}.{proj}.weight"] = w
    peft = R.megatron_lora_to_peft(all_shards, SHAPE)
    assert len(peft) == 2 * 7 * 2
    scale = ALPHA / RANK
    for layer in range(2):
        for proj in N.HF_PROJECTIONS:
            stem = f"model.layers.{layer}.{R.HF_PARENT[proj]}.{proj}"
            a = peft[f"base_model.model.{stem}.lora_A.weight"]
            b = peft[f"base_model.model.{stem}.lora_B.weight"]
            merged_hf = expected[f"base:{stem}.weight"] + scale * b @ a
            torch.testing.assert_close(merged_hf, expected[f"{stem}.weight"], rtol=0, atol=1e-10)
            assert a.shape == (RANK, expected[f"base:{stem}.weight"].shape[1])
    if not canonical:
        # One fused A serves q, k and v (and gate, up): the same values, per projection.
        assert torch.equal(
            peft["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"],
            peft["base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"],
        )


def test_fc1_tp_ordering_matters():
    """Splitting a TP=2 gathered fc1 B as if TP were 1 gives wrong gate/up: the test above
    would catch a splitter that ignored the per-rank [gate_r; up_r] layout."""
    gen = _gen(5)
    _, shards, merged = _random_lora_layer(0, 2, gen)
    b = torch.cat(shards["module.decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight"], 0)
    right = R.split_gate_up(b, 2)
    wrong = R.split_gate_up(b, 1)
    assert not torch.equal(right[0], wrong[0])


def test_megatron_lora_names_validated():
    with pytest.raises(SyncError, match="not a Megatron LoRA parameter"):
        R.megatron_lora_to_peft({"decoder.layers.0.self_attention.linear_qkv.weight": [torch.zeros(1)]}, SHAPE)
    with pytest.raises(SyncError, match="both linear_in and linear_out"):
        R.megatron_lora_to_peft(
            {"decoder.layers.0.mlp.linear_fc2.adapter.linear_in.weight": [torch.zeros(4, 48)]}, SHAPE
        )


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_peft_loads_split_adapter_and_matches_megatron_merge(tmp_path, arch):
    """End to end with real PEFT: a TP=2 fused Megatron LoRA, split by the reference, saved as
    a PEFT folder with lorarl's adapter config, loaded by PeftModel.from_pretrained, gives the
    logits of the model whose weights are the Megatron-side merge converted back to HF. On
    Qwen3 the q/k norms stay the base model's: the adapter config names projections only."""
    from peft import PeftModel
    from safetensors.torch import save_file

    tp = 2
    model = _tiny(arch, tie=True, seed=3).double()
    shape = R.AttentionShape.from_hf_config(model.config)
    assert shape == SHAPE
    gen = _gen(7)
    shards_all, merged_hf = {}, {}
    sd = model.state_dict()
    for layer in range(model.config.num_hidden_layers):
        _, shards, _ = _random_lora_layer(layer, tp, gen)
        shards_all.update(shards)
        hf_w = {p: sd[f"model.layers.{layer}.{R.HF_PARENT[p]}.{p}.weight"] for p in N.HF_PROJECTIONS}
        base = {
            "linear_qkv": R.merge_qkv(hf_w["q_proj"], hf_w["k_proj"], hf_w["v_proj"], shape),
            "linear_proj": hf_w["o_proj"],
            "linear_fc1": R.merge_gate_up(hf_w["gate_proj"], hf_w["up_proj"], tp),
            "linear_fc2": hf_w["down_proj"],
        }
        mc = {}
        for m in N.FUSED_TARGETS:
            prefix = f"module.decoder.layers.{layer}.{PARENT[m]}.{m}.adapter"
            w, _, _ = _shard(m, base[m], torch.zeros(RANK, 1), torch.zeros(1, RANK), tp)
            a = shards[f"{prefix}.linear_in.weight"]
            b = shards[f"{prefix}.linear_out.weight"]
            mc[f"decoder.layers.{layer}.{PARENT[m]}.{m}.weight"] = _megatron_local_merge(m, w, a, b, ALPHA / RANK)
        merged_hf.update(R.megatron_to_hf_state(mc, shape, tp_size=tp))
    tensors = R.megatron_lora_to_peft(shards_all, shape)
    cfg = peft_adapter_config(
        LoraConfig(
            **{
                "rank": RANK,
                "alpha": ALPHA,
                "dropout": 0.0,
                "target_modules": ["all-linear"],
                "target_parameters": [],
                "type": "lora",
                "init_A": "xavier",
                "merge": False,
            }
        )
    )
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))

    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=gen)
    with torch.no_grad():
        base_logits = model(ids).logits
        peft_model = PeftModel.from_pretrained(model, str(folder)).eval()
        lora_logits = peft_model(ids).logits
        with peft_model.disable_adapter():
            assert torch.allclose(peft_model(ids).logits, base_logits)
        reference = _tiny(arch, tie=True, seed=3).double()
        reference.load_state_dict({**reference.state_dict(), **merged_hf})
        merged_logits = reference(ids).logits
    assert (lora_logits - base_logits).abs().max() > 1e-2  # the adapter does something
    torch.testing.assert_close(lora_logits, merged_logits, rtol=0, atol=1e-9)
    assert not any("norm" in k for k in tensors)


# ---------------------------------------------------------------------------------------------
# export streams -> rollout names
# ---------------------------------------------------------------------------------------------


def _bridge_adapter_names(src: Sources, layers: int, family: str = "qwen2") -> list[str]:
    """The names Megatron-Bridge's export_adapter_weights yields for Qwen2/Qwen3, produced by
    its own `_make_lora_param_name` and suffix table over the family bridge's HF names."""
    path = src.mb / "models/conversion/peft_bridge.py"
    table = literal(path, "MEGATRON_TO_HF_LORA_SUFFIX")
    make = load_functions(
        path,
        ["_make_lora_param_name"],
        {"MEGATRON_TO_HF_LORA_SUFFIX": table, "Optional": __import__("typing").Optional},
        class_name="MegatronPeftBridge",
    )["_make_lora_param_name"]
    registry = _bridge_registry(src, family)
    out = []
    for layer in range(layers):
        for mc, hf in registry.items():
            if not any(t in mc for t in N.FUSED_TARGETS) or not mc.endswith(".weight") or "layer_norm" in mc:
                continue
            for h in hf:
                base = h.replace("*", str(layer))
                out += [make(None, base, ".linear_in.weight"), make(None, base, ".linear_out.weight")]
    return out


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_normalize_adapter_names_from_bridge_rules(src, family):
    raw = _bridge_adapter_names(src, 2, family)
    assert len(raw) == 28  # 7 modules x A/B x 2 layers, as measured (notes §1.3)
    assert "model.layers.1.self_attn.k_proj.lora_B.weight" in raw
    t = torch.zeros(1)
    out = dict(N.normalize_adapter_names((n, t) for n in raw))
    assert len(out) == 28
    assert all(
        k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in out
    )
    assert {R.lora_module_of(k) for k in out} == set(N.HF_PROJECTIONS)
    # idempotent: already-prefixed names pass unchanged
    assert list(dict(N.normalize_adapter_names(out.items()))) == list(out)


@pytest.mark.parametrize(
    "bad",
    [
        "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight",  # mbridge main's fused naming
        "base_model.model.model.layers.0.mlp.gate_up_proj.lora_B.weight",
        "model.embed_tokens.lora_embedding_A",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.lora_A.default.weight",
    ],
)
def test_normalize_adapter_names_rejects(bad):
    with pytest.raises(SyncError, match="adapter export yielded"):
        list(N.normalize_adapter_names([(bad, torch.zeros(1))]))


def test_normalize_adapter_names_rejects_duplicates():
    n = "model.layers.0.self_attn.q_proj.lora_A.weight"
    with pytest.raises(SyncError, match="twice"):
        list(N.normalize_adapter_names([(n, torch.zeros(1)), ("base_model.model." + n, torch.zeros(1))]))


def _base_layer_name(hf_name: str) -> str:
    # megatron/bridge/models/conversion/model_bridge.py stream_weights_megatron_to_hf, for
    # weights of LoRA-wrapped modules when merge_adapter_weights=False.
    pos = hf_name.rfind(".")
    return hf_name + ".base_layer" if pos == -1 else hf_name[:pos] + ".base_layer" + hf_name[pos:]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_normalize_base_names(arch):
    model = _tiny(arch, tie=True)
    plain = [k for k in model.state_dict() if k != "lm_head.weight"]
    wrapped = {
        f"model.layers.{i}.{p}.weight"
        for i in range(2)
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }
    exported = [_base_layer_name(k) if k in wrapped else k for k in plain]
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in exported
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in exported  # biases keep plain names
    else:  # q/k norms are not LoRA-wrapped, so the bridge exports them under plain names
        assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= set(exported)
    out = [n for n, _ in N.normalize_base_names((n, torch.zeros(1)) for n in exported)]
    assert out == plain
    with pytest.raises(SyncError, match="adapter tensor"):
        list(N.normalize_base_names([("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(1))]))
    with pytest.raises(SyncError, match="twice"):
        list(N.normalize_base_names([("a.base_layer.weight", torch.zeros(1)), ("a.weight", torch.zeros(1))]))


def test_split_adapter_is_a_valid_rollout_payload():
    """What the Megatron engine hands the rollout passes lorarl.sync's checks, which run
    vLLM's own LoRA name parser and the adapter-config rules."""
    from lorarl.contract.payload import PayloadKind, WeightPayload

    _, shards, _ = _random_lora_layer(0, 2, _gen(9))
    tensors = {k: v.float() for k, v in R.megatron_lora_to_peft(shards, SHAPE).items()}
    cfg = peft_adapter_config(
        LoraConfig(
            **{
                "rank": RANK,
                "alpha": ALPHA,
                "dropout": 0.0,
                "target_modules": ["all-linear"],
                "target_parameters": [],
                "type": "lora",
                "init_A": "xavier",
                "merge": False,
            }
        )
    )
    payload = WeightPayload.adapter(tensors, cfg)
    assert payload.kind is PayloadKind.ADAPTER and len(payload.tensors) == 14
    base = WeightPayload.base(
        N.normalize_base_names([("model.layers.0.self_attn.q_proj.base_layer.weight", torch.zeros(2, 2))])
    )
    assert [n for n, _ in base.tensors] == ["model.layers.0.self_attn.q_proj.weight"]
