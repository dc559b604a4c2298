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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lorarl.config.algorithm import RolloutCorrectionConfig
from lorarl.config.backends import FSDPBackendConfig, MegatronBackendConfig
from lorarl.config.schema import ActorConfig, ModelConfig

if TYPE_CHECKING:
    from lorarl.engines.shared_base import BasePlan
    from lorarl.rollout.vllm.engine_args import LLMArgs


@dataclass(frozen=True)
class EngineSpec:
    """The training engine: its three config groups, the class that implements the backend,
    the seed, and Liger's kernels resolved for the device (lorarl.engines.liger)."""

    model: ModelConfig
    actor: ActorConfig
    backend: FSDPBackendConfig | MegatronBackendConfig
    engine: str  # "module:Class" implementing lorarl.contract.engine.Engine (lorarl.engines.BACKENDS)
    seed: int  # trainer.seed: Megatron's model-parallel RNG; FSDP's LoRA init draws from the worker's
    liger_kernel: bool  # FSDP only: Liger's kernels patched into the model

    def engine_class(self) -> type:
        module, name = self.engine.split(":")
        return getattr(importlib.import_module(module), name)


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
