"""The contract both training engines implement.

An engine owns a sharded (FSDP2) or model-parallel (Megatron) policy with LoRA: it runs
forward passes, applies optimizer steps and exports weights. What a step computes (mini-batches,
micro-batches, the PPO-clip loss, KL and entropy terms, metrics) lives once in lorarl.algorithms.ppo, which
the worker calls with the engine; an engine contributes only how to run its forward/backward
over a list of micro-batches.

Every method of an engine is collective: all ranks of the job call it in the same order,
each with its own data-parallel share (ranks of one tensor/pipeline group pass the same).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Literal, Protocol, runtime_checkable

import torch

from lorarl.algorithms.batch import TrainBatch
from lorarl.errors import TrainingError
from lorarl.sync.payload import PayloadKind, WeightPayload

# loss_fn(micro_batch, log_probs, entropy) -> (loss to backpropagate, metrics). The engine
# passes the micro-batch as it ran it (on its device, possibly trimmed), so `log_probs`
# [b, T] lines up with `micro_batch.response_mask`. Metrics are detached 0-dim tensors on the
# device: an engine reads them (`read_metrics`) after its last micro-batch, so the host never
# waits for the device between micro-batches and keeps queueing the next one's kernels.
LossFn = Callable[[TrainBatch, torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, dict[str, torch.Tensor]]]
# The micro-batch's loss, among its metrics: checked for NaN/inf once the values are read.
LOSS_KEY = "loss"
# grad: entropy is part of the loss; metric: computed without autograd; none: not computed.
EntropyMode = Literal["grad", "metric", "none"]


@runtime_checkable
class Engine(Protocol):
    dp_rank: int  # which data-parallel replica this rank belongs to
    dp_size: int  # how many replicas split the data
    pad_token_id: int
    compute_dtype: torch.dtype  # dtype of the forward's matmuls (what the parity probe's bound reads)
    left_pad_prompts: bool  # the batch layout it wants (lorarl.algorithms.batch.build_batch)

    def log_probs(self, batch: TrainBatch, *, temperature: float, reference: bool = False) -> torch.Tensor:
        """[B, L-1] float32 on CPU: log p(token t+1) at `temperature`; `reference=True` with the
        adapter disabled. Micro-batches as lorarl.algorithms.ppo.plan_micro_batches cuts them for a pass
        without backward."""

    def forward_backward(
        self, micro: list[TrainBatch], loss_fn: LossFn, entropy: EntropyMode, temperature: float
    ) -> list[dict[str, float]]:
        """Forward at `temperature`, loss_fn, backward for each micro-batch, gradients
        accumulated; their metrics, read after the last micro-batch (`read_metrics`)."""

    adapter_names: Sequence[str]  # the adapters it trains, in index order (one per run; a sweep's group: several)

    def optimizer_step(self, step: int, skip: Sequence[int] = ()) -> list[float]:
        """Clip, step, zero the gradients, each adapter on its own; the grad norm of each. An
        adapter in `skip`, or whose norm is not finite, keeps its weights as they were."""

    def end_step(self) -> list[float]:
        """Advance each adapter's learning-rate schedule by one trainer step; the rates used."""

    def dp_all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Sum or max of `values` over data-parallel replicas."""

    EXPORT_METHODS: tuple[str, ...]  # how this engine can gather an adapter; the first is its default

    def export(
        self, kind: PayloadKind, method: str | None = None, dtype: torch.dtype | None = None, adapter: int = 0
    ) -> tuple[WeightPayload, float]:
        """The payload of `kind` and the seconds spent gathering it; every rank gets it whole.
        `method` is one of EXPORT_METHODS (None: the first; base payloads ignore it), `dtype`
        the dtype adapter tensors are cast to (None: as trained)."""

    def adapter_config(self, adapter: int = 0) -> dict: ...

    def lora_state(self, adapter: int = 0) -> dict[str, torch.Tensor]:
        """An adapter's full LoRA tensors under PEFT names, on CPU."""

    def load_state(
        self, lora: dict[str, torch.Tensor], optimizer: dict | None, scheduler: dict | None, adapter: int = 0
    ) -> None: ...

    def optimizer_state(self, adapter: int = 0) -> dict: ...

    def scheduler_state(self, adapter: int = 0) -> dict: ...


def read_metrics(per_micro: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """The micro-batches' metric tensors as floats, after the last micro-batch is queued: the
    first read waits for the device to finish, the rest are already there."""
    return [{k: float(v) for k, v in m.items()} for m in per_micro]


def check_grad_norm(grad_norm: float, step: int) -> float:
    if not math.isfinite(grad_norm):
        raise TrainingError(f"step {step}: grad norm is {grad_norm}; stopping before the update is applied")
    return grad_norm


class AdapterView:
    """One adapter of an engine, seen as the engine of a one-adapter run: what the weight sync,
    its checks and probe (lorarl.sync) and the checkpoint files call, aimed at adapter `index`;
    everything else is the engine's. A sweep's group trains one adapter per job over one base
    (lorarl.engines.adapter_routing), and each is synced, checked and saved as a run's would be."""

    def __init__(self, engine: Engine, index: int):
        self.engine, self.index = engine, index
        self.adapter_name = engine.adapter_names[index]

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def export(self, kind: PayloadKind, method: str | None = None, dtype: torch.dtype | None = None):
        return self.engine.export(kind, method, dtype, adapter=self.index)

    def adapter_config(self) -> dict:
        return self.engine.adapter_config(self.index)

    def lora_projections(self) -> dict:
        return self.engine.lora_projections(self.index)

    def lora_parameters(self) -> list[torch.Tensor]:
        return self.engine.lora_parameters(self.index)

    def lora_state(self) -> dict[str, torch.Tensor]:
        return self.engine.lora_state(self.index)

    def optimizer_state(self) -> dict:
        return self.engine.optimizer_state(self.index)

    def scheduler_state(self) -> dict:
        return self.engine.scheduler_state(self.index)

    def load_state(self, lora: dict[str, torch.Tensor], optimizer: dict | None, scheduler: dict | None) -> None:
        self.engine.load_state(lora, optimizer, scheduler, self.index)

    def log_probs(self, batch: TrainBatch, *, temperature: float, reference: bool = False) -> torch.Tensor:
        """Every row through this adapter (or, `reference`, through none)."""
        routed = dataclasses.replace(batch, adapter=torch.full((len(batch),), self.index, dtype=torch.long))
        return self.engine.log_probs(routed, temperature=temperature, reference=reference)
