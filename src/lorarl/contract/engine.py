"""A training engine: the batch it computes on and the calls it answers.

The batch: padded training tensors built from (prompt, response) token lists, and how they are
cut into micro-batches. Each row is prompt + response. Position t of the `[B, L-1]` tensors is
the log-prob of token t+1, so `response_mask` marks exactly the positions that predict a
response token; prompts and padding never enter a loss. Prompts are right-aligned when
`left_pad_prompts` is set (every response then starts in the same column, so an engine can
compute logits for the response columns only), else every row is right-padded (what
Megatron's causal-only attention needs). Everything downstream reads the masks, never the layout.

The Engine protocol, which both training engines implement (lorarl.engines): an engine owns a
sharded (FSDP2) or model-parallel (Megatron) policy with LoRA: it runs forward passes, applies
optimizer steps and exports weights. What a step computes (mini-batches, micro-batches, the
PPO-clip loss, KL and entropy terms, metrics) lives once in lorarl.algorithms.ppo, which the
worker calls with the engine; an engine contributes only how to run its forward/backward over a
list of micro-batches. Every method of an engine is collective: all ranks of the job call it in
the same order, each with its own data-parallel share (ranks of one tensor/pipeline group pass
the same).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Literal, Protocol, runtime_checkable

import torch

from lorarl.config.schema import ActorConfig
from lorarl.contract.payload import PayloadKind, WeightPayload
from lorarl.errors import TrainingError


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1] float
    advantages: torch.Tensor | None = None  # [B]
    old_logp: torch.Tensor | None = None  # [B, L-1]
    ref_logp: torch.Tensor | None = None  # [B, L-1]
    rollout_logp: torch.Tensor | None = None  # [B, L-1]: the sampler's log-probs of the response tokens
    is_weights: torch.Tensor | None = None  # [B, L-1]: rollout-correction weights set before the update
    # [B] int64, in host memory: the adapter each row trains (several adapters over one base,
    # lorarl.engines.adapter_routing); None: the run's one adapter.
    adapter: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _map(self, fn) -> TrainBatch:
        return TrainBatch(
            **{f.name: (None if (v := getattr(self, f.name)) is None else fn(f.name, v)) for f in fields(self)}
        )

    def select(self, idx: slice | torch.Tensor | list[int]) -> TrainBatch:
        return self._map(lambda _, v: v[idx])

    def to(self, device: torch.device) -> TrainBatch:
        # `adapter` stays on the host: the forward and the loss read it there, without a device wait.
        return self._map(lambda name, v: v if name == "adapter" else v.to(device))

    def chunks(self, size: int) -> Iterator[TrainBatch]:
        for start in range(0, len(self), size):
            yield self.select(slice(start, start + size))

    def segments(self) -> list[tuple[int, slice]]:
        """(adapter, its rows) for a batch whose rows are grouped by adapter, in row order; one
        segment (adapter 0, every row) when the batch names no adapter. Read on the host."""
        if self.adapter is None:
            return [(0, slice(0, len(self)))]
        of, out, start = self.adapter.tolist(), [], 0
        for row in range(1, len(of) + 1):
            if row == len(of) or of[row] != of[start]:
                out.append((of[start], slice(start, row)))
                start = row
        return out

    @property
    def lengths(self) -> torch.Tensor:
        """Real (non-padding) tokens per row."""
        return self.attention_mask.sum(-1)

    def trim_span(self) -> tuple[int, int]:
        """(first, last): columns first..last-1 hold every real token of every row."""
        real = self.attention_mask.bool().any(0).nonzero()
        if real.numel() == 0:
            return 0, self.input_ids.shape[1]
        return int(real[0]), int(real[-1]) + 1

    def trimmed(self) -> TrainBatch:
        """The same rows without the columns that are padding in every row (both ends)."""
        first, last = self.trim_span()
        if first == 0 and last == self.input_ids.shape[1]:
            return self
        # [B, L] tensors keep columns first..last-1; [B, L-1] ones the positions predicting
        # tokens first+1..last-1, i.e. first..last-2.
        full = ("input_ids", "attention_mask")
        return self._map(
            lambda name, v: v if v.dim() == 1 else (v[:, first:last] if name in full else v[:, first : last - 1])
        )


def build_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    advantages: list[float] | None = None,
    left_pad_prompts: bool = False,
    rollout_logprobs: list[list[float]] | None = None,
    adapters: list[int] | None = None,
) -> TrainBatch:
    """`adapters`: the adapter each row trains, where several train together (None: one)."""
    assert len(prompts) == len(responses), "one response per prompt copy"
    width_p = max(len(p) for p in prompts)
    if left_pad_prompts:
        length = width_p + max(len(r) for r in responses)
    else:
        length = max(len(p) + len(r) for p, r in zip(prompts, responses))
    input_ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), length), dtype=torch.long)
    response_mask = torch.zeros((len(prompts), length - 1), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        start = width_p - len(p) if left_pad_prompts else 0
        end = start + len(p) + len(r)
        input_ids[i, start:end] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, start:end] = 1
        # logits at position t predict token t+1: response tokens sit at start+len(p)..end-1.
        response_mask[i, start + len(p) - 1 : end - 1] = 1.0
    adv = None if advantages is None else torch.tensor(advantages, dtype=torch.float32)
    rollout_logp = None
    if rollout_logprobs is not None:
        rollout_logp = torch.zeros_like(response_mask)
        for i, (p, lp) in enumerate(zip(prompts, rollout_logprobs)):
            start = (width_p - len(p) if left_pad_prompts else 0) + len(p) - 1
            rollout_logp[i, start : start + len(lp)] = torch.tensor(lp, dtype=torch.float32)
    adapter = None if adapters is None else torch.tensor(adapters, dtype=torch.long)
    return TrainBatch(
        input_ids, attention_mask, response_mask, advantages=adv, rollout_logp=rollout_logp, adapter=adapter
    )


def padding_frac(micro: list[TrainBatch]) -> float:
    """Share of the positions that forward passes over `micro` compute that are padding (columns
    padding in every row are trimmed first, as the engines do): what packing the sequences of a
    micro-batch into one row would save."""
    positions = sum(padded_tokens(mb) for mb in micro)
    real = sum(int(mb.attention_mask.sum()) for mb in micro)
    return 1.0 - real / positions if positions else 0.0


def padded_tokens(mb: TrainBatch) -> int:
    """Positions a forward over `mb` computes: its rows times its columns once trimmed."""
    first, last = mb.trim_span()
    return len(mb) * (last - first)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over each row's real tokens, whatever padding sits before them (as vLLM
    numbers a prompt)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The [B, 1, L, L] boolean mask SDPA takes (True = may attend), built on the mask's device:
    each real token sees the real tokens up to itself. A padding position sees only itself:
    a softmax row with nothing to attend to is NaN, and its gradient would reach the real
    tokens through the shared weights."""
    length = attention_mask.shape[-1]
    col = torch.arange(length, device=attention_mask.device)
    causal = col[None, :] <= col[:, None]
    mask = causal[None] & attention_mask.bool()[:, None, :]
    return (mask | (col[None, :] == col[:, None])[None])[:, None]


def micro_batches(lengths: list[int], *, rows: int | None = None, token_budget: int | None = None) -> list[list[int]]:
    """Row indices of each micro-batch, every row in exactly one.

    Fixed size (`rows`): consecutive chunks of that many rows. Token budget: rows sorted by
    length, longest first, each micro-batch filled while rows x its longest row stays within
    `token_budget` (a row longer than the budget gets one of its own). Rows of similar length
    end up together, so little of a micro-batch is padding.
    """
    n = len(lengths)
    if token_budget is None:
        assert rows and rows > 0, "micro_batches needs rows or token_budget"
        return [list(range(s, min(s + rows, n))) for s in range(0, n, rows)]
    groups: list[list[int]] = []
    for i in sorted(range(n), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def split_to(groups: list[list[int]], count: int, lengths: list[int]) -> list[list[int]]:
    """`groups` cut further until there are `count` of them (data-parallel ranks must run the
    same number of forward passes): the group with the most padded tokens is halved first."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            raise ValueError(f"cannot cut {sum(map(len, groups))} rows into {count} micro-batches")
        g = max(splittable, key=lambda g: len(g) * max(lengths[i] for i in g))
        groups.remove(g)
        groups += [g[: len(g) // 2], g[len(g) // 2 :]]
    return groups


def log_prob_token_budget(actor: ActorConfig) -> int:
    """Padded tokens per forward of a pass without backward: nothing is kept for autograd, so
    it holds a layer's transient activations and the logits, not every layer's activations. At
    twice the update's budget its peak stays under what lorarl.rollout.memory counts for the update
    (bf16 logits of 2x the tokens against the update's 3 logit-sized buffers, one layer's
    activations against all of them), so the sleep decision holds for it too. On one H200 the
    7B step's reference pass took 0.99 s at 8192 tokens, 1.33 s at 4096 a release before."""
    return actor.log_prob_max_token_len_per_gpu or 2 * actor.ppo_max_token_len_per_gpu


def plan_micro_batches(engine, batch: TrainBatch, actor: ActorConfig, *, backward: bool = True) -> list[list[int]]:
    """Row indices per micro-batch: `ppo_micro_batch_size_per_gpu` rows, or with
    `use_dynamic_bsz` a budget of `ppo_max_token_len_per_gpu` padded tokens
    (`log_prob_token_budget` for a pass with no backward). Collective through the engine's
    dp_all_reduce: every data-parallel rank gets the same number of micro-batches (FSDP gathers
    weights per forward)."""
    lengths = batch.lengths.tolist()
    if not actor.use_dynamic_bsz:
        return micro_batches(lengths, rows=actor.ppo_micro_batch_size_per_gpu)
    budget = actor.ppo_max_token_len_per_gpu if backward else log_prob_token_budget(actor)
    row_sets = micro_batches(lengths, token_budget=budget)
    count = int(engine.dp_all_reduce([len(row_sets)], op="max")[0])
    return split_to(row_sets, count, lengths)


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
    left_pad_prompts: bool  # the batch layout it wants (lorarl.contract.engine.build_batch)
    adapter_names: Sequence[str]  # the adapters it trains, in index order (a run's one; a sweep group's, one per job)

    def log_probs(self, batch: TrainBatch, *, temperature: float, reference: bool = False) -> torch.Tensor:
        """[B, L-1] float32 on CPU: log p(token t+1) at `temperature`; `reference=True` with the
        adapter disabled. Micro-batches as lorarl.algorithms.ppo.plan_micro_batches cuts them for a pass
        without backward."""

    def forward_backward(
        self, micro: list[TrainBatch], loss_fn: LossFn, entropy: EntropyMode, temperature: float
    ) -> list[dict[str, float]]:
        """Forward at `temperature`, loss_fn, backward for each micro-batch, gradients
        accumulated; their metrics, read after the last micro-batch (`read_metrics`)."""

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
