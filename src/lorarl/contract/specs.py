"""What a worker is given: typed, frozen specs, built once on the driver by lorarl.driver.prepare.

The run config (lorarl.config.run.RunConfig) stays on the driver; a worker receives a
WorkerSpec and nothing else of the configuration. Each part goes to the one object that reads
it: the training engine its EngineSpec, the vLLM rollout its engine arguments (already
assembled, lorarl.rollout.vllm.engine_args), the rollout's sleep its SleepSpec, the weight sync
its SyncSpec. Every check that the driver can make has been made when a spec exists
(lorarl.driver.prepare); a worker checks only what needs its device in hand: whether vLLM's build can
sleep (lorarl.rollout.vllm.engine), CUDA for Megatron, the device memory the sleep plan measures.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields
from typing import Any

from lorarl.config.algorithm import RolloutCorrectionConfig
from lorarl.config.backends import FSDPBackendConfig, MegatronBackendConfig
from lorarl.config.schema import ActorConfig, LoraConfig, ModelConfig


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter the engine trains: its name in the model (PEFT's adapter name), its LoRA
    shape, and its actor group (optimizer, clipping, loss). A run trains one; a sweep's group
    trains one per job over one base (lorarl.engines.adapter_routing)."""

    name: str
    lora: LoraConfig
    actor: ActorConfig
    label: str  # how messages name it: "the adapter", or the sweep job it belongs to
    sync_fault: str | None = None  # trainer.sync_fault of its run: a test fault in this adapter's export


@dataclass(frozen=True)
class EngineSpec:
    """The training engine: its three config groups, the class that implements the backend,
    the seed, and Liger's kernels resolved for the device (lorarl.engines.liger). `model` and
    `actor` hold what every adapter shares (the base, the batch shape); each adapter's own LoRA
    shape and actor settings are in `adapters`."""

    model: ModelConfig
    actor: ActorConfig
    backend: FSDPBackendConfig | MegatronBackendConfig
    engine: str  # "module:Class" implementing lorarl.contract.engine.Engine (lorarl.engines.BACKENDS)
    seed: int  # trainer.seed: Megatron's model-parallel RNG; FSDP's LoRA init draws from the worker's
    liger_kernel: bool  # FSDP only: Liger's kernels patched into the model
    adapters: tuple[AdapterSpec, ...]  # the first is the run's own (model.lora, actor)

    def engine_class(self) -> type:
        module, name = self.engine.split(":")
        return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class LLMArgs:
    """One vLLM engine's arguments, assembled once on the driver (lorarl.rollout.vllm.engine_args.build).

    Every field but lora_rank and engine_kwargs is the `vllm.LLM` argument of that name, as lorarl
    sets it from one of its keys (lorarl.driver.prepare.rollout_args sets each;
    lorarl.config.validate.SET_BY_LORARL names the key); `lora_rank` is the adapter's own rank and
    `engine_kwargs` the user's other arguments (rollout.engine_kwargs). `kwargs` is what `vllm.LLM`
    takes. The defaults are what a test or a benchmark gets when it names no value."""

    model: str  # model.path
    dtype: str  # resolved: the checkpoint's where rollout.dtype=auto
    seed: int
    max_model_len: int
    max_lora_rank: int | None  # the smallest rank vLLM serves that holds lora_rank (None: no LoRA)
    # LoRA slots: one per adapter the run trains (a sweep group's jobs), so vLLM never evicts one
    # (None: no LoRA).
    max_loras: int | None
    lora_rank: int | None
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    load_format: str = "auto"
    enforce_eager: bool = True
    enable_sleep_mode: bool = False
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_bytes: int | None = None  # on CPU, in place of gpu_memory_utilization (None: not passed)
    trust_remote_code: bool = False
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def kwargs(self) -> dict[str, Any]:
        """The `vllm.LLM` keyword arguments: the fields above, the ones lorarl fixes, then the user's."""
        # An argument left unset (None: no LoRA, no KV cache size in bytes) is not passed: vLLM's default.
        not_vllms = ("lora_rank", "engine_kwargs")
        ours = {f.name: v for f in fields(self) if f.name not in not_vllms and (v := getattr(self, f.name)) is not None}
        # Tensor parallel engines are one per process over the caller's process group.
        ours["distributed_executor_backend"] = "external_launcher" if self.tensor_parallel_size > 1 else None
        # Sampled-token log-probs after temperature, as the trainer computes them (the
        # rollout-mismatch metrics and correction compare the two).
        ours["logprobs_mode"] = "processed_logprobs"
        if self.max_lora_rank is not None:
            ours["enable_lora"] = True
            # Every request carries the synced adapter (lora_request), so CUDA graphs for a batch
            # without one would never run: vLLM's V1 model runner then captures only the LoRA
            # ones. Its V2 runner (0.26's on the H200) captures both cases either way (102 graphs
            # per mode there: 51 sizes x [no adapter, adapter]).
            ours["compilation_config"] = {"cudagraph_specialize_lora": False}
        return merged(ours, self.engine_kwargs)


def merged(lorarl_kwargs: dict[str, Any], engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM` kwargs: lorarl's, then the user's (which name none of lorarl's:
    lorarl.config.validate.check_not_set_by_lorarl). A `compilation_config` mapping is merged key
    by key (lorarl sets one of its keys when LoRA is on), the user's keys winning."""
    out = {**lorarl_kwargs, **engine_kwargs}
    ours, theirs = lorarl_kwargs.get("compilation_config"), engine_kwargs.get("compilation_config")
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out["compilation_config"] = {**ours, **theirs}
    return out


@dataclass(frozen=True)
class RolloutSpec:
    """vLLM engines: one set of `vllm.LLM` arguments per engine (they differ in the seed), and
    how the workers of one engine share it."""

    engine_args: tuple[LLMArgs, ...]  # indexed by the engine a worker holds a shard of
    tensor_parallel_size: int  # consecutive workers sharing one engine
    n_gpus_per_node: int  # on CPU the rank within a node picks the cores vLLM binds to
    adapter_transport: str  # tmpfs or memory (rollout.adapter_transport)
    fingerprint_base: bool  # record base tensors' fingerprints as they stream in (trainer.check_sync)


@dataclass(frozen=True)
class SleepSpec:
    """Whether vLLM sleeps during the update (lorarl.rollout.sleep): the setting, and the update's
    estimated peak and largest micro-batch on one device, which decide when the setting is null
    on a GPU (None there: not needed)."""

    free_cache_engine: bool | None  # rollout.free_cache_engine
    update_bytes: int | None  # lorarl.rollout.memory's estimate of the update's peak
    update_tokens: int | None  # padded tokens of the largest update micro-batch


@dataclass(frozen=True)
class SyncSpec:
    """The weight sync and its checks (lorarl.sync.session)."""

    merge: bool  # model.lora.merge: merged weights every step instead of the adapter
    layered_summon: bool  # rollout.layered_summon: gather the adapter layer by layer
    check: bool  # trainer.check_sync: transport fingerprint, semantic check, probe
    semantic: bool  # the engine computes the semantic check's expected side, and checks are on
    tolerance: float | None  # trainer.check_sync_tolerance
    probe_freq: int  # trainer.check_sync_probe_freq
    fault: str | None  # trainer.sync_fault: a deliberate export fault (lorarl.sync.faults)


@dataclass(frozen=True)
class BasePlan:
    """One copy of the frozen base per replica, vLLM's, with the trainer's base as views of it
    (`shared`), or two; and why (lorarl.driver.base_plan decides, the worker builds it)."""

    shared: bool
    reason: str

    def __str__(self) -> str:
        if self.shared:
            return f"base: one copy, the trainer's frozen weights are views of vLLM's ({self.reason})"
        return f"base: two copies, the trainer's and vLLM's ({self.reason})"


@dataclass(frozen=True)
class WorkerSpec:
    """All a worker is given, besides its place (rank, world size, device)."""

    engine: EngineSpec
    rollout: RolloutSpec
    sleep: SleepSpec
    sync: SyncSpec
    base_plan: BasePlan  # one copy of the frozen base (vLLM's, the trainer's views of it) or two
    rollout_correction: RolloutCorrectionConfig  # algorithm.rollout_correction
    train_batch_size: int  # data.train_batch_size, in prompts: whether the update is on-policy
    off_policy_steps: int  # trainer.off_policy_steps: the batch may be that many adapter versions behind
    seed: int  # trainer.seed; each worker seeds its RNGs with seed + rank
    stall_report_s: float | None  # trainer.stall_report_s (lorarl.workers.stall_report)
