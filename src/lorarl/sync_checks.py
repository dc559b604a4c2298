"""Checks that the rollout serves what the trainer sent: an exact fingerprint and a log-prob probe.

Cheapest first:
1. The payload checks its own kind and names (lorarl.sync).
2. Fingerprint (exact, no forward pass): every LoRA slot vLLM holds is reduced to two integers
   over the raw bits of its stored values, and compared with the same reduction of the payload
   after vLLM's own dtype cast and scaling. Any changed bit in any module shows, independent of
   numerical noise; a skipped, zeroed or partial sync names the first module that differs.
3. Probe (end to end): trainer and vLLM log-probs on a few fixed sequences. Its noise grows with
   model size and shrinks with precision (bf16 at 7B reads 0.16-0.20 max with correct weights),
   so it is judged on two scales: an absolute bound per dtype on the worst token, and, on the
   mean, relative to how far the adapter has moved the policy from the reference (adapter off).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
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


# ------------------------------------------------------------------ adapter as vLLM holds it


@dataclass(frozen=True)
class LoraSlot:
    """One LoRA slot vLLM holds for a (possibly fused) module's part: stacked A and B regions."""

    module: str  # vLLM-side module name of the part, e.g. model.layers.0.self_attn.q_proj
    a_shape: tuple[int, int]  # (max_lora_rank, in)
    b_shape: tuple[int, int]  # (out, max_lora_rank)
    a: Fingerprint
    b: Fingerprint


@dataclass(frozen=True)
class AdapterLayout:
    """What the expected fingerprint needs from vLLM: its LoRA dtype, the scaling rule of its
    PEFT helper, and the name its loader gives each PEFT tensor."""

    lora_dtype: torch.dtype
    module_of: object  # callable: PEFT tensor name -> (vLLM module name, is_lora_a)
    scaling_of: object  # callable: (adapter_config, PEFT module name) -> float


def expected_adapter_slots(
    tensors: Iterable[tuple[str, Tensor]],
    adapter_config: dict,
    layout: AdapterLayout,
    slots: Mapping[str, LoraSlot],
    tp_rank: int = 0,
    tp_size: int = 1,
) -> dict[str, tuple[Fingerprint, Fingerprint]]:
    """Per vLLM module: the fingerprints its slot must hold after loading this adapter.

    vLLM casts A and B to its LoRA dtype, then multiplies B in that dtype by the module's
    scaling (alpha / r, or PEFT's patterns); B is stored in an (out, max_lora_rank) slot, so a
    B of lower rank is padded to it. Modules the adapter does not name must hold zeros. With
    tensor parallelism each rank holds its slice: B's rows of a column-parallel module (each of
    q/k/v on its own), A's columns of a row-parallel one; the slot's shape says which.
    """
    pairs: dict[str, dict[str, Tensor]] = {}
    peft_module: dict[str, str] = {}
    for name, tensor in tensors:
        module, is_a = layout.module_of(name)
        pairs.setdefault(module, {})["A" if is_a else "B"] = tensor
        peft_module[module] = _PEFT_MODULE.sub("", name)
    out = {module: (ZERO, ZERO) for module in slots}
    pending: dict[str, tuple[Tensor, Tensor]] = {}
    for module, ab in pairs.items():
        if module not in slots and _other_ranks_expert(module, slots):
            continue  # expert parallelism: another rank holds (and checks) this expert
        if module not in slots:
            raise SyncError(
                f"adapter module '{module}' has no LoRA slot in vLLM (its LoRA modules are e.g. "
                f"{', '.join(sorted(slots)[:3])}); the rollout cannot serve it"
            )
        slot = slots[module]
        a = _tp_shard(ab["A"].detach(), 1, slot.a_shape[1], tp_rank, tp_size).to(layout.lora_dtype)
        b = _tp_shard(ab["B"].detach(), 0, slot.b_shape[0], tp_rank, tp_size).to(layout.lora_dtype)
        scaling = layout.scaling_of(adapter_config, peft_module[module])
        if scaling != 1:
            b = b * scaling  # in the LoRA dtype, as vLLM's LoRALayerWeights.optimize does
        if b.shape[1] < slot.b_shape[1]:
            b = torch.nn.functional.pad(b, (0, slot.b_shape[1] - b.shape[1]))
        pending[module] = (a, b)
    resolved = iter(resolve(fingerprint_sums_many([t for pair in pending.values() for t in pair])))
    out.update({module: (next(resolved), next(resolved)) for module in pending})
    return out


_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.\d+\.[^.]+$")


def _other_ranks_expert(module: str, slots: Mapping[str, LoraSlot]) -> bool:
    """An expert projection this rank has no slot for while it holds other experts of that layer."""
    match = _EXPERT.match(module)
    return match is not None and any(s.startswith(match["experts"] + ".") for s in slots)


def _tp_shard(t: Tensor, dim: int, size: int, tp_rank: int, tp_size: int) -> Tensor:
    """The `size`-long slice along `dim` that tensor-parallel rank `tp_rank` holds, as vLLM's
    LoRA layers slice it: the full tensor when it is not split, and shards shared by several
    ranks when there are fewer than tp_size of them (key/value heads replicated over ranks)."""
    if t.shape[dim] <= size:
        return t
    shards = t.shape[dim] // size
    if t.shape[dim] % size or tp_size % shards:
        raise SyncError(
            f"cannot tell the tensor-parallel slice of a {tuple(t.shape)} LoRA tensor held as {size} along dim {dim}"
        )
    return t.narrow(dim, (tp_rank * shards // tp_size) * size, size)


_PEFT_MODULE = re.compile(r"^base_model\.model\.|\.lora_[AB]\.weight$")


def peft_scaling(adapter_config: dict, peft_module: str) -> float:
    """PEFT's scaling for a module: alpha / r (alpha / sqrt(r) with rsLoRA), patterns first.

    Used where vLLM's helper has no per-module rule; patterns match by name suffix as PEFT's do."""
    rank = _pattern(adapter_config.get("rank_pattern") or {}, peft_module) or adapter_config["r"]
    alpha = _pattern(adapter_config.get("alpha_pattern") or {}, peft_module) or adapter_config["lora_alpha"]
    return alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank


def _pattern(pattern: dict, name: str):
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return None


def check_adapter_slots(
    expected: Mapping[str, tuple[Fingerprint, Fingerprint]], held: Mapping[str, LoraSlot], rank: int | None = None
) -> float:
    """1.0 when every slot vLLM holds matches; otherwise a SyncError naming the first module."""
    who = "" if rank is None else f"rank {rank}: "
    for module in sorted(expected):
        want_a, want_b = expected[module]
        slot = held.get(module)
        if slot is None:
            raise SyncError(f"{who}after the sync vLLM holds no LoRA slot for '{module}'")
        for part, want, got in (("lora_A", want_a, slot.a), ("lora_B", want_b, slot.b)):
            if want != got:
                state = "zeros" if got == ZERO else "other values"
                raise SyncError(
                    f"{who}after the sync vLLM's {part} of '{module}' differs from what the trainer sent "
                    f"(it holds {state}; {len(expected)} modules checked); the rollout is not using the trained adapter"
                )
    return 1.0


# ---------------------------------------------------------------------------------- probe

PROBE_COUNT = 4
PROBE_MIN_TOKENS = 32


@dataclass(frozen=True)
class ProbeBounds:
    """max: the worst token's |trainer - vLLM| log-prob; mean: the mean over all probe tokens."""

    max: float
    mean: float


# Measured with correct weights: fp32 on both sides 6e-5 max (CPU, tiny model); bf16 0.03 max at
# 0.5B (H200) and 0.157-0.20 at 7B (H200, r=64, CUDA graphs). The 16-bit max bound leaves 2.5x
# over 7B; its mean bound is half the worst token seen at 7B (the mean of a token-wise noise
# sits well below its max; tests/gpu/test_sync_checks_gpu.py logs both).
FP32_BOUNDS = ProbeBounds(max=1e-3, mean=2e-4)
HALF_BOUNDS = ProbeBounds(max=0.5, mean=0.1)
# Once the adapter has moved the policy, a correct sync leaves vLLM much closer to the trainer
# than the adapter-off reference is: a zeroed adapter reads ~1x, a correct one ~0.
PROBE_RATIO = 0.5


def probe_bounds(trainer_fp32: bool, rollout_dtype: str, max_override: float | None = None) -> ProbeBounds:
    bounds = FP32_BOUNDS if trainer_fp32 and rollout_dtype == "float32" else HALF_BOUNDS
    return bounds if max_override is None else ProbeBounds(max=max_override, mean=bounds.mean)


def choose_probes(sequences: list[list[int]], count: int = PROBE_COUNT, min_tokens: int = PROBE_MIN_TOKENS):
    """Up to `count` fixed sequences, preferring ones of at least `min_tokens` tokens (in the
    order given), topped up with the longest others. Every token after the first is scored."""
    long = [s for s in sequences if len(s) >= min_tokens]
    short = sorted((s for s in sequences if len(s) < min_tokens), key=len, reverse=True)
    chosen = (long + short)[:count]
    if not chosen or max(len(s) for s in chosen) < 2:
        raise SyncError("no probe sequence of 2 or more tokens; trainer.check_sync needs one")
    return [list(s) for s in chosen if len(s) >= 2]


@dataclass(frozen=True)
class ProbeReading:
    sync_max: float  # max |trainer - vLLM|
    sync_mean: float  # mean |trainer - vLLM|
    ref_mean: float  # mean |trainer - reference (adapter off)|
    tokens: int
    trainer_finite: bool = True  # False: the trainer's own log-probs hold NaN/inf (training diverged)

    def as_metrics(self, prefix: str = "sync/") -> dict[str, float]:
        return {
            f"{prefix}logprob_diff_max": self.sync_max,
            f"{prefix}logprob_diff_mean": self.sync_mean,
            f"{prefix}logprob_ref_diff_mean": self.ref_mean,
        }


def read_probe(trainer: Tensor, vllm: Tensor, reference: Tensor) -> ProbeReading:
    """From per-token log-probs of the same probe tokens (1-D, any float dtype)."""
    trainer, vllm, reference = (t.detach().double().cpu().reshape(-1) for t in (trainer, vllm, reference))
    if not trainer.shape == vllm.shape == reference.shape or trainer.numel() == 0:
        raise SyncError(
            f"probe log-probs disagree in length: trainer {trainer.numel()}, vLLM {vllm.numel()}, "
            f"reference {reference.numel()}"
        )
    sync = (trainer - vllm).abs()
    return ProbeReading(
        float(sync.max()),
        float(sync.mean()),
        float((trainer - reference).abs().mean()),
        trainer.numel(),
        bool(torch.isfinite(trainer).all()),
    )


def judge_probe(
    reading: ProbeReading, bounds: ProbeBounds, ratio: float = PROBE_RATIO, rank: int | None = None
) -> None:
    """Raise SyncError when the probe says vLLM does not serve the trainer's weights.

    Fails on (a) a worst token beyond the dtype's absolute bound, or (b) a mean distance above
    the dtype's noise that is not small against the adapter's own effect (trainer vs reference).
    While the adapter has barely moved, (b) cannot tell a stale adapter from noise in 16-bit;
    the exact fingerprint covers that. A trainer whose own log-probs are NaN/inf has diverged:
    nothing to compare against here, and the next update stops the run naming the step.
    """
    if not reading.trainer_finite:
        return
    who = "" if rank is None else f"rank {rank}: "
    if not math.isfinite(reading.sync_max) or reading.sync_max > bounds.max:
        raise SyncError(
            f"{who}after the sync vLLM and the trainer disagree on the probe sequences (max |log-prob diff| "
            f"{reading.sync_max:.4f} > {bounds.max}, the bound for this precision; raise it with "
            "trainer.check_sync_tolerance if this model's noise is larger); the rollout is not using the trained weights"
        )
    if reading.sync_mean > bounds.mean and reading.sync_mean > ratio * reading.ref_mean:
        raise SyncError(
            f"{who}after the sync vLLM is as far from the trainer as the adapter-off reference is (mean |log-prob "
            f"diff| {reading.sync_mean:.4f} vs {reading.ref_mean:.4f} to the reference, allowed "
            f"{ratio} x that above {bounds.mean}); the rollout is not using the trained adapter"
        )


# ------------------------------------------------------------- run against engine + rollout


def verify_adapter(rollout, payload, rank: int | None = None) -> float:
    """The exact check after an adapter sync: 1.0, or a SyncError naming the first module that
    differs. `rollout` is a lorarl VLLMRollout, `payload` the adapter WeightPayload it was sent."""
    held = rollout.held_adapter_slots()
    expected = expected_adapter_slots(
        payload.tensors, payload.adapter_config, rollout.adapter_layout(), held, rollout.tp_rank, rollout.tp_size
    )
    return check_adapter_slots(expected, held, rank)


def measure_probe(engine, rollout, sequences: list[list[int]]) -> ProbeReading:
    """Trainer (adapter on), reference (adapter off) and vLLM log-probs of every probe token
    after the first. `engine` is a training engine (log_probs with reference=), `rollout` a
    VLLMRollout."""
    from lorarl.batch import build_batch

    batch = build_batch([s[:1] for s in sequences], [s[1:] for s in sequences], 0)
    mask = batch.response_mask.bool()
    trainer = engine.log_probs(batch, temperature=1.0).float().cpu()[mask]
    reference = engine.log_probs(batch, reference=True, temperature=1.0).float().cpu()[mask]
    vllm = torch.tensor([x for row in rollout.prompt_logprobs_many(sequences, 1) for x in row], dtype=torch.float32)
    return read_probe(trainer, vllm, reference)


def verify_weights(rollout, rank: int | None = None) -> tuple[float, int]:
    """The exact check after a base (or merged) sync: every parameter vLLM serves and can show
    equals the payload as cast to vLLM's dtype. Returns (1.0, parameters checked); a mismatch is
    a SyncError naming the first. The CPU build keeps linear weights only in its GEMM library's
    packed form, so there only the rest (embeddings, norms) can be checked."""
    who = "" if rank is None else f"rank {rank}: "
    expected = rollout.sent_weight_fingerprints()
    held = rollout.held_weight_fingerprints(rollout.sent_numels())
    checked = 0
    for name in sorted(held):
        if held[name] is None:
            continue
        got, dtype = held[name]
        if got != expected[name]:
            raise SyncError(
                f"{who}after the sync vLLM's '{name}' ({dtype}) differs from what the trainer sent "
                f"({len(held)} weights compared); the rollout is not using the trained weights"
            )
        checked += 1
    return 1.0, checked
