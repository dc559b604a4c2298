"""rollout.engine_kwargs: vLLM engine arguments passed through as vLLM names them.

vLLM has some 250 engine arguments (the fields of vllm.EngineArgs, which `vllm.LLM(**kwargs)`
takes); lorarl sets a few from its own keys and passes any others as given, as verl's
`rollout.engine_kwargs.vllm` does: the scheduler's `max_num_seqs` and `max_num_batched_tokens`,
`async_scheduling`, `compilation_config` (CUDA-graph sizes and mode), ... A key lorarl sets is
refused, naming the key that sets it (two spellings of one setting could disagree). Other names
are checked against the installed vLLM before anything starts (lorarl.driver.preflight).

The one place a rollout engine's arguments are assembled: `build` (on the driver, by
lorarl.driver.prepare; directly in tests and benchmarks) returns the LLMArgs that lorarl.rollout.vllm.engine's
VLLMRollout starts its engine with. This module imports nothing of vLLM, so the driver can use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lorarl.config.schema import vllm_lora_rank
from lorarl.errors import ConfigError
from lorarl.rollout.vllm.dtype import engine_dtype

# Tiny models need little KV cache; several engines may share a 24 GiB host.
DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20

# Engine arguments lorarl sets, and the key that sets each ("" when it is fixed: the reason).
SET_BY_LORARL: dict[str, tuple[str, str]] = {
    "model": ("model.path", ""),
    "tokenizer": ("model.path", ""),
    "dtype": ("rollout.dtype", ""),
    "seed": ("trainer.seed", ""),
    "max_model_len": ("rollout.max_model_len", ""),
    "tensor_parallel_size": ("rollout.tensor_model_parallel_size", ""),
    "enable_expert_parallel": ("rollout.enable_expert_parallel", ""),
    "load_format": ("rollout.load_format", ""),
    "enforce_eager": ("rollout.enforce_eager", ""),
    "enable_sleep_mode": ("rollout.free_cache_engine", ""),
    "gpu_memory_utilization": ("rollout.gpu_memory_utilization", ""),
    "kv_cache_memory_bytes": ("rollout.gpu_memory_utilization", ""),
    "trust_remote_code": ("model.trust_remote_code", ""),
    "enable_lora": ("model.lora.merge", ""),
    "max_lora_rank": ("model.lora.rank", ""),
    "max_loras": ("", "the engine serves one adapter, the policy's"),
    "logprobs_mode": ("", "the trainer compares its log-probs with vLLM's after the temperature"),
    "distributed_executor_backend": ("", "each worker holds its engine in its own process"),
}


def check_not_set_by_lorarl(engine_kwargs: dict[str, Any]) -> None:
    """ConfigError for the first engine argument that lorarl sets from a key of its own."""
    for name in engine_kwargs:
        if name in SET_BY_LORARL:
            key, fixed = SET_BY_LORARL[name]
            raise ConfigError(
                f"rollout.engine_kwargs.{name}: lorarl sets vLLM's {name} from {key}; set {key} instead"
                if key
                else f"rollout.engine_kwargs.{name}: lorarl fixes vLLM's {name} ({fixed}); remove it"
            )


def check_known(engine_kwargs: dict[str, Any], names: frozenset[str], version: str) -> None:
    """ConfigError for the first engine argument that the installed vLLM does not have."""
    import difflib

    for name in engine_kwargs:
        if name not in names:
            close = difflib.get_close_matches(name, sorted(names), n=3)
            hint = f"did you mean {', '.join(close)}?" if close else "see vllm.EngineArgs"
            raise ConfigError(f"rollout.engine_kwargs.{name}: vLLM {version} has no engine argument {name}; {hint}")


def merged(lorarl_kwargs: dict[str, Any], engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM` kwargs: lorarl's, then the user's; a `compilation_config` mapping is merged key
    by key (lorarl sets one of its keys when LoRA is on), with the user's keys winning."""
    check_not_set_by_lorarl(engine_kwargs)
    out = {**lorarl_kwargs, **engine_kwargs}
    ours, theirs = lorarl_kwargs.get("compilation_config"), engine_kwargs.get("compilation_config")
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out["compilation_config"] = {**ours, **theirs}
    return out


def llm_kwargs(
    model_path,
    *,
    dtype: str,
    seed: int,
    max_model_len: int,
    tensor_parallel_size: int,
    enable_expert_parallel: bool,
    load_format: str,
    enforce_eager: bool,
    enable_sleep_mode: bool,
    gpu_memory_utilization: float,
    kv_cache_bytes: int | None,
    trust_remote_code: bool,
    max_lora_rank: int | None,
    engine_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """The `vllm.LLM` kwargs of a rollout engine: what lorarl sets (SET_BY_LORARL), then the
    user's `rollout.engine_kwargs`."""
    kwargs: dict[str, Any] = dict(
        model=str(model_path),
        # Tensor parallel engines are one per process over the caller's process group.
        distributed_executor_backend="external_launcher" if tensor_parallel_size > 1 else None,
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        enable_expert_parallel=enable_expert_parallel,
        load_format=load_format,
        enforce_eager=enforce_eager,
        enable_sleep_mode=enable_sleep_mode,
        gpu_memory_utilization=gpu_memory_utilization,
        trust_remote_code=trust_remote_code,
        # Sampled-token log-probs after temperature, as the trainer computes them (the
        # rollout-mismatch metrics and correction compare the two).
        logprobs_mode="processed_logprobs",
    )
    if kv_cache_bytes is not None:
        # On CPU this replaces gpu_memory_utilization, which there reserves a share of host RAM.
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    if max_lora_rank is not None:
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=max_lora_rank)
        # Every request carries the synced adapter (lora_request), so CUDA graphs for a batch
        # without one would never run: vLLM's V1 model runner then captures only the LoRA
        # ones. Its V2 runner (0.26's on the H200) captures both cases either way (102 graphs
        # per mode there: 51 sizes x [no adapter, adapter]).
        kwargs["compilation_config"] = {"cudagraph_specialize_lora": False}
    return merged(kwargs, engine_kwargs)


@dataclass(frozen=True)
class LLMArgs:
    """One rollout engine's arguments, assembled once (`build`): `kwargs` is what `vllm.LLM`
    takes; the properties read back the few the rollout acts on."""

    kwargs: dict[str, Any]
    lora_rank: int | None  # the adapter's rank (None: no LoRA); vLLM's max_lora_rank is the next it serves

    @property
    def model_path(self) -> str:
        return self.kwargs["model"]

    @property
    def dtype(self) -> str:
        return self.kwargs["dtype"]

    @property
    def max_lora_rank(self) -> int | None:
        return self.kwargs.get("max_lora_rank")

    @property
    def tensor_parallel_size(self) -> int:
        return self.kwargs["tensor_parallel_size"]

    @property
    def enable_sleep_mode(self) -> bool:
        return self.kwargs["enable_sleep_mode"]

    @property
    def load_format(self) -> str:
        return self.kwargs["load_format"]


def build(
    model_path: str | os.PathLike,
    *,
    lora_rank: int | None,
    max_model_len: int,
    seed: int,
    on_cpu: bool,
    dtype: str = "auto",
    gpu_memory_utilization: float = 0.5,
    tensor_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
    load_format: str = "auto",
    enforce_eager: bool = True,
    enable_sleep_mode: bool = False,
    kv_cache_bytes: int | None = None,
    trust_remote_code: bool = False,
    engine_kwargs: dict[str, Any] | None = None,
) -> LLMArgs:
    """A rollout engine's arguments. `on_cpu`: vLLM's CPU build serves it (the KV cache is then
    sized in bytes, DEFAULT_CPU_KV_CACHE_BYTES unless given, and a float32 checkpoint may keep
    its dtype with LoRA); `dtype` "auto" means the checkpoint's (lorarl.rollout.vllm.dtype)."""
    max_lora_rank = None if lora_rank is None else vllm_lora_rank(lora_rank)
    kwargs = llm_kwargs(
        model_path,
        dtype=engine_dtype(model_path, dtype, on_cpu, lora=max_lora_rank is not None),
        seed=seed,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        enable_expert_parallel=enable_expert_parallel,
        load_format=load_format,
        enforce_eager=enforce_eager,
        enable_sleep_mode=enable_sleep_mode,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_bytes=DEFAULT_CPU_KV_CACHE_BYTES if kv_cache_bytes is None and on_cpu else kv_cache_bytes,
        trust_remote_code=trust_remote_code,
        max_lora_rank=max_lora_rank,
        engine_kwargs=engine_kwargs or {},
    )
    return LLMArgs(kwargs, lora_rank)
