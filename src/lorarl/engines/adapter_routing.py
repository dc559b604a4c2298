"""Several LoRA adapters over one frozen base, each row of a batch through its own adapter.

A sweep's points differ only in what their adapters and losses see, so they train together on one
base: the rows of a micro-batch belong to different adapters, ordered so that each adapter's rows
form one contiguous segment (`Segments`). Every PEFT LoRA linear then runs the base GEMM once over
all rows and each adapter's two products on its own segment only:

    y = x W^T + b;   y[rows of i] += s_i (x[rows of i] A_i^T) B_i^T

PEFT cannot do this: its mixed-batch forward (`adapter_names`) refuses training mode, and with
several active adapters it adds every adapter to every token. The products of all segments are two
grouped GEMMs (torch's grouped_mm, tokens grouped by adapter, ranks zero-padded to the largest),
which run on CUDA and CPU alike; where grouped_mm's 16-byte alignment does not hold, one matmul
pair per segment. Adapter i's parameters see only its own rows, so the gradient each adapter gets
is the gradient of its own loss alone: rows never interact in a decoder (attention stays within a
sequence, norms within a token).

The routed forward replaces PEFT's only while a `Segments` is set (`AdapterRouter.route`), with
the adapters enabled and unmerged; otherwise PEFT's own forward runs (the reference pass under
`disable_adapter`, a single-adapter model).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class Segments:
    """Which adapter each row of a micro-batch goes through: adapter `names[k]` owns rows
    `starts[k]:starts[k + 1]` (the last runs to `rows`). Rows of one adapter are contiguous."""

    names: tuple[str, ...]
    bounds: tuple[int, ...]  # len(names) + 1 row offsets, from 0 to the row count

    @classmethod
    def of(cls, adapter_of_row: Sequence[int], adapter_names: Sequence[str]) -> Segments:
        """From each row's adapter index (rows grouped by adapter: each index in one run)."""
        names, bounds = [], [0]
        for row, index in enumerate(adapter_of_row):
            if not names or names[-1] != adapter_names[index]:
                if adapter_names[index] in names:
                    raise ValueError(f"rows of adapter {adapter_names[index]} are not contiguous")
                if names:
                    bounds.append(row)
                names.append(adapter_names[index])
        bounds.append(len(adapter_of_row))
        return cls(tuple(names), tuple(bounds))

    def spans(self) -> Iterator[tuple[str, int, int]]:
        for k, name in enumerate(self.names):
            yield name, self.bounds[k], self.bounds[k + 1]


class AdapterRouter:
    """The segments of the micro-batch in flight, shared by every routed LoRA linear of a model."""

    def __init__(self) -> None:
        self.segments: Segments | None = None
        # Small device tensors (group offsets, per-token scales) made once per micro-batch: made
        # per layer, each would be a host-to-device copy the host waits on.
        self._made: dict = {}

    @contextlib.contextmanager
    def route(self, segments: Segments | None):
        """Route the forwards (and their backward: autograd keeps what each saw, and activation
        checkpointing runs the forward again there) inside this block."""
        previous, self.segments, self._made = self.segments, segments, {}
        try:
            yield
        finally:
            self.segments, self._made = previous, {}

    def made(self, key: tuple, make):
        """`make()`, once per routed block for each `key`."""
        if key not in self._made:
            self._made[key] = make()
        return self._made[key]


def route_adapters(peft_model: nn.Module, router: AdapterRouter) -> int:
    """Give every PEFT LoRA Linear (exactly that class) the routed forward, in place; parameter
    names do not change. The count."""
    from peft.tuners.lora.layer import Linear

    layers = [m for m in peft_model.modules() if type(m) is Linear]
    for layer in layers:
        layer._adapter_router = router
        layer.forward = types.MethodType(_forward, layer)
    return len(layers)


def _forward(self, x: Tensor, *args, **kwargs) -> Tensor:
    segments = self._adapter_router.segments
    if segments is None or args or kwargs or self.disable_adapters or self.merged:
        return type(self).forward(self, x, *args, **kwargs)
    if x.shape[0] != segments.bounds[-1]:
        raise RuntimeError(f"routed LoRA: {x.shape[0]} rows in, the segments cover {segments.bounds[-1]}")
    result = self.base_layer(x)
    spans = [(name, start, stop) for name, start, stop in segments.spans() if name in self.lora_A]
    if not spans:
        return result
    delta = routed_delta(self, x, spans, segments.bounds[-1], self._adapter_router)
    return result + delta.to(result.dtype)


def routed_delta(
    layer, x: Tensor, spans: list[tuple[str, int, int]], rows: int, router: AdapterRouter | None = None
) -> Tensor:
    """sum_i s_i (x_i A_i^T) B_i^T on each adapter's rows, zeros on rows of adapters this layer does
    not carry; shaped like the layer's output."""
    width = x.shape[-1]
    per_row = x[0].numel() // width if rows else 1
    a_weights = [layer.lora_A[name].weight for name, _, _ in spans]
    b_weights = [layer.lora_B[name].weight for name, _, _ in spans]
    dtype = a_weights[0].dtype
    out_features = b_weights[0].shape[0]
    flat = x.reshape(rows * per_row, width)
    # The rows this layer adapts, one block per adapter (rows of other adapters are left out).
    inputs = [layer.lora_dropout[name](flat[start * per_row : stop * per_row]) for name, start, stop in spans]
    scales = [layer.scaling[name] for name, _, _ in spans]
    tokens = torch.cat(inputs).to(dtype) if len(inputs) > 1 else inputs[0].to(dtype)
    counts = [(stop - start) * per_row for _, start, stop in spans]
    if _groupable(tokens, a_weights, b_weights):
        delta = _grouped(tokens, a_weights, b_weights, scales, counts, router or AdapterRouter())
    else:
        delta = torch.cat(
            [
                (part @ a.t()) @ b.t() * s
                for part, a, b, s in zip(tokens.split(counts), a_weights, b_weights, scales, strict=True)
            ]
        )
    return _scatter_rows(delta, spans, rows, per_row, out_features).view(*x.shape[:-1], out_features)


def _groupable(tokens: Tensor, a_weights: list[Tensor], b_weights: list[Tensor]) -> bool:
    """grouped_mm's layout: one floating dtype, and every row 16-byte aligned (in, out and the
    padded rank a multiple of 16 bytes)."""
    if not hasattr(F, "grouped_mm") or tokens.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    per = 16 // tokens.element_size()
    rank = max(a.shape[0] for a in a_weights)
    return all(w.dtype == tokens.dtype for w in a_weights + b_weights) and all(
        d % per == 0 for d in (tokens.shape[1], b_weights[0].shape[0], _padded(rank, per))
    )


def _padded(rank: int, multiple: int) -> int:
    return -(-rank // multiple) * multiple


def _grouped(
    tokens: Tensor,
    a_weights: list[Tensor],
    b_weights: list[Tensor],
    scales: list[float],
    counts: list[int],
    router: AdapterRouter,
) -> Tensor:
    """Both products of every adapter as two grouped GEMMs. Ranks are zero-padded to one width
    (F.pad keeps the gradient of each adapter's own factors; the padding's rows and columns carry
    zeros, so they add nothing), and each adapter's scale multiplies its rows between the two."""
    per = 16 // tokens.element_size()
    rank = _padded(max(a.shape[0] for a in a_weights), per)
    a_stack = torch.stack([F.pad(a, (0, 0, 0, rank - a.shape[0])) for a in a_weights])  # [G, r, in]
    b_stack = torch.stack([F.pad(b, (0, rank - b.shape[1])) for b in b_weights])  # [G, out, r]
    device = tokens.device
    offsets = router.made(
        ("offsets", device, tuple(counts)),
        lambda: torch.tensor(counts, device="cpu").cumsum(0).to(device=device, dtype=torch.int32),
    )
    xa = F.grouped_mm(tokens, a_stack.transpose(1, 2), offs=offsets)  # [tokens, r]
    scale = router.made(
        ("scales", device, xa.dtype, tuple(counts), tuple(scales)),
        lambda: torch.tensor(scales, dtype=xa.dtype).repeat_interleave(torch.tensor(counts)).to(device),
    )
    return F.grouped_mm(xa * scale.unsqueeze(1), b_stack.transpose(1, 2), offs=offsets)  # [tokens, out]


def _scatter_rows(delta: Tensor, spans: list[tuple[str, int, int]], rows: int, per_row: int, width: int) -> Tensor:
    """The adapted blocks back in row order, zeros for rows no span covers."""
    covered = sum(stop - start for _, start, stop in spans)
    if covered == rows and all(spans[k][2] == spans[k + 1][1] for k in range(len(spans) - 1)) and spans[0][1] == 0:
        return delta
    parts, at, cursor = [], 0, 0
    for _, start, stop in spans:
        if start > cursor:
            parts.append(delta.new_zeros((start - cursor) * per_row, width))
        n = (stop - start) * per_row
        parts.append(delta[at : at + n])
        at, cursor = at + n, stop
    if cursor < rows:
        parts.append(delta.new_zeros((rows - cursor) * per_row, width))
    return torch.cat(parts)
