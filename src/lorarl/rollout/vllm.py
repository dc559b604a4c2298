"""In-process vLLM engine for rollouts, and the receiving end of weight sync.

The rollout owns one fact, `base_loaded` ("the base weights are in the engine"),
set by loading from disk or by a base payload and cleared by a sleep that discards
weights. Whether an adapter may be applied, and which sleep level to use, read it;
it is never inferred from vLLM, which still lists an adapter after `sleep(level=2)`
has dropped the base weights under it.
"""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from lorarl.errors import ConfigError, SyncError
from lorarl.sync import PayloadKind, SyncStats, WeightPayload, vllm_lora_rank

# One adapter slot, one fixed id, replaced in place on every sync: with a new id
# per sync, requests could keep naming an old one; with the same id and no
# in-place flag, vLLM keeps the adapter it already holds.
ADAPTER_ID = 1
ADAPTER_NAME = "lorarl-policy"
# Never read while the adapter is resident; named so an eviction fails loudly.
_MEMORY_ADAPTER_PATH = "/nonexistent/lorarl-in-memory-adapter"
# Tiny models need little KV cache; several engines may share a 24 GiB host.
DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20

AdapterTransport = Literal["tmpfs", "memory"]


@dataclass
class Samples:
    """Per prompt, `n` responses: token ids and the log-prob of each sampled token.

    Log-probs are vLLM's default "raw" ones: from the model's logits before
    temperature and top-p, i.e. what the trainer computes for the same tokens.
    """

    token_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]


class VLLMRollout:
    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        lora_rank: int | None,
        max_model_len: int,
        seed: int,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        load_format: str = "auto",
        enforce_eager: bool = True,
        enable_sleep_mode: bool = False,
        adapter_transport: AdapterTransport = "tmpfs",
        kv_cache_bytes: int | None = None,
        max_num_seqs: int | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        if adapter_transport not in ("tmpfs", "memory"):
            raise ConfigError(f"rollout.adapter_transport={adapter_transport!r}; choose 'tmpfs' or 'memory'")
        # The engine must live in this process: weights are pushed into its worker
        # by reference (reload_weights with an iterator, adapters from tensors).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        from vllm.platforms import current_platform

        self._is_cpu = current_platform.is_cpu()
        if enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise ConfigError(
                "rollout.enable_sleep_mode=true but this vLLM build has no sleep mode (CPU); set it to false"
            )
        self.lora_rank = lora_rank
        self.max_lora_rank = None if lora_rank is None else vllm_lora_rank(lora_rank)
        self.dtype = self._engine_dtype(model_path, dtype)  # what the engine computes in
        self.adapter_transport: AdapterTransport = adapter_transport
        self.enable_sleep_mode = enable_sleep_mode
        self.base_loaded = load_format != "dummy"
        self._adapter: tuple[dict[str, Tensor], dict] | None = None  # memory transport's copy
        self._adapter_dir: Path | None = None
        self._param_names: frozenset[str] | None = None  # read from the live engine on first need
        self._has_adapter = False
        self._asleep = False

        kwargs: dict = dict(
            model=str(model_path),
            dtype=self.dtype,
            seed=seed,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            load_format=load_format,
            enforce_eager=enforce_eager,
            enable_sleep_mode=enable_sleep_mode,
            gpu_memory_utilization=gpu_memory_utilization,
            trust_remote_code=trust_remote_code,
        )
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = max_num_seqs
        if kv_cache_bytes is None and self._is_cpu:
            kv_cache_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        if kv_cache_bytes is not None:
            # On CPU this replaces gpu_memory_utilization, which there reserves a share of host RAM.
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
        if self.max_lora_rank is not None:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=self.max_lora_rank)

        _first_engine_in_process()
        with _process_state_kept():
            self._llm = LLM(**kwargs)
        if self.lora_enabled and adapter_transport == "tmpfs":
            shm = Path("/dev/shm")
            root = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
            self._adapter_dir = Path(tempfile.mkdtemp(prefix="lorarl-adapter-", dir=root))
        self._release = _adopt_engine(self, self._llm, self._adapter_dir)

    def _engine_dtype(self, model_path: str | os.PathLike, dtype: str) -> str:
        resolved = _resolve_dtype(model_path, dtype)
        if self._is_cpu or self.max_lora_rank is None or resolved != "float32":
            return resolved
        # vLLM's GPU LoRA kernels (punica, Triton) take 16-bit activations only.
        if dtype == "auto":
            return "bfloat16"
        raise ConfigError(
            "rollout.dtype=float32: vLLM's GPU LoRA kernels run in float16/bfloat16 only; set rollout.dtype=bfloat16 "
            "(training keeps model.dtype) or model.lora.merge=true"
        )

    # ------------------------------------------------------------------ state
    @property
    def lora_enabled(self) -> bool:
        return self.max_lora_rank is not None

    @property
    def has_adapter(self) -> bool:
        """An adapter payload was applied; every request carries it from then on."""
        return self._has_adapter

    @property
    def sleep_level(self) -> int:
        # Read from the one state: a loaded base that only adapters will update must survive
        # the sleep (level 1, kept in host RAM); merged mode resends the base every step, and
        # a base not loaded yet (dummy load) is not worth keeping (level 2).
        return 1 if self.lora_enabled and self.base_loaded else 2

    def num_adapters(self) -> int:
        if not self.lora_enabled:
            return 0  # vLLM raises on list_loras without LoRA
        return len(self._engine().llm_engine.list_loras())

    # ------------------------------------------------------------- generation
    def sample(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 64,
        seed: int | None = None,
    ) -> Samples:
        from vllm import SamplingParams

        # vLLM 0.32 on CPU crashes on seeded requests whose prefill gets chunked ("CPU
        # Generator does not use offset", seen at 50 prompts x 8 samples). There the call
        # samples from the process RNG instead, seeded for this call and restored after.
        process_seed = seed if self._is_cpu else None
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens,
                # Distinct streams per prompt, independent of how vLLM batches them.
                seed=None if seed is None or process_seed is not None else seed + i,
                logprobs=0,
                detokenize=False,
            )
            for i in range(len(prompt_ids))
        ]
        requests = [{"prompt_token_ids": list(p)} for p in prompt_ids]
        with torch.random.fork_rng(devices=[], enabled=process_seed is not None):
            if process_seed is not None:
                torch.manual_seed(process_seed)
            outs = self._engine().generate(requests, params, lora_request=self._lora_request(), use_tqdm=False)
        tokens, logprobs = [], []
        for out in outs:
            tokens.append([list(c.token_ids) for c in out.outputs])
            logprobs.append([[step[t].logprob for step, t in zip(c.logprobs or [], c.token_ids)] for c in out.outputs])
        return Samples(tokens, logprobs)

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 64,
        seed: int | None = None,
    ) -> list[list[list[int]]]:
        return self.sample(prompt_ids, n, temperature, top_p, max_tokens, seed).token_ids

    def prompt_logprobs(self, token_ids: Sequence[int], start: int) -> list[float]:
        """Log-probs vLLM gives token_ids[start:] after their prefix (adapter attached)."""
        from vllm import SamplingParams

        if not 1 <= start < len(token_ids):
            raise ValueError(f"start={start} must lie in 1..{len(token_ids) - 1}")
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        out = self._engine().generate(
            [{"prompt_token_ids": list(token_ids)}],
            params,
            lora_request=self._lora_request(),
            use_tqdm=False,
        )[0]
        return [out.prompt_logprobs[i][token_ids[i]].logprob for i in range(start, len(token_ids))]

    # ------------------------------------------------------------------- sync
    def apply(self, payload: WeightPayload) -> SyncStats:
        if not isinstance(payload, WeightPayload):
            raise SyncError(f"rollout.apply needs a WeightPayload, got {type(payload).__name__}")
        if self._asleep:
            raise SyncError("the rollout engine is asleep; call wake_up(['weights']) before a sync")
        if payload.kind is PayloadKind.BASE:
            stats = self._apply_base(payload)
        else:
            stats = self._apply_adapter(payload)
        self.reset_prefix_cache()  # cached KV was computed with the old weights
        return stats

    def reset_prefix_cache(self) -> None:
        self._engine().reset_prefix_cache()

    def _apply_base(self, payload: WeightPayload) -> SyncStats:
        stats = SyncStats(PayloadKind.BASE)

        def counted() -> Iterator[tuple[str, Tensor]]:
            for name, tensor in payload.tensors:
                stats.num_tensors += 1
                stats.bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        start = time.perf_counter()
        # A failure part-way leaves some layers old and some new: whatever the cause,
        # the engine no longer holds a known base until a full base payload succeeds.
        self.base_loaded = False
        try:
            # reload_weights, not load_weights: on CPU vLLM re-packs linear weights into
            # its GEMM layout and leaves empty placeholders, so raw parameter writes land
            # nowhere; the reload path re-runs that processing, with or without LoRA.
            live = self._live_param_names()
            resolved = ((resolve_base_name(name, live), tensor) for name, tensor in counted())
            self._engine().collective_rpc("reload_weights", kwargs={"weights_iterator": resolved})
        except Exception as exc:
            # Close vLLM's half-done reload so the next base payload starts clean (without
            # this, a second failed sync in a row wedged every later reload).
            self._engine().collective_rpc(_finish_interrupted_reload)
            if isinstance(exc, SyncError):
                raise
            raise SyncError(f"vLLM could not load the base payload: {_short(exc)}") from exc
        stats.load_s = time.perf_counter() - start
        if stats.num_tensors == 0:
            raise SyncError("base payload was empty; nothing was loaded into the engine")
        self.base_loaded = True
        if self.has_adapter:
            # vLLM drops every adapter when base weights are replaced; put ours back.
            stats.load_s += self._load_adapter()
        return stats

    def _live_param_names(self) -> frozenset[str]:
        """Parameter names that need `.base_layer` spelled out (empty where the engine's
        LoRA wrappers load plain HF names themselves), read once from the live model."""
        if self._param_names is None:
            self._param_names = frozenset(self._engine().collective_rpc(_wrapped_param_names)[0])
        return self._param_names

    def _apply_adapter(self, payload: WeightPayload) -> SyncStats:
        if not self.lora_enabled:
            raise SyncError(
                "adapter payload sent to a rollout started without LoRA (merged mode); "
                "send merged weights as a base payload or set model.lora.rank for vLLM"
            )
        if not self.base_loaded:
            raise SyncError("base weights are not in the engine; send a base payload first")
        assert payload.adapter_config is not None
        if payload.max_rank > self.max_lora_rank:
            raise SyncError(
                f"adapter rank {payload.max_rank} exceeds the engine's max_lora_rank "
                f"{self.max_lora_rank}; start the rollout with model.lora.rank >= {payload.max_rank}"
            )
        stats = SyncStats(PayloadKind.ADAPTER)
        start = time.perf_counter()
        # Copy out: the receiver owns its tensors, so a trainer (or a reused transfer
        # buffer) writing in place cannot change the adapter vLLM serves.
        owned = {}
        for name, tensor in payload.tensors:
            owned[name] = tensor.detach().to("cpu", copy=True).contiguous()
            stats.num_tensors += 1
            stats.bytes += tensor.numel() * tensor.element_size()
        if self.adapter_transport == "tmpfs":
            from lorarl.checkpoint import save_peft_adapter

            assert self._adapter_dir is not None
            save_peft_adapter(self._adapter_dir, owned, payload.adapter_config)
            self._adapter = None
        else:
            self._adapter = (owned, dict(payload.adapter_config))
        stats.transfer_s = time.perf_counter() - start
        stats.load_s = self._load_adapter()
        self._has_adapter = True
        return stats

    def _load_adapter(self) -> float:
        """Put the current adapter into the engine under ADAPTER_ID, replacing any old one."""
        start = time.perf_counter()
        engine = self._engine()
        try:
            if self.adapter_transport == "tmpfs":
                from vllm.lora.request import LoRARequest

                request = LoRARequest(ADAPTER_NAME, ADAPTER_ID, str(self._adapter_dir), load_inplace=True)
                engine.llm_engine.add_lora(request)
            else:
                assert self._adapter is not None
                kept, config = self._adapter
                # vLLM scales lora_B in place while building its LoRAModel: hand it a copy
                # so the kept one stays as sent (re-attaching it doubled the scaling).
                tensors = {name: t.clone() for name, t in kept.items()}
                engine.collective_rpc(_add_adapter_from_tensors, args=(ADAPTER_ID, tensors, config))
        except Exception as exc:
            raise SyncError(f"vLLM rejected the adapter: {_short(exc)}") from exc
        loaded = engine.llm_engine.list_loras()
        if loaded != {ADAPTER_ID}:
            raise SyncError(f"after the adapter sync vLLM holds adapters {sorted(loaded)}, expected only {ADAPTER_ID}")
        return time.perf_counter() - start

    def _lora_request(self):
        if not self.has_adapter:
            return None
        from vllm.lora.request import LoRARequest

        # Without load_inplace: a request must use the resident adapter, not reload it.
        path = str(self._adapter_dir) if self.adapter_transport == "tmpfs" else _MEMORY_ADAPTER_PATH
        return LoRARequest(ADAPTER_NAME, ADAPTER_ID, path)

    # ------------------------------------------------------------------ sleep
    def sleep(self, level: int | None = None) -> None:
        if not self.enable_sleep_mode:
            raise ConfigError("rollout.enable_sleep_mode is false; this engine cannot sleep")
        level = self.sleep_level if level is None else level
        if level not in (1, 2):
            raise ConfigError(f"sleep level {level} is not 1 or 2")
        self._engine().sleep(level=level)
        self._asleep = True
        if level == 2:
            self.base_loaded = False  # level 2 discards weights; the adapter listing lies

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._engine().wake_up(tags)
        if tags is None or "weights" in tags:
            self._asleep = False
            if self.lora_enabled:
                self.refresh_lora_mapping()
        self._engine().reset_prefix_cache()

    def refresh_lora_mapping(self) -> None:
        """Make vLLM rewrite its per-batch LoRA index tensors before the next forward.

        They live in the weights memory pool, so a level-2 sleep discards them, and vLLM only
        rewrites them when a batch's LoRA mapping differs from the last one: the same probe
        sequence after a level-2 sleep then ran with garbage indices (H200, vLLM 0.26: log-prob
        off by 0.3-2.6 while every weight was right)."""
        self._engine().collective_rpc(_forget_lora_mapping)

    # --------------------------------------------------------------- teardown
    def shutdown(self) -> None:
        """Free the engine (and its adapter folder); safe to call twice."""
        self._llm = None
        self._adapter = None
        self._has_adapter = False
        release = getattr(self, "_release", None)
        if release is not None:
            release()

    def __enter__(self) -> VLLMRollout:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _engine(self):
        if self._llm is None:
            raise SyncError("the rollout engine was shut down; build a new VLLMRollout")
        return self._llm


def _short(exc: BaseException, limit: int = 300) -> str:
    """One line: vLLM's messages can list every parameter of the model."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + " ..."


def _resolve_dtype(model_path: str | os.PathLike, dtype: str) -> str:
    """'auto' means the checkpoint's dtype, as in transformers.

    vLLM's own 'auto' serves float32 checkpoints in 16-bit: the tiny fp32 model then
    disagreed with the fp32 trainer by up to 0.04 in per-token log-prob (6e-5 in fp32).
    """
    if dtype != "auto":
        return dtype
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return dtype
    try:
        saved = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError):
        return dtype
    return "float32" if saved.get("dtype", saved.get("torch_dtype")) == "float32" else dtype


# vLLM fuses these HF projections into one parameter; with LoRA enabled it wraps the fused
# linear and (depending on the version) keeps its weight under `.base_layer`.
_FUSED_INTO = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "o_proj": "o_proj",
    "down_proj": "down_proj",
}


def resolve_base_name(name: str, live: frozenset[str]) -> str:
    """The name vLLM's loader needs for plain HF weight `name`, decided by the live engine:
    `.base_layer` goes in only where the live model keeps the wrapped linear's weight there."""
    module, _, leaf = name.rpartition(".")
    prefix, _, proj = module.rpartition(".")
    fused = _FUSED_INTO.get(proj)
    if fused is None or leaf not in ("weight", "bias"):
        return name
    if f"{prefix}.{fused}.base_layer.{leaf}" in live:
        return f"{module}.base_layer.{leaf}"
    return name


def _vllm_worker(worker):
    """collective_rpc hands functions vLLM's worker, sometimes inside a wrapper; the worker."""
    return getattr(worker, "worker", worker)


def _wrapped_param_names(worker) -> list[str]:
    """Live names under `.base_layer` whose LoRA wrapper cannot take the plain HF name.

    vLLM 0.26 (GPU) wrappers have no loader of their own, so `q_proj.weight` must arrive as
    `q_proj.base_layer.weight`; vLLM 0.32's wrappers define `load_weights` and forward to the
    wrapped layer, so plain names are right there and `.base_layer` ones fail."""
    model = _vllm_worker(worker).model_runner.get_model()
    out = []
    for module_name, module in model.named_modules():
        base = getattr(module, "_modules", {}).get("base_layer")
        if (
            base is None
            or "load_weights" in type(module).__dict__
            or any("load_weights" in c.__dict__ for c in type(module).__mro__[1:] if c.__name__.endswith("WithLoRA"))
        ):
            continue
        out += [f"{module_name}.base_layer.{n}" for n, _ in base.named_parameters(recurse=False)]
    return out


def _forget_lora_mapping(worker) -> None:
    """Inside the vLLM worker: drop the LoRA manager's memory of the last batch mapping."""
    manager = getattr(_vllm_worker(worker).model_runner, "lora_manager", None)
    adapters = getattr(manager, "_adapter_manager", None)
    if adapters is None or not hasattr(adapters, "_last_mapping"):
        raise SyncError(
            "this vLLM's LoRA manager has no _last_mapping; lorarl cannot make it refresh its LoRA indices after a sleep"
        )
    adapters._last_mapping = None


def _finish_interrupted_reload(worker) -> None:
    """Runs inside the vLLM worker after reload_weights raised part-way (vLLM 0.32 internals)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    worker = _vllm_worker(worker)
    runner = worker.model_runner
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(runner.get_model(), runner.model_config)


def lora_name_mapper(mapper):
    """The model's HF->vLLM name mapper as vLLM's own adapter loader uses it: renames kept,
    fused-projection maps dropped (so `q_proj` survives for the LoRA manager to pack).
    vLLM 0.32 calls that variant get_rename_mapper, 0.26 get_unstacked_mapper."""
    if mapper is None:
        return None
    for variant in ("get_rename_mapper", "get_unstacked_mapper"):
        if hasattr(mapper, variant):
            return getattr(mapper, variant)()
    raise SyncError(
        f"this vLLM's {type(mapper).__name__} has neither get_rename_mapper nor get_unstacked_mapper; "
        "use rollout.adapter_transport=tmpfs"
    )


def _add_adapter_from_tensors(worker, lora_id: int, tensors: dict[str, Tensor], config: dict) -> None:
    """Runs inside the vLLM worker: vLLM's adapter loading minus the directory read.

    Mirrors LRUCacheWorkerLoRAManager._load_adapter + add_adapter (vLLM 0.26 and 0.32);
    these are internals, so a vLLM upgrade may need this revisited (tmpfs needs none).
    """
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = _vllm_worker(worker).model_runner.lora_manager
    adapters = manager._adapter_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = adapters.model
    mapper = lora_name_mapper(getattr(model, "hf_to_vllm_mapper", None))
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id,
        tensors=tensors,
        peft_helper=helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    adapters.remove_adapter(lora_id)
    adapters.add_adapter(lora)
    adapters.activate_adapter(lora_id)


# vLLM keeps its parallel groups in process globals shared by every in-process
# engine, and an engine's shutdown tears them down (and torch.distributed with them).
# Count live engines so only the last one cleans up, and never destroy a process
# group that the caller (a trainer) created before the first engine.
_live_engines = 0
_caller_owns_torch_dist = False


def _first_engine_in_process() -> None:
    global _caller_owns_torch_dist
    if _live_engines == 0:
        _caller_owns_torch_dist = torch.distributed.is_available() and torch.distributed.is_initialized()


def _adopt_engine(owner: VLLMRollout, llm, adapter_dir: Path | None):
    global _live_engines
    _live_engines += 1
    client = llm.llm_engine.engine_core
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()  # ours below replaces it, so teardown always goes through _release_engine
    return weakref.finalize(owner, _release_engine, llm, adapter_dir)


def _release_engine(llm, adapter_dir: Path | None) -> None:
    global _live_engines
    _live_engines -= 1
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # InprocClient -> EngineCore
    if core is not None:
        import vllm.v1.engine.core as core_module

        full_cleanup = core_module.cleanup_dist_env_and_memory

        def cleanup(shutdown_ray: bool = False) -> None:
            if _live_engines > 0:
                return
            if _caller_owns_torch_dist:
                from vllm.distributed.parallel_state import destroy_model_parallel

                destroy_model_parallel()
                return
            full_cleanup(shutdown_ray)

        core_module.cleanup_dist_env_and_memory = cleanup
        try:
            core.shutdown()
        finally:
            core_module.cleanup_dist_env_and_memory = full_cleanup
    del llm, core
    gc.collect()
    if adapter_dir is not None:
        shutil.rmtree(adapter_dir, ignore_errors=True)


class _process_state_kept:
    """Undo what building an in-process vLLM engine does to the host process.

    vLLM seeds the global RNGs with the rollout seed and, on CPU, replaces
    torch.set_num_threads with a no-op; a trainer sharing the process keeps its own.
    """

    def __enter__(self) -> None:
        import numpy as np

        self._np = np.random.get_state()
        self._py = random.getstate()
        self._torch = torch.random.get_rng_state()
        self._set_threads = torch.set_num_threads
        self._threads = torch.get_num_threads()

    def __exit__(self, *exc) -> None:
        import numpy as np

        np.random.set_state(self._np)
        random.setstate(self._py)
        torch.random.set_rng_state(self._torch)
        torch.set_num_threads = self._set_threads
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
