"""Import-only stand-in for TransformerEngine, for `backend.transformer_impl=local` without TE.

Megatron-Bridge 0.6.2 imports `transformer_engine.pytorch` at module level
(`megatron/bridge/peft/lora_layers.py`, reached from `from megatron.bridge import AutoBridge`)
and evaluates `te.ops.Sequential` in annotations, although the local layer spec never runs any
TE code. TransformerEngine has no binary wheel on PyPI, so on machines without it this module
lets the import succeed: every attribute is a placeholder class that cannot be instantiated
(calling one raises, so a TE code path can never run silently).

Recipe as measured on an H200:
import megatron-core (and peft) first, so their own optional-TE checks see no TE; install
the stand-in; import Megatron-Bridge; set `megatron.bridge.peft.utils.HAVE_TE = False`.
Used only when the real package is missing and the local spec is chosen.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

STANDIN_VERSION = "0.0.0+lorarl-standin"


class _AbsentMeta(type):
    def __getattr__(cls, name: str):  # noqa: ANN204 - returns a placeholder class
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        raise RuntimeError(
            f"{cls.__qualname__} needs TransformerEngine, which is not installed (an import-only stand-in is loaded); "
            "use backend.transformer_impl=local with its fusions off, or install transformer-engine"
        )


def _absent(qualname: str) -> type:
    return _AbsentMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname, "__module__": "transformer_engine"})


class _AbsentModule(types.ModuleType):
    def __getattr__(self, name: str):  # noqa: ANN204
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent(f"{self.__name__}.{name}")


def te_available() -> bool:
    """True when a real TransformerEngine is importable (not our stand-in)."""
    mod = sys.modules.get("transformer_engine")
    if mod is not None:
        return getattr(mod, "__version__", "") != STANDIN_VERSION
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # noqa: BLE001 - the meta package without extras raises RuntimeError
        return False
    return True


def install() -> None:
    """Put the stand-in into sys.modules after importing what must not see it."""
    if (
        "transformer_engine" in sys.modules
        and sys.modules["transformer_engine"].__dict__.get("__version__") == STANDIN_VERSION
    ):
        return
    # Their optional-TE probes run at import time; they must run against the real (absent) TE.
    for name in (
        "peft",
        "megatron.core",
        "megatron.core.models.gpt.gpt_layer_specs",
        "megatron.core.transformer.transformer_layer",
    ):
        importlib.import_module(name)
    root = _AbsentModule("transformer_engine")
    root.__version__ = STANDIN_VERSION
    pytorch = _AbsentModule("transformer_engine.pytorch")
    pytorch.__version__ = STANDIN_VERSION
    root.pytorch = pytorch
    sys.modules["transformer_engine"] = root
    sys.modules["transformer_engine.pytorch"] = pytorch


def import_megatron_bridge(transformer_impl: str) -> types.ModuleType:
    """`import megatron.bridge`, through the stand-in when TE is missing and the spec is local."""
    if transformer_impl == "local" and not te_available():
        install()
        bridge = importlib.import_module("megatron.bridge")
        # Without this, get_adapter_attributes_from_linear runs isinstance() against TE classes.
        importlib.import_module("megatron.bridge.peft.utils").HAVE_TE = False
        return bridge
    if transformer_impl == "transformer_engine" and not te_available():
        from lorarl.errors import ConfigError

        raise ConfigError(
            "backend.transformer_impl=transformer_engine needs TransformerEngine (pip install 'transformer-engine[pytorch]'); "
            "use backend.transformer_impl=local without it"
        )
    return importlib.import_module("megatron.bridge")


__all__ = ["install", "te_available", "import_megatron_bridge", "STANDIN_VERSION"]
