"""One rollout engine's arguments, assembled once, on the driver.

vLLM has some 250 engine arguments (the fields of vllm.EngineArgs, which `vllm.LLM(**kwargs)`
takes); lorarl sets a few from its own keys (the fields of lorarl.contract.specs.LLMArgs, each
named as vLLM names it) and passes any others as given in rollout.engine_kwargs, as verl's
`rollout.engine_kwargs.vllm` does: the scheduler's `max_num_seqs` and `max_num_batched_tokens`,
`async_scheduling`, `compilation_config` (CUDA-graph sizes and mode), ... A name lorarl sets is
refused when the config is checked, naming the key that sets it (lorarl.config.validate's
SET_BY_LORARL: two spellings of one setting could disagree). Other names are checked against the
installed vLLM before anything starts (`check_known`, run by lorarl.driver.preflight).

`build` (on the driver, by lorarl.driver.prepare; directly in tests and benchmarks) resolves what
depends on the checkpoint and the device and returns the LLMArgs that lorarl.rollout.vllm.engine's
VLLMRollout starts its engine with. This module imports nothing of vLLM, so the driver can use it.
"""

from __future__ import annotations

import os
from typing import Any

from lorarl.config.schema import vllm_lora_rank
from lorarl.config.validate import check_not_set_by_lorarl
from lorarl.contract.specs import LLMArgs
from lorarl.errors import ConfigError
from lorarl.rollout.vllm.dtype import engine_dtype

# Tiny models need little KV cache; several engines may share a 24 GiB host.
DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20


def check_known(engine_kwargs: dict[str, Any], names: frozenset[str], version: str) -> None:
    """ConfigError for the first engine argument that the installed vLLM does not have."""
    import difflib

    for name in engine_kwargs:
        if name not in names:
            close = difflib.get_close_matches(name, sorted(names), n=3)
            hint = f"did you mean {', '.join(close)}?" if close else "see vllm.EngineArgs"
            raise ConfigError(f"rollout.engine_kwargs.{name}: vLLM {version} has no engine argument {name}; {hint}")


def build(
    model_path: str | os.PathLike,
    *,
    lora_rank: int | None,
    on_cpu: bool,
    dtype: str = "auto",
    kv_cache_memory_bytes: int | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    max_loras: int = 1,
    **args: Any,
) -> LLMArgs:
    """A rollout engine's arguments: what depends on the checkpoint and the device resolved here,
    `args` the other fields of LLMArgs by vLLM's names (max_model_len and seed among them).
    `on_cpu`: vLLM's CPU build serves it (the KV cache is then sized in bytes,
    DEFAULT_CPU_KV_CACHE_BYTES unless given, and a float32 checkpoint may keep its dtype with
    LoRA); `dtype` "auto" means the checkpoint's (lorarl.rollout.vllm.dtype); `lora_rank` None: no
    LoRA (merged sync); `max_loras`: the adapters the run trains (a sweep group's, with `lora_rank`
    the largest)."""
    max_lora_rank = None if lora_rank is None else vllm_lora_rank(lora_rank)
    resolved_dtype = engine_dtype(model_path, dtype, on_cpu, lora=max_lora_rank is not None)
    engine_kwargs = dict(engine_kwargs or {})
    check_not_set_by_lorarl(engine_kwargs)
    if kv_cache_memory_bytes is None and on_cpu:
        # On CPU this replaces gpu_memory_utilization, which there reserves a share of host RAM.
        kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
    return LLMArgs(
        model=str(model_path),
        dtype=resolved_dtype,
        max_lora_rank=max_lora_rank,
        max_loras=None if max_lora_rank is None else max_loras,
        lora_rank=lora_rank,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        engine_kwargs=engine_kwargs,
        **args,
    )
