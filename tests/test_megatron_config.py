"""lorarl's LoRA/backend keys -> Megatron-Bridge PEFT and provider settings, and validation.

Every keyword and attribute name we emit is checked against the released megatron-bridge 0.6.2
/ megatron-core 0.19.2 source (dataclass fields read with `ast`, inheritance included; see
tests/megatron_source.py), since neither package imports on this machine.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from lorarl.config.backends import MegatronBackendConfig
from lorarl.config.compose import compose, load_group
from lorarl.config.schema import LoraConfig
from lorarl.config.validate import check_model_shape
from lorarl.engines.megatron import config_map as C
from lorarl.errors import ConfigError
from tests.megatron_checks import check_megatron
from tests.megatron_source import Sources, sources_or_skip


@pytest.fixture(scope="module")
def src(request) -> Sources:
    return sources_or_skip(request)


def lora(**kw):
    base = {
        "rank": 8,
        "alpha": 16,
        "dropout": 0.05,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "type": "lora",
        "init_A": "kaiming",
        "merge": False,
        "target_parameters": [],
    }
    return LoraConfig(**{**base, **kw})


def backend(**kw):
    return dataclasses.replace(load_group(MegatronBackendConfig, "backend/megatron"), **kw)


# ---------------------------------------------------------------------------------------------
# PEFT
# ---------------------------------------------------------------------------------------------


def test_peft_spec_lora():
    spec = C.peft_spec(lora())
    assert spec.class_name == "LoRA"
    assert spec.kwargs == {
        "target_modules": ["linear_qkv", "linear_proj"],
        "dim": 8,
        "alpha": 16,
        "dropout": 0.05,
        "dropout_position": "pre",
        "lora_A_init_method": "kaiming",
        "lora_B_init_method": "zero",
    }
    assert spec.hf_target_modules == ("q_proj", "k_proj", "v_proj", "o_proj") and spec.widened == ()


def test_peft_spec_canonical_from_dataclass():
    spec = C.peft_spec(
        lora(rank=16, alpha=32, target_modules=["q_proj", "v_proj", "linear_fc1"], type="canonical_lora")
    )
    assert spec.class_name == "CanonicalLoRA"
    assert spec.kwargs["target_modules"] == ["linear_q", "linear_v", "linear_fc1_up", "linear_fc1_gate"]
    assert spec.hf_target_modules == ("q_proj", "v_proj", "gate_proj", "up_proj")


@pytest.mark.parametrize("lora_type", ["lora", "canonical_lora"])
def test_peft_kwargs_are_real_fields(src, lora_type):
    path, cls = {
        "lora": (src.mb / "peft/lora.py", "LoRA"),
        "canonical_lora": (src.mb / "peft/canonical_lora.py", "CanonicalLoRA"),
    }[lora_type]
    spec = C.peft_spec(lora(type=lora_type, target_modules=["all-linear"]))
    assert spec.class_name == cls
    fields = src.api(path, cls).fields
    assert set(spec.kwargs) <= set(fields), set(spec.kwargs) - set(fields)
    assert "disable_adapter" in src.api(path, cls).methods  # reference log-probs rely on it


def test_init_methods_are_those_megatron_bridge_accepts(src):
    """ParallelLinearAdapter._get_init_fn raises NotImplementedError for anything else."""
    tree = ast.parse((src.mb / "peft/utils.py").read_text())
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_get_init_fn"]
    accepted = {
        c.comparators[0].value
        for c in ast.walk(fn)
        if isinstance(c, ast.Compare) and isinstance(c.comparators[0], ast.Constant)
    }
    assert set(C.INIT_METHODS) | {"zero"} <= accepted


@pytest.mark.parametrize(
    "bad, key",
    [
        ({"init_A": "uniform"}, "model.lora.init_A"),
        ({"type": "dora"}, "model.lora.type"),
        ({"rank": 0}, "model.lora.rank"),
        ({"alpha": 0}, "model.lora.alpha"),
        ({"dropout": 1.0}, "model.lora.dropout"),
        ({"target_modules": ["lm_head"]}, "model.lora.target_modules"),
    ],
)
def test_lora_settings_are_checked(bad, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        check_megatron(lora(**bad), backend())
    assert "\n" not in str(e.value)


def test_adapter_config_loads_in_real_peft(tmp_path):
    import json

    from peft import LoraConfig as PeftLoraConfig

    cfg = C.peft_adapter_config(lora(rank=8, alpha=16, target_modules=["q_proj"]))
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    loaded = PeftLoraConfig.from_pretrained(str(tmp_path))
    assert loaded.r == 8 and loaded.lora_alpha == 16 and not loaded.use_rslora
    # fused LoRA on linear_qkv adapts q, k and v: the config must say so
    assert set(loaded.target_modules) == {"q_proj", "k_proj", "v_proj"}


# ---------------------------------------------------------------------------------------------
# provider
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def provider_fields(src) -> set[str]:
    return set(src.api(src.mb / "models/gpt_provider.py", "GPTModelProvider").fields)


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_provider_settings_are_real_fields(src, provider_fields, impl):
    plan = C.provider_plan(
        backend(
            transformer_impl=impl, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        ),
        "bfloat16",
    )
    assert set(plan.settings) <= provider_fields, set(plan.settings) - provider_fields
    assert "transformer_layer_spec" in provider_fields and "attention_backend" in provider_fields
    if impl == "local":
        assert all(plan.settings[k] is False for k in C.LOCAL_SPEC_FUSIONS_OFF)
        assert plan.layer_spec == "local" and plan.attention_backend == "local"
        tree = ast.parse((src.mb / "models/gpt_provider.py").read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "local_layer_spec" for n in tree.body)
        enums = ast.parse((src.mc / "transformer/enums.py").read_text())
        (attn,) = [n for n in enums.body if isinstance(n, ast.ClassDef) and n.name == "AttnBackend"]
        members = {t.id for a in attn.body if isinstance(a, ast.Assign) for t in a.targets}
        assert plan.attention_backend in members
    else:
        assert plan.attention_backend is None and "gradient_accumulation_fusion" not in plan.settings


def test_provider_plan_values():
    import torch

    plan = C.provider_plan(
        backend(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            transformer_impl="transformer_engine",
            override_transformer_config={"apply_rope_fusion": True},
        ),
        "bfloat16",
    )
    s = plan.settings
    assert (s["tensor_model_parallel_size"], s["pipeline_model_parallel_size"], s["sequence_parallel"]) == (2, 1, True)
    assert s["bf16"] and not s["fp16"] and s["params_dtype"] is torch.bfloat16
    assert "recompute_granularity" not in s
    assert plan.overrides == {"apply_rope_fusion": True}
    assert C.provider_plan(backend(), "float32").settings["params_dtype"] is torch.float32


def _provider_from_real_fields(fields: set[str]):
    """An object with exactly GPTModelProvider's fields (from its source) and a finalize()."""
    cls = dataclasses.make_dataclass(
        "GPTModelProvider",
        [(f, object, dataclasses.field(default=None)) for f in sorted(fields) if not f.startswith("_")],
        namespace={"finalize": lambda self: self.__dict__.setdefault("finalized", True)},
    )
    return cls()


def test_apply_provider_plan(provider_fields):
    provider = _provider_from_real_fields(provider_fields)
    plan = C.provider_plan(
        backend(
            transformer_impl="transformer_engine",
            override_transformer_config={"sequence_parallel": False, "apply_rope_fusion": True},
        ),
        "bfloat16",
    )
    C.apply_provider_plan(provider, plan)
    assert provider.finalized and provider.apply_rope_fusion is True and provider.bf16 is True
    bad = C.provider_plan(
        backend(transformer_impl="transformer_engine", override_transformer_config={"aply_rope_fusion": True}),
        "bfloat16",
    )
    with pytest.raises(
        ConfigError, match=r"backend\.override_transformer_config\.aply_rope_fusion is not a field of GPTModelProvider"
    ):
        C.apply_provider_plan(_provider_from_real_fields(provider_fields), bad)


def test_override_keys_overlapping_backend_keys_rejected():
    with pytest.raises(
        ConfigError,
        match=r"backend\.override_transformer_config\.tensor_model_parallel_size duplicates backend\.tensor_model_parallel_size",
    ):
        check_megatron(lora(), backend(override_transformer_config={"tensor_model_parallel_size": 2}))


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------

MODEL = {"num_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936}  # Qwen2.5-0.5B


def test_defaults_and_real_shapes_pass():
    check_megatron(lora(), backend(), **MODEL, world_size=1)
    check_megatron(
        lora(rank=64),
        backend(tensor_model_parallel_size=2, sequence_parallel=True, transformer_impl="transformer_engine"),
        **MODEL,
        world_size=4,
    )
    check_megatron(
        lora(),
        backend(
            pipeline_model_parallel_size=4,
            recompute_granularity="full",
            recompute_method="block",
            recompute_num_layers=6,
        ),
        **MODEL,
        world_size=8,
    )
    check_megatron(lora(), backend(recompute_granularity="selective"), **MODEL)


# The published Qwen3 dense configs (config.json on the hub): layers, heads, KV heads, vocab.
QWEN3_SHAPES = {
    "qwen3_0_6b": (28, 16, 8),
    "qwen3_1_7b": (28, 16, 8),
    "qwen3_4b": (36, 32, 8),
    "qwen3_8b": (36, 32, 8),
    "qwen3_14b": (40, 40, 8),
    "qwen3_32b": (64, 64, 8),
}


@pytest.mark.parametrize("preset", sorted(QWEN3_SHAPES))
def test_qwen3_presets_launch_lines_pass_megatron_checks(preset):
    """Each Qwen3 preset's documented Megatron launch (its header's `Launch:` line, or TP=2 when
    it shows FSDP) composes and passes every Megatron check against the model's real shape."""
    import shlex

    from lorarl.config.compose import CONF_DIR

    header = (Path(CONF_DIR) / "model" / f"{preset}.yaml").read_text()
    launch = next(line.split("Launch:", 1)[1] for line in header.splitlines() if "Launch:" in line)
    args = [a for a in shlex.split(launch) if "=" in a and a != "recipes.grpo"]
    if "+backend=megatron" not in args:
        args = [a.replace("+backend=fsdp", "+backend=megatron") for a in args]
        args += ["backend.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"]
    run = compose(args)
    layers, heads, kv_heads = QWEN3_SHAPES[preset]
    check_model_shape(run, heads, kv_heads, num_layers=layers, vocab_size=151936)
    assert run.model.path == f"Qwen/Qwen3-{preset.split('_', 1)[1].replace('_', '.').upper()}"
    if preset in ("qwen3_14b", "qwen3_32b"):  # the Megatron-with-TP presets
        assert run.backend.strategy == "megatron" and run.backend.tensor_model_parallel_size >= 4


@pytest.mark.parametrize(
    "lora_kw, backend_kw, model_kw, message",
    [
        (
            {"rank": 6},
            {"tensor_model_parallel_size": 4},
            {},
            r"model\.lora\.rank=6 must be divisible by backend\.tensor_model_parallel_size=4",
        ),
        (
            {},
            {"sequence_parallel": True},
            {},
            r"backend\.sequence_parallel=true needs backend\.tensor_model_parallel_size > 1",
        ),
        (
            {},
            {"sequence_parallel": True, "tensor_model_parallel_size": 2},
            {},
            r"backend\.sequence_parallel=true needs backend\.transformer_impl=transformer_engine",
        ),
        (
            {"merge": True},
            {"bridge": "mbridge", "transformer_impl": "transformer_engine"},
            {},
            r"backend\.bridge=mbridge is not supported \(it cannot export LoRA adapters\); set backend\.bridge=megatron_bridge",
        ),
        ({}, {"bridge": "vanilla"}, {}, r"backend\.bridge='vanilla' is not valid"),
        ({}, {"transformer_impl": "te"}, {}, r"backend\.transformer_impl='te' is not valid"),
        ({}, {"tensor_model_parallel_size": 0}, {}, r"backend\.tensor_model_parallel_size=0 must be an integer >= 1"),
        (
            {"rank": 8},
            {"tensor_model_parallel_size": 4},
            {"num_attention_heads": 14},
            r"does not divide the model's 14 attention heads",
        ),
        (
            {"rank": 8},
            {"tensor_model_parallel_size": 4},
            {"num_attention_heads": 16, "num_key_value_heads": 2},
            r"does not divide the model's 2 key/value heads",
        ),
        (
            {},
            {"pipeline_model_parallel_size": 5},
            {"num_layers": 24},
            r"backend\.pipeline_model_parallel_size=5 does not divide the model's 24 layers",
        ),
        (
            {},
            {"tensor_model_parallel_size": 2},
            {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 101},
            r"vocab_size=101",
        ),
        (
            {},
            {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
            {"world_size": 6},
            r"= 4 must divide the 6 devices",
        ),
        ({}, {"recompute_granularity": "partial"}, {}, r"backend\.recompute_granularity='partial' is not valid"),
        (
            {},
            {"recompute_granularity": "full"},
            {},
            r"backend\.recompute_granularity=full needs backend\.recompute_method",
        ),
        (
            {},
            {"recompute_granularity": "full", "recompute_method": "uniform"},
            {},
            r"needs backend\.recompute_num_layers >= 1",
        ),
        (
            {},
            {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 30},
            {"num_layers": 24},
            r"recompute_num_layers=30 exceeds the 24 layers",
        ),
        (
            {},
            {"recompute_granularity": "selective", "recompute_num_layers": 2},
            {},
            r"selective takes no backend\.recompute_num_layers",
        ),
        ({}, {"recompute_method": "uniform"}, {}, r"need backend\.recompute_granularity=full"),
    ],
)
def test_check_megatron_rejects(lora_kw, backend_kw, model_kw, message):
    with pytest.raises(ConfigError, match=message) as e:
        check_megatron(lora(**lora_kw), backend(**backend_kw), **model_kw)
    assert "\n" not in str(e.value)


def test_recompute_rules_match_megatron_core(src):
    """The combinations we reject are the ones TransformerConfig.__post_init__ raises on."""
    text = (src.mc / "transformer/transformer_config.py").read_text()
    assert 'recompute_method must be "block" or "uniform"' in text
    assert "recompute_num_layers must be None" in text
    assert (
        "Cannot use sequence parallelism without tensor parallelism"
        in (src.mc / "model_parallel_config.py").read_text()
    )
    assert (
        'assert not config.sequence_parallel, f"sequence parallel not supported by torch LayerNorm"'
        in (src.mc / "transformer/torch_norm.py").read_text()
    )


def test_require_cuda_on_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError) as e:
        C.require_cuda()
    assert str(e.value) == "the Megatron backend needs CUDA GPUs (none found); use +backend=fsdp on CPU"


def test_transformer_engine_impl_without_te_is_a_config_error():
    from lorarl.engines.megatron import te_standin

    if te_standin.te_available():
        pytest.skip("TransformerEngine is installed here")
    with pytest.raises(ConfigError, match=r"backend\.transformer_impl=transformer_engine needs TransformerEngine"):
        te_standin.import_megatron_bridge("transformer_engine")
