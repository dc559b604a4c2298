"""The GPU engine only calls what megatron-core 0.19.2 / megatron-bridge 0.6.2 really define.

engine.py cannot run here (no CUDA, and Megatron-Bridge needs Python 3.12 + TransformerEngine),
so this reads it with `ast` and checks, against the released wheels' source, that every
`from megatron... import X` names something that module defines, and that every call into
those packages uses keyword arguments the real signature accepts. It does not show the engine
works; tests/gpu/test_megatron_gpu.py does that on the accelerator machine.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import lorarl.engines.megatron as pkg
from tests.megatron_source import Sources, _signature, sources_or_skip

PKG = Path(pkg.__file__).parent
FILES = ["engine.py", "bridge.py", "config_map.py", "te_standin.py", "experts.py"]


@pytest.fixture(scope="module")
def src(request) -> Sources:
    return sources_or_skip(request)


def _module_file(src: Sources, dotted: str) -> Path | None:
    parts = dotted.split(".")
    for root in src.roots:
        target = root.joinpath(*parts)
        for cand in (target.with_suffix(".py"), target / "__init__.py"):
            if cand.exists():
                return cand
    return None


def _defines(src: Sources, module: Path, name: str, dotted: str) -> bool:
    tree = ast.parse(module.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (a.asname or a.name.split(".")[0]) == name for a in node.names
        ):
            return True
        if isinstance(node, ast.Try):  # guarded imports
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)) and any(
                    (a.asname or a.name) == name for a in sub.names
                ):
                    return True
    # a submodule of a package
    return _module_file(src, f"{dotted}.{name}") is not None


def _imports(path: Path) -> list[tuple[str, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
            out += [(node.module, a.name) for a in node.names]
    return out


def test_every_megatron_import_exists(src):
    seen = []
    for f in FILES:
        for module, name in _imports(PKG / f):
            file = _module_file(src, module)
            assert file is not None, f"{f}: module {module} not in the released wheels"
            assert _defines(src, file, name, module), f"{f}: {module} has no {name}"
            seen.append(f"{module}.{name}")
    # the engine's core dependencies are among what was checked
    for must in ("megatron.core.optimizer.get_megatron_optimizer", "megatron.core.pipeline_parallel.get_forward_backward_func",
                 "megatron.core.tensor_parallel.vocab_parallel_cross_entropy", "megatron.bridge.peft.lora.LoRA",
                 "megatron.bridge.models.gpt_provider.local_layer_spec", "megatron.core.transformer.enums.AttnBackend"):  # fmt: skip
        assert must in seen, must


def _function(path: Path, name: str, class_name: str | None = None) -> inspect.Signature:
    tree = ast.parse(path.read_text())
    body = tree.body
    if class_name:
        (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
        body = cls.body
    (fn,) = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]
    return _signature(fn.args, drop_first=class_name is not None)


def _fields_signature(src: Sources, path: Path, cls: str) -> inspect.Signature:
    P = inspect.Parameter
    return inspect.Signature([P(f, P.KEYWORD_ONLY, default=None) for f in src.api(path, cls).fields])


def _calls(path: Path, callee: str) -> list[ast.Call]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name == callee:
                out.append(node)
    return out


def test_engine_calls_use_real_keywords(src):
    mc, mb = src.mc, src.mb
    sigs: dict[str, list[inspect.Signature]] = {
        "OptimizerConfig": [_fields_signature(src, mc / "optimizer/optimizer_config.py", "OptimizerConfig")],
        "DistributedDataParallelConfig": [
            _fields_signature(
                src, mc / "distributed/distributed_data_parallel_config.py", "DistributedDataParallelConfig"
            )
        ],
        "get_megatron_optimizer": [_function(mc / "optimizer/__init__.py", "get_megatron_optimizer")],
        "initialize_model_parallel": [_function(mc / "parallel_state.py", "initialize_model_parallel")],
        "model_parallel_cuda_manual_seed": [
            _function(mc / "tensor_parallel/random.py", "model_parallel_cuda_manual_seed")
        ],
        "vocab_parallel_cross_entropy": [
            _function(mc / "tensor_parallel/cross_entropy.py", "vocab_parallel_cross_entropy")
        ],
        "gather_from_tensor_model_parallel_region": [
            _function(mc / "tensor_parallel/mappings.py", "gather_from_tensor_model_parallel_region")
        ],
        # the schedule get_forward_backward_func picks: no pipelining, or 1F1B
        "fb": [
            _function(mc / "pipeline_parallel/schedules.py", n)
            for n in ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving")
        ],
        "model": [_function(mc / "models/gpt/gpt_model.py", "forward", "GPTModel")],
        "provide_distributed_model": [
            _function(mb / "models/model_provider.py", "provide_distributed_model", "ModelProviderMixin")
        ],
        "register_pre_wrap_hook": [
            _function(mb / "models/model_provider.py", "register_pre_wrap_hook", "ModelProviderMixin")
        ],
        "to_megatron_provider": [
            src.api(mb / "models/conversion/auto_bridge.py", "AutoBridge").methods["to_megatron_provider"]
        ],
        "from_hf_pretrained": [
            src.api(mb / "models/conversion/auto_bridge.py", "AutoBridge").methods["from_hf_pretrained"]
        ],
        "peft": [_function(mb / "peft/base.py", "__call__", "PEFT")],
        "disable_adapter": [_function(mb / "peft/base.py", "disable_adapter", "PEFT")],
        "set_params_to_save": [_function(mb / "peft/base.py", "set_params_to_save", "PEFT")],
    }
    checked = 0
    for callee, candidates in sigs.items():
        calls = [c for f in FILES for c in _calls(PKG / f, callee)]
        assert calls, f"no call to {callee} found (the table is stale)"
        for call in calls:
            if any(isinstance(a, ast.Starred) for a in call.args):
                continue
            # A `**mapping` is checked where it is built (the model call's `half`, below).
            named = {k.arg: None for k in call.keywords if k.arg is not None}
            for sig in candidates:
                try:
                    sig.bind_partial(*[None] * len(call.args), **named)
                except TypeError as e:
                    pytest.fail(f"{callee}(... line {call.lineno}) does not fit the real signature {sig}: {e}")
            checked += 1
    assert checked >= len(sigs)


def test_parallel_state_and_optimizer_members_exist(src):
    """`self.ps.X` and the optimizer / DDP methods the engine uses are real."""
    engine = ast.parse((PKG / "engine.py").read_text())
    ps_names = {
        n.attr
        for n in ast.walk(engine)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "ps"
    }
    ps_tree = ast.parse((src.mc / "parallel_state.py").read_text())
    defined = {n.name for n in ps_tree.body if isinstance(n, ast.FunctionDef)}
    assert ps_names and ps_names <= defined, ps_names - defined
    opt = src.api(src.mc / "optimizer/optimizer.py", "MegatronOptimizer")
    chained = src.api(src.mc / "optimizer/optimizer.py", "ChainedOptimizer")
    for name in ("step", "zero_grad", "scale_loss"):
        assert name in opt.methods and name in chained.methods, name
    assert "param_groups" in chained.methods  # property on ChainedOptimizer
    assert "param_groups" in (src.mc / "optimizer/optimizer.py").read_text().split("class ChainedOptimizer")[0]
    ddp = src.api(src.mc / "distributed/distributed_data_parallel.py", "DistributedDataParallel")
    assert "zero_grad_buffer" in ddp.methods
    model_cfg = src.api(src.mc / "transformer/transformer_config.py", "TransformerConfig")
    assert {"finalize_model_grads_func", "grad_scale_func"} <= set(model_cfg.fields)


def test_logits_come_back_in_the_models_precision(src):
    """The engine asks Megatron's half-precision wrapper (Float16Module, which Megatron-Bridge
    applies for bf16/fp16) for logits in the model's dtype: the wrapper's default upcast made a
    float32 copy of every position's logits that the loss kept for its backward. GPTModel itself
    has no such keyword, so the engine passes it only when the wrapper is there (not float32)."""
    wrapper = _function(src.mc / "transformer/module.py", "forward", "Float16Module")
    assert wrapper.parameters["fp32_output"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "fp32_output" not in _function(src.mc / "models/gpt/gpt_model.py", "forward", "GPTModel").parameters
    engine = (PKG / "engine.py").read_text()
    assert '{"fp32_output": False} if self.compute_dtype != torch.float32 else {}' in engine
    (call,) = [c for c in _calls(PKG / "engine.py", "model") if any(k.arg == "input_ids" for k in c.keywords)]
    assert any(k.arg is None and ast.unparse(k.value) == "half" for k in call.keywords)
