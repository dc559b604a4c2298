"""The semantic check in merged mode: vLLM serves W_base + the trainer's delta, module by module.

With `model.lora.merge=true` the trainer pushes merged weights into a vLLM started without LoRA,
so there are no LoRA slots to read. The check compares whole weights instead, as the same
layout-free `u^T W v` for the seeded +-1 pairs of lorarl.sync.semantic, per HF module path
(experts as `<experts>.<e>.gate_proj|up_proj|down_proj`):

- expected, in the trainer: `u^T W_base v` from the trainer's own frozen base weight of each LoRA
  module (PEFT's base layer, or the expert parameter its ParamWrapper wraps), plus the delta's
  `u^T (scaling * B A) v` from lorarl.sync.semantic (PEFT's math, the module's own scaling). The
  base never changes, so its part is computed once per process and cached (`BaseProjections`);
  nothing is shared with the merge in the export.
- observed, inside vLLM: the served weight after vLLM's own loading (fused qkv / gate_up rows, the
  fused-MoE w13/w2 stacks, tensor-parallel slices added up over the engine's ranks),
  lorarl.rollout.vllm.weights.

The bound. A correct sync differs from the expected value by the rounding of `W_base + delta`
to the served dtype (and to the trainer's base dtype, which the merge casts to first): each
element is off by at most u * |W_ij| (u the unit roundoff), uniformly, so the projection's error
has a standard deviation of at most u * |W_base + delta|_F / sqrt(3) <= u * (|W_base|_F +
s |B|_F |A|_F) / sqrt(3). Where vLLM's weights can only be read through its own GEMM (the CPU
build packs linear weights), the observed value carries that product's rounding too: the output
rounded to the served dtype (u_out * |W v|, whose expected size is |W|_F) and the float32
accumulation over the input (at most u_fp32 * sqrt(in) * |W|_F for sign-random partial sums);
the rollout reports that extra roundoff. The bound is NOISE_SIGMAS times the sum of those
roundoffs times `|W_base|_F + s |B|_F |A|_F`: more than 17 standard deviations.

What it can see. The delta enters as `u^T dW v`, whose size for random signs is |dW|_F, so a
missing, doubled or misplaced delta is caught once |dW|_F exceeds about NOISE_SIGMAS * u times
|W_base|_F: in float32 (CPU) when |dW|_F > ~1e-6 |W|_F, always at the tiny models' trained sizes;
in bf16 when |dW|_F > ~4% of |W|_F, which a freshly trained adapter often is not. That limit is
the served dtype's: a delta below it is rounded away in the merged bf16 weight itself, so vLLM
does not serve it either. The first merged sync of a process therefore self-tests on seeded
random factors large enough to be seen, as the adapter check does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lorarl.errors import SyncError
from lorarl.sync.semantic import (
    EXPERT_PARTS,
    PEFT_PREFIX,
    PROJECTIONS,
    Projection,
    _local,
    compare,
    signs,
    unit_roundoff,
)


@dataclass(frozen=True)
class TrainerBase:
    """The frozen weight under one PEFT LoRA layer: [out, in], or [E, out, in] for experts."""

    path: str  # HF module path (Linear) or experts module path (ParamWrapper)
    weight: Tensor  # possibly an FSDP DTensor, sharded on dim 0
    parameter: str | None  # gate_up_proj | down_proj for an expert parameter


def trainer_bases(model: torch.nn.Module, adapter: str = "default") -> list[TrainerBase]:
    """The base weight of every LoRA layer of a PEFT model, as its forward reads it."""
    out = []
    for name, module in model.named_modules():
        factors_a = getattr(module, "lora_A", None)
        if not isinstance(factors_a, torch.nn.ModuleDict) or adapter not in factors_a:
            continue
        path = name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name
        experts = int(getattr(module, "num_experts", 1) or 1)
        if experts > 1:
            while path.endswith(".base_layer"):  # nested wrappers (both expert parameters targeted)
                path = path[: -len(".base_layer")]
            out.append(TrainerBase(path, module.get_param(), module.parameter_name))
        else:
            out.append(TrainerBase(path, module.get_base_layer().weight, None))
    if not out:
        raise SyncError("the trainer's model has no LoRA layers; nothing to compare with vLLM")
    return out


def _base_sums(base: TrainerBase, count: int) -> tuple[list[str], Tensor]:
    """(module paths, this rank's share [paths, count + 1] of each path's u^T W v and |W|_F^2).
    Float64 one matrix at a time: a whole expert stack in float64 would be GBs at 30B-A3B."""
    local, offset = _local(base.weight)
    parts = EXPERT_PARTS[base.parameter] if base.parameter else (None,)
    if base.parameter is None:
        n_out, n_in = base.weight.shape
        stacks, experts = local.unsqueeze(0), 1
    else:
        _, n_out, n_in = base.weight.shape
        stacks, experts = local, base.weight.shape[0]
    rows = n_out // len(parts)
    u = signs(rows, "out", count, device=local.device)
    v = signs(n_in, "in", count, device=local.device)
    paths = [base.path if part is None else f"{base.path}.{e}.{part}" for e in range(experts) for part in parts]
    sums = torch.zeros(len(paths), count + 1, dtype=torch.float64, device=local.device)
    for k in range(stacks.shape[0]):
        if base.parameter is None:
            w, first_row, e = stacks[0].to(torch.float64), offset, 0
        else:
            w, first_row, e = stacks[k].to(torch.float64), 0, offset + k
        for i in range(len(parts)):
            lo, hi = max(first_row, i * rows), min(first_row + w.shape[0], (i + 1) * rows)
            if lo >= hi:
                continue
            block = w[lo - first_row : hi - first_row]
            row = e * len(parts) + i
            sums[row, :count] = ((u[:, lo - i * rows : hi - i * rows] @ block) * v).sum(-1)
            sums[row, count] = (block * block).sum()
    return paths, sums


@dataclass(frozen=True)
class BaseProjection:
    values: Tensor  # [PROJECTIONS] float64: u^T W_base v
    norm: float  # |W_base|_F


@dataclass(frozen=True)
class BaseProjections:
    modules: dict[str, BaseProjection]
    roundoff: float  # the coarsest unit roundoff of the base weights' dtypes (the merge casts to it)


def base_projections(
    bases: list[TrainerBase], all_reduce: Callable[[Tensor], Tensor] | None = None, count: int = PROJECTIONS
) -> BaseProjections:
    """Per HF module path, u^T W_base v and |W_base|_F. Collective like trainer_projections (one
    all-reduce over the ranks sharing the shards)."""
    shares = [_base_sums(b, count) for b in bases]
    flat = torch.cat([s.reshape(-1) for _, s in shares])
    if all_reduce is not None:
        flat = all_reduce(flat)
    flat = flat.cpu()
    out: dict[str, BaseProjection] = {}
    offset = 0
    for paths, s in shares:
        full = flat[offset : offset + s.numel()].view_as(s)
        offset += s.numel()
        for i, path in enumerate(paths):
            out[path] = BaseProjection(full[i, :count].clone(), float(full[i, count].sqrt()))
    return BaseProjections(out, unit_roundoff(*{b.weight.dtype for b in bases}))


def merged_expected(base: dict[str, BaseProjection], delta: dict[str, Projection]) -> dict[str, Projection]:
    """u^T (W_base + delta) v per module, with `noise` the Frobenius norm the rounding scales with
    (|W_base|_F + scaling |B|_F |A|_F) for each of the projections."""
    if set(base) != set(delta):
        odd = sorted(set(base) ^ set(delta))[0]
        raise SyncError(
            f"the trainer's base weights and LoRA layers disagree at '{odd}'; cannot form the merged weight"
        )
    out = {}
    for path, d in delta.items():
        b = base[path]
        norm = b.norm + (d.delta_norm or 0.0)
        out[path] = Projection(b.values + d.values, torch.full_like(d.values, norm), d.out_features, d.in_features)
    return out


class MergedCheck:
    """The merged-mode semantic check of one worker; holds the base's projections once computed."""

    def __init__(self) -> None:
        self._base: BaseProjections | None = None

    def verify(self, engine, rollout, rank: int | None = None) -> float:
        """1.0, or a SyncError naming the first module whose served weight is not the trainer's
        W_base + delta. `engine`: `base_projections` and `lora_projections` (collective);
        `rollout`: a VLLMRollout holding merged weights."""
        if self._base is None:
            self._base = engine.base_projections()
        expected = merged_expected(self._base.modules, engine.lora_projections())
        wanted = {path: (i, p.out_features, p.in_features) for i, (path, p) in enumerate(expected.items())}
        values, share, read_roundoff = rollout.weight_projections(wanted)
        observed = {path: (values[i], float(share[i])) for i, path in enumerate(expected)}
        roundoff = max(unit_roundoff(rollout.torch_dtype, torch.float32), self._base.roundoff) + read_roundoff
        return compare(expected, observed, roundoff, rank, merged=True)
