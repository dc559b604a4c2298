"""Exact fingerprints of stored tensor bits: what the transport check compares.

Every tensor is reduced to two integers over the raw bits of its stored values, so any changed bit
shows, independent of numerical noise, and the reduction composes over row-wise concatenations (vLLM
fuses q/k/v and gate/up).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from lorarl.errors import SyncError

# ----------------------------------------------------------------------------- fingerprints

# Integer views of each float format: fingerprints read the stored bits, not the values.
_BITS = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float64: torch.int64,
}
_CHUNK = 1 << 24  # elements per pass: bounds the int64 scratch to 256 MiB per tensor


@dataclass(frozen=True)
class Fingerprint:
    """(sum of bits, sum of bits x (position + 1)) over the row-major elements, modulo 2^64.

    Both sums are exact integer arithmetic, so the result does not depend on the device or on
    the summation order, and they are linear: a tensor that is a row-wise concatenation of parts
    has the fingerprint `combine` builds from the parts (vLLM fuses q/k/v and gate/up).
    Trailing zero padding (vLLM's rank-padded slots) adds nothing.
    """

    total: int
    weighted: int

    def shifted(self, offset: int) -> Fingerprint:
        """The fingerprint of the same values placed `offset` elements later."""
        return Fingerprint(self.total, _wrap(self.weighted + offset * self.total))

    def __add__(self, other: Fingerprint) -> Fingerprint:
        return Fingerprint(_wrap(self.total + other.total), _wrap(self.weighted + other.weighted))


ZERO = Fingerprint(0, 0)


def _wrap(value: int) -> int:
    """Two's complement 64-bit, as torch's int64 sums wrap."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def _bits(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    """The tensor's stored bits (as `dtype` if given), flat, in the integer type of its width."""
    t = tensor.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if t.dtype not in _BITS:
        raise SyncError(f"cannot fingerprint a {t.dtype} tensor; sync checks cover float32/float16/bfloat16")
    return t.contiguous().view(_BITS[t.dtype]).reshape(-1)


def _row_sums(bits: Tensor) -> Tensor:
    """[rows, 2] int64: each row's (sum, position-weighted sum) of `bits` [rows, n], in column
    passes that bound the int64 scratch to _CHUNK elements."""
    rows, numel = bits.shape
    sums = torch.zeros(rows, 2, dtype=torch.int64, device=bits.device)
    width = max(1, _CHUNK // rows)
    for start in range(0, numel, width):
        part = bits[:, start : start + width].to(torch.int64)
        pos = torch.arange(start + 1, start + 1 + part.shape[1], dtype=torch.int64, device=bits.device)
        sums[:, 0] += part.sum(1)  # int64 sums wrap modulo 2^64, as Fingerprint's arithmetic does
        sums[:, 1] += (part * pos).sum(1)
    return sums


def fingerprint_sums(tensor: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The two sums of `fingerprint` as an int64 pair on the tensor's device, without waiting
    for the device: a sync checks hundreds of tensors, and one host round trip per tensor cost
    more than the sums (`resolve` reads many pairs at once)."""
    return _row_sums(_bits(tensor, dtype).unsqueeze(0))[0]


def fingerprint_sums_many(tensors: list[Tensor], dtype: torch.dtype | None = None) -> list[Tensor]:
    """`fingerprint_sums` of each tensor, equal-shaped small tensors reduced together.

    An adapter is hundreds of tensors of a handful of shapes (one per projection kind and A/B);
    reducing each alone launched ~8 kernels per tensor, 0.1-0.2 s per check at 7B on an H200.
    Stacking a shape's tensors makes it ~8 kernels per shape, with the same integers."""
    out: list[Tensor | None] = [None] * len(tensors)
    bits = [_bits(t, dtype) for t in tensors]
    groups: dict[tuple, list[int]] = {}
    for i, (tensor, b) in enumerate(zip(tensors, bits)):
        if b.numel() >= _CHUNK:  # large (base weights): alone, never copied into a stack
            out[i] = _row_sums(b.unsqueeze(0))[0]
        else:
            groups.setdefault((tuple(tensor.shape), b.dtype, b.device), []).append(i)
    for indices in groups.values():
        sums = _row_sums(torch.stack([bits[i] for i in indices]))
        for row, i in enumerate(indices):
            out[i] = sums[row]
    return out  # type: ignore[return-value]


def fingerprint_rows(stacked: Tensor) -> Tensor:
    """[n, 2]: `fingerprint_sums` of each stacked[i], in one reduction (an expert stack's slots)."""
    if stacked.dtype not in _BITS:
        raise SyncError(f"cannot fingerprint a {stacked.dtype} tensor; sync checks cover float32/float16/bfloat16")
    t = stacked.detach().contiguous()
    return _row_sums(t.view(_BITS[t.dtype]).reshape(t.shape[0], -1))


def resolve(sums: list[Tensor]) -> list[Fingerprint]:
    """Fingerprints of `fingerprint_sums` results, one host transfer per device."""
    out: list[Fingerprint | None] = [None] * len(sums)
    by_device: dict[torch.device, list[int]] = {}
    for i, pair in enumerate(sums):
        by_device.setdefault(pair.device, []).append(i)
    for indices in by_device.values():
        values = torch.stack([sums[i] for i in indices]).tolist()
        for i, (total, weighted) in zip(indices, values):
            out[i] = Fingerprint(_wrap(total), _wrap(weighted))
    return out  # type: ignore[return-value]


def fingerprint(tensor: Tensor, dtype: torch.dtype | None = None) -> Fingerprint:
    """Fingerprint of `tensor` as stored in `dtype` (default: its own), computed where it lives."""
    return resolve([fingerprint_sums(tensor, dtype)])[0]


def combine(parts: Iterable[tuple[Fingerprint, int]]) -> Fingerprint:
    """Fingerprint of the row-major concatenation of parts given as (fingerprint, numel)."""
    out, offset = ZERO, 0
    for fp, numel in parts:
        out = out + fp.shifted(offset)
        offset += numel
    return out
