"""The bridge adapter only asks Megatron-Bridge's real `AutoBridge` for methods it defines.

Megatron-Bridge (Python 3.12 + TransformerEngine) does not import on this machine, so the real
class is read from the released wheel's source (tests/megatron_source.py): method names and
signatures of megatron-bridge 0.6.2's `AutoBridge`, inheritance included. The dispatch tests
hand the adapter an object built from that list: it has exactly the real methods, binds every
call against the real signature, and answers with real tensors. Calling a method the real class
lacks is an AttributeError there (`'AutoBridge' object has no attribute 'export_weights'`, mbridge's
name for its export).
"""

from __future__ import annotations

import ast

import pytest
import torch
from safetensors.torch import save_file

from lorarl.engines.megatron import bridge as B
from lorarl.errors import ConfigError
from tests.megatron_source import Api, Sources, sources_or_skip, spec_object


@pytest.fixture(scope="module")
def src(request) -> Sources:
    return sources_or_skip(request)


@pytest.fixture(scope="module")
def mb_api(src) -> Api:
    return src.api(src.mb / "models/conversion/auto_bridge.py", "AutoBridge")


def _registered_bridge(src: Sources, family: str) -> ast.ClassDef:
    """The Megatron-Bridge class registered for an HF model_type (`@register_bridge(...)`)."""
    tree = ast.parse((src.mb / f"models/qwen/{family}_bridge.py").read_text())
    (cls,) = [
        n for n in tree.body
        if isinstance(n, ast.ClassDef)
        and any(isinstance(d, ast.Call) and any(k.arg == "model_type" and ast.literal_eval(k.value) == family for k in d.keywords) for d in n.decorator_list)
    ]  # fmt: skip
    return cls


# ---------------------------------------------------------------------------------------------
# the method sets against the real classes
# ---------------------------------------------------------------------------------------------


def test_megatron_bridge_defines_every_method_we_call(mb_api):
    wanted = B.REQUIRED_METHODS | B.BUILD_METHODS
    assert wanted <= set(mb_api.methods), sorted(wanted - set(mb_api.methods))
    assert mb_api.kinds["from_hf_pretrained"] == "classmethod"
    # mbridge's export method does not exist on Megatron-Bridge's AutoBridge
    assert "export_weights" not in mb_api.methods


def test_keyword_arguments_exist_in_real_signatures(mb_api):
    mb_api.methods["export_hf_weights"].bind(
        [], cpu=False, show_progress=False, conversion_tasks=[], merge_adapter_weights=False
    )
    mb_api.methods["export_adapter_weights"].bind([], cpu=False, show_progress=False)
    mb_api.methods["get_conversion_tasks"].bind([])
    # kwargs used elsewhere: weight_dtype cannot be combined with cached tasks (the bridge
    # raises), and 0.6.2 has no expand_shared_outer (a later version's argument).
    with pytest.raises(TypeError):
        mb_api.methods["export_adapter_weights"].bind([], expand_shared_outer=False)


# ---------------------------------------------------------------------------------------------
# dispatch with objects that have exactly the real methods
# ---------------------------------------------------------------------------------------------

H, R = 8, 2
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Live:
    """Stands for model parameters the bridge reads; exports may alias them."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.a = {p: torch.randn(R, H, generator=g) for p in PROJ}
        self.b = {p: torch.randn(H, R, generator=g) for p in PROJ}
        self.w = {p: torch.randn(H, H, generator=g) for p in PROJ}
        self.norm = torch.randn(H, generator=g)


def _mb_impls(live: Live, tasks: list) -> dict:
    def adapter(bound):
        # As Megatron-Bridge yields them: HF module names without the PEFT prefix, the fused A
        # emitted once per projection as the very same tensor (peft_bridge.py).
        shared_qkv, shared_fc1 = live.a["q_proj"], live.a["gate_proj"]
        for p in PROJ:
            a = (
                shared_qkv
                if p in ("q_proj", "k_proj", "v_proj")
                else shared_fc1
                if p in ("gate_proj", "up_proj")
                else live.a[p]
            )
            parent = "self_attn" if p in PROJ[:4] else "mlp"
            yield f"model.layers.0.{parent}.{p}.lora_A.weight", a
            yield f"model.layers.0.{parent}.{p}.lora_B.weight", live.b[p]

    def hf(bound):
        merge = bound.arguments.get("merge_adapter_weights", True)
        yield "model.layers.0.input_layernorm.weight", live.norm  # a view of a live param
        for p in PROJ:
            parent = "self_attn" if p in PROJ[:4] else "mlp"
            w = live.w[p] + 2.0 * live.b[p] @ live.a[p] if merge else live.w[p]
            name = f"model.layers.0.{parent}.{p}.weight"
            yield (name if merge else name.replace(".weight", ".base_layer.weight")), w

    return {"export_adapter_weights": adapter, "export_hf_weights": hf, "get_conversion_tasks": lambda bound: tasks}


def test_megatron_bridge_adapter_dispatch(mb_api):
    live, calls, tasks = Live(), [], [object()]
    adapter = B.MegatronBridgeAdapter(spec_object(mb_api, _mb_impls(live, tasks), calls))

    out = dict(adapter.export_adapter(["model"]))
    assert len(out) == 14 and all(k.startswith("base_model.model.model.layers.0.") for k in out)
    base = dict(adapter.export_base(["model"]))
    assert set(base) == {"model.layers.0.input_layernorm.weight"} | {
        f"model.layers.0.{'self_attn' if p in PROJ[:4] else 'mlp'}.{p}.weight" for p in PROJ
    }
    merged = dict(adapter.export_merged(["model"]))
    torch.testing.assert_close(
        merged["model.layers.0.self_attn.o_proj.weight"], live.w["o_proj"] + 2.0 * live.b["o_proj"] @ live.a["o_proj"]
    )

    called = [name for name, _ in calls]
    assert set(called) == B.REQUIRED_METHODS
    assert called.count("get_conversion_tasks") == 1  # built once, reused by every export
    hf_calls = [b for n, b in calls if n == "export_hf_weights"]
    assert [b.arguments["merge_adapter_weights"] for b in hf_calls] == [False, True]
    assert all(b.arguments["conversion_tasks"] is tasks for b in hf_calls)
    assert all(b.arguments["show_progress"] is False for n, b in calls if n != "get_conversion_tasks")


def test_exports_are_owned_copies(mb_api, tmp_path):
    """An exported tensor must not change when the optimizer later updates the parameter, and
    repeated fused A tensors must not share storage (safetensors refuses that)."""
    live = Live()
    adapter = B.MegatronBridgeAdapter(spec_object(mb_api, _mb_impls(live, [object()]), []))
    out = dict(adapter.export_adapter(["m"]))
    base = dict(adapter.export_base(["m"]))
    before_a, before_norm = (
        out["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].clone(),
        base["model.layers.0.input_layernorm.weight"].clone(),
    )
    with torch.no_grad():  # the optimizer step
        live.a["q_proj"].add_(1.0)
        live.norm.add_(1.0)
    assert torch.equal(out["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"], before_a)
    assert torch.equal(base["model.layers.0.input_layernorm.weight"], before_norm)
    save_file(out, str(tmp_path / "adapter_model.safetensors"))  # raises on shared storage


def test_an_object_without_the_methods_fails_at_construction():
    """A bridge object of another kind (mbridge's, with its one `export_weights`) is refused
    when the adapter is built, before any export."""

    class OtherBridge:
        def export_weights(self, models):
            return iter(())

    with pytest.raises(
        ConfigError,
        match=r"backend.bridge=megatron_bridge .* lacks export_adapter_weights, export_hf_weights, get_conversion_tasks",
    ):
        B.MegatronBridgeAdapter(OtherBridge())


def test_wrong_keyword_would_fail(mb_api):
    """The spec object checks calls against the real signature, so a misspelt keyword in the
    adapter (say `merge_adapters=False`) could not pass the dispatch test."""
    obj = spec_object(mb_api, {"export_hf_weights": lambda b: iter(())}, [])
    with pytest.raises(TypeError):
        obj.export_hf_weights([], merge_adapters=False)


# ---------------------------------------------------------------------------------------------
# Qwen3
# ---------------------------------------------------------------------------------------------


def test_megatron_bridge_serves_qwen3(src):
    """AutoBridge picks Qwen3Bridge for model_type qwen3 (qk_layernorm on, no q/k/v bias)."""
    cls = _registered_bridge(src, "qwen3")
    provider = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "provider_bridge")
    set_attrs = {
        t.attr: ast.literal_eval(node.value)
        for node in ast.walk(provider)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for t in node.targets
        if isinstance(t, ast.Attribute)
    }
    assert set_attrs["qk_layernorm"] is True and set_attrs["add_qkv_bias"] is False


def _qwen3_impls(live: Live) -> dict:
    """Megatron-Bridge exports of a one-layer Qwen3 as its source yields them: q/k norms are
    plain base weights (no `.base_layer`, never in the adapter stream)."""
    impls = _mb_impls(live, [object()])
    base_hf = impls["export_hf_weights"]

    def hf(bound):
        yield "model.layers.0.self_attn.q_norm.weight", live.norm[:4]
        yield "model.layers.0.self_attn.k_norm.weight", live.norm[4:]
        yield from base_hf(bound)

    return {**impls, "export_hf_weights": hf}


def test_qwen3_exports_keep_qk_norms_in_the_base_only(mb_api):
    from lorarl.contract.payload import WeightPayload

    live = Live()
    adapter = B.MegatronBridgeAdapter(spec_object(mb_api, _qwen3_impls(live), []))
    base = dict(adapter.export_base(["m"]))
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= set(base)
    assert torch.equal(base["model.layers.0.self_attn.k_norm.weight"], live.norm[4:])
    merged = dict(adapter.export_merged(["m"]))
    assert torch.equal(merged["model.layers.0.self_attn.q_norm.weight"], live.norm[:4])  # no LoRA on norms
    assert not any("norm" in k for k in dict(adapter.export_adapter(["m"])))
    # The rollout takes the base stream as a base payload (plain HF names, no LoRA tensors).
    payload = WeightPayload.base(iter(base.items()))
    assert "model.layers.0.self_attn.q_norm.weight" in {n for n, _ in payload.tensors}
