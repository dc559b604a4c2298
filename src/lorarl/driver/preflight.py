"""Model checks run on the driver before any worker starts; each failure is one ModelError line.

A model is loaded inside Ray workers, seconds to minutes after launch, and a failure there
arrives wrapped in another process's traceback. Everything here reads only config.json,
builds the module tree on the meta device (no weights) and asks vLLM's model registry (once per
architecture and vLLM version), so a wrong model.path, a model that is not a causal LM, an
architecture vLLM cannot serve with LoRA, or LoRA targets that match nothing stop the run at once.
So does a rollout.engine_kwargs name the installed vLLM lacks (its engine arguments are read
once per vLLM version), which vLLM would only report once the worker starts its engine.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

from lorarl.config.run import RunConfig
from lorarl.config.schema import VLLM_LORA_UNSUPPORTED, cache_dir
from lorarl.engines import backend_of
from lorarl.errors import ModelError, first_line
from lorarl.rollout.vllm.engine_args import check_known

# A hub id is "name" or "org/name"; anything else that does not exist is a mistyped local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def load_hf_config(path: str, trust_remote_code: bool):
    """The model's HF config, or a ModelError naming model.path and what to do."""
    from transformers import AutoConfig

    local = Path(os.path.expanduser(path))
    if not local.exists() and not _HUB_ID.match(path):
        raise ModelError(
            f"model.path={path!r} does not exist; point it at a local HF model folder (config.json + *.safetensors) "
            "or a hub id such as Qwen/Qwen2.5-0.5B-Instruct"
        )
    if local.is_dir() and not (local / "config.json").is_file():
        raise ModelError(
            f"model.path={path!r} has no config.json; point it at a HF model folder (config.json + *.safetensors)"
        )
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        if "trust_remote_code" in str(err):
            raise ModelError(
                f"model.path={path!r} ships its own Python code (auto_map in config.json), which lorarl does not run "
                "unless model.trust_remote_code=true; read that code first, or use a model transformers supports natively"
            ) from None
        raise ModelError(
            f"model.path={path!r} could not be read as a HF model config ({first_line(err)}); "
            "check the hub id and the network, or point it at a local model folder"
        ) from None


def check_causal_lm(path: str, hf_cfg: Any) -> list[str]:
    """The config's architectures, if they name a causal LM (GRPO samples text from it)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    archs = list(getattr(hf_cfg, "architectures", None) or [])
    if not archs:
        default = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_cfg.model_type)
        if default is None:
            raise ModelError(
                f"model.path={path!r}: model_type {hf_cfg.model_type!r} has no causal LM in transformers; "
                "GRPO needs a decoder-only model such as Qwen/Qwen2.5-0.5B-Instruct"
            )
        return [default]
    if not any(a in causal or a.endswith("ForCausalLM") for a in archs):
        raise ModelError(
            f"model.path={path!r} is a {'/'.join(archs)}, not a causal language model; "
            "GRPO needs a decoder-only model (*ForCausalLM) such as Qwen/Qwen2.5-0.5B-Instruct"
        )
    return archs


@functools.cache
def _vllm_version() -> str | None:
    """The installed vLLM's version (one scan of the installed packages per process)."""
    from importlib import metadata

    for dist in metadata.packages_distributions().get("vllm", []):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


# Asked in a child process: importing vLLM sets torch and environment state the driver should
# not inherit, and a model module may touch the GPU. Each prints one line: its answer.
_VLLM_LORA_PROBE = """
import sys
from vllm.model_executor.models import ModelRegistry
from vllm.model_executor.models.interfaces import supports_lora
arch = sys.argv[1]
cls = ModelRegistry._try_load_model_cls(arch) if arch in ModelRegistry.get_supported_archs() else None
print("unknown" if cls is None else ("yes" if supports_lora(cls) else "no"))
"""
_VLLM_ENGINE_ARGS_PROBE = """
import dataclasses, json
from vllm.engine.arg_utils import EngineArgs
print(json.dumps(sorted(f.name for f in dataclasses.fields(EngineArgs))))
"""


def _ask_vllm(cache_name: str, question: str, script: str, *argv: str, parse):
    """`parse` of the probe's last line, or None when vLLM is not installed or the probe failed.
    Asking costs a process that imports vLLM (seconds), so answers are kept per vLLM version in
    the lorarl cache (`cache_name`, keyed "<version>/<question>")."""
    import subprocess
    import sys

    version = _vllm_version()
    if version is None:
        return None
    cache = Path(cache_dir()) / cache_name
    key = f"{version}/{question}"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore"}
    try:
        probe = subprocess.run(
            [sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=600, env=env
        )
    except subprocess.TimeoutExpired:
        return None
    lines = probe.stdout.strip().splitlines() if probe.returncode == 0 else []
    try:
        answer = parse(lines[-1]) if lines else None
    except ValueError:
        answer = None
    if answer is None:
        return None  # the probe itself failed; vLLM reports any real problem when it starts
    known[key] = answer
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only cache only costs the next run the same question
    return answer


def vllm_supports_lora(arch: str) -> bool | None:
    """Whether vLLM's own implementation of `arch` serves LoRA adapters.

    None when vLLM has no implementation of its own (it then tries its Transformers backend and
    decides at load time) or its registry cannot be read.
    """
    verdicts = {"yes": True, "no": False, "unknown": "unknown"}

    def parse(line: str):
        if line not in verdicts:
            raise ValueError(line)
        return verdicts[line]

    answer = _ask_vllm("vllm_lora_support.json", arch, _VLLM_LORA_PROBE, arch, parse=parse)
    return answer if isinstance(answer, bool) else None


def vllm_engine_arg_names() -> list[str] | None:
    """The installed vLLM's engine arguments (vllm.EngineArgs fields), or None."""

    def parse(line: str) -> list[str]:
        names = json.loads(line)
        if not isinstance(names, list):
            raise ValueError(line)
        return names

    return _ask_vllm("vllm_engine_args.json", "EngineArgs", _VLLM_ENGINE_ARGS_PROBE, parse=parse)


def check_vllm_lora(path: str, archs: list[str]) -> None:
    for arch in archs:
        if vllm_supports_lora(arch) is False:
            raise ModelError(
                f"model.path={path!r}: vLLM serves {arch} but not with LoRA adapters; "
                "set model.lora.merge=true (push merged weights every step) or use a model vLLM supports with LoRA (Qwen2/Qwen3, Llama, ...)"
            )


def _peft_matches(module_name: str, target: str) -> bool:
    # PEFT's rule for a list of target names: the full name or its dotted suffix.
    return module_name == target or module_name.endswith(f".{target}")


def check_lora_targets(path: str, hf_cfg: Any, targets: list[str], trust_remote_code: bool = False) -> None:
    """Every name in model.lora.target_modules matches at least one linear layer of the model.

    PEFT fails only when no name matches; a single typo among seven names would silently
    train fewer projections, so each name is checked.
    """
    if targets == ["all-linear"]:
        return
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg, trust_remote_code=trust_remote_code)
    modules = dict(model.named_modules())
    linear = sorted(
        {n.split(".")[-1] for n, m in modules.items() if isinstance(m, torch.nn.Linear)} - set(VLLM_LORA_UNSUPPORTED)
    )
    for target in targets:
        hits = [m for n, m in modules.items() if n and _peft_matches(n, target)]
        if not hits:
            raise ModelError(
                f"model.lora.target_modules: {target!r} matches no module of {type(model).__name__} at {path}; "
                f"its linear layers are {','.join(linear)} (or use [all-linear])"
            )
        if not any(isinstance(m, torch.nn.Linear) for m in hits):
            raise ModelError(
                f"model.lora.target_modules: {target!r} names {type(hits[0]).__name__} modules, not linear layers; "
                f"LoRA goes on {','.join(linear)}"
            )


def check_weights_format(path: str) -> None:
    """A local model folder holds safetensors weights: lorarl never unpickles .bin/.pt files."""
    local = Path(os.path.expanduser(path))
    if not local.is_dir():
        return  # a hub id: transformers fetches safetensors (use_safetensors=True when loading)
    if not any(local.glob("*.safetensors")):
        pickled = sorted(p.name for p in local.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        found = f" (found {', '.join(pickled[:3])}: pickle files, which can run code when loaded)" if pickled else ""
        raise ModelError(
            f"model.path={path!r} has no *.safetensors weights{found}; convert the checkpoint to safetensors "
            "(model.save_pretrained(dir, safe_serialization=True)) and point model.path at it"
        )


def check_engine_kwargs(run: RunConfig) -> None:
    """Every rollout.engine_kwargs name is an engine argument of the installed vLLM."""
    kwargs = run.rollout.engine_kwargs
    names = vllm_engine_arg_names() if kwargs else None
    if names is not None:
        check_known(kwargs, frozenset(names), _vllm_version() or "")


def check_model(run: RunConfig):
    """All model checks that need only the config; returns the HF config."""
    m = run.model
    hf_cfg = load_hf_config(m.path, m.trust_remote_code)
    archs = check_causal_lm(m.path, hf_cfg)
    if not m.lora.merge:
        check_vllm_lora(m.path, archs)
    if backend_of(run.backend.strategy).checks_hf_lora_targets:
        check_lora_targets(m.path, hf_cfg, list(m.lora.target_modules), m.trust_remote_code)
    check_weights_format(m.path)
    return hf_cfg


def load_tokenizer(run: RunConfig):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(run.model.path, trust_remote_code=run.model.trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelError(
            f"model.path={run.model.path!r}: its tokenizer could not be loaded ({first_line(err)}); "
            "the folder needs tokenizer.json/tokenizer_config.json beside the weights"
        ) from None


__all__ = [
    "check_causal_lm",
    "check_lora_targets",
    "check_model",
    "check_vllm_lora",
    "check_weights_format",
    "load_hf_config",
    "load_tokenizer",
    "vllm_supports_lora",
]
