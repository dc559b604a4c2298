"""The merged semantic check's base side on the Megatron backend, from Megatron's own base weights.

Pure torch, no Megatron import. With `model.lora.merge=true` vLLM serves W_base + delta, and
lorarl.sync.semantic_merged compares each HF module's `u^T W v` with the trainer's
`u^T W_base v + u^T (s B A) v`. The delta part is lorarl.engines.megatron.projections; this
module gives the base part, `u^T W_base v` and |W_base|_F per HF module path, read straight from
the frozen weight each Megatron-Bridge LoRA wrapper holds (`<linear>.to_wrap.weight`) on this
rank: the fused, tensor-parallel-sharded tensors the forward multiplies by. It never reads the
bridge's HF export of the base (`export_hf_weights`), whose unfuse and merge are what the check
verifies.

Where each local element of a base weight belongs (tensor-parallel rank t of T; the same row map
as the LoRA B of the same linear, `projections.row_map`):
- `linear_qkv` (column-parallel): rows per query group [q heads of the group; k; v]; rank t
  holds groups t*G/T ... whole, every input column.
- `linear_fc1` (column-parallel): rows [gate_t; up_t], every input column.
- `linear_proj`, `linear_fc2` (row-parallel): every output row, input columns
  t*in/T ... (t+1)*in/T.
- a routed expert's linears: whole (expert tensor parallelism 1, which the config requires);
  local expert l of expert-parallel rank p is global expert p * local + l.
A CanonicalLoRA wrapper holds the fused base too; only the projections that carry a sub-adapter
are LoRA modules, so only those are read.

Each rank computes its share of every module's `u^T W v` and squared norm (the u and v entries of
the rows and columns it holds); summing the shares over the tensor-parallel group (dense layers)
and the expert tensor-and-model-parallel group (experts) gives every module once, pipeline stages
then hold disjoint layers (the engine gathers them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from lorarl.engines.megatron.projections import (
    ROW_PARALLEL,
    SUB_PROJECTIONS,
    MegatronShape,
    Reduce,
    concat,
    every_expert,
    expert_path,
    global_layer_names,
    hf_path,
    in_features,
    row_map,
    summed,
)
from lorarl.errors import SyncError
from lorarl.sync.semantic import PROJECTIONS, signs, unit_roundoff
from lorarl.sync.semantic_merged import BaseProjection, BaseProjections

_BASE = re.compile(
    r"^(?:module\.)*decoder\.layers\.(?P<layer>\d+)\.(?:self_attention|mlp)"
    r"(?:\.experts\.local_experts\.(?P<expert>\d+))?\.(?P<linear>linear_qkv|linear_proj|linear_fc1|linear_fc2)"
    r"\.to_wrap\.weight$"
)
# Any frozen weight a Megatron-Bridge adapter wrapper holds (grouped experts: `weight<e>`).
_WRAPPED = re.compile(r"\.to_wrap\.weight\d*$")
_ADAPTER_IN = re.compile(r"^(?P<prefix>.+)\.adapter\.(?:(?P<sub>adapter_[a-z]+)\.)?linear_in\.weight$")
# float64 elements of a base weight converted at once: bounded, a 7B fused gate/up is 136M.
CHUNK_ELEMENTS = 32 << 20


@dataclass(frozen=True)
class _Base:
    layer: int
    expert: int | None  # global expert number
    linear: str
    weight: Tensor  # this rank's shard [local out, local in]
    projections: tuple[str, ...] | None  # HF projections carrying LoRA; None: all fused in the linear


def _covered(adapters: Iterable[str]) -> dict[str, tuple[str, ...] | None]:
    """Per wrapper prefix, the HF projections its adapter covers: None for one fused adapter (all
    projections fused in the linear), else the CanonicalLoRA sub-adapters' projections."""
    fused: set[str] = set()
    subs: dict[str, set[str]] = {}
    for name in adapters:
        m = _ADAPTER_IN.match(name)
        if m is None:
            continue
        if m["sub"] is None:
            fused.add(m["prefix"])
        elif m["sub"] in SUB_PROJECTIONS:
            subs.setdefault(m["prefix"], set()).add(SUB_PROJECTIONS[m["sub"]])
        else:
            raise SyncError(f"Megatron LoRA sub-adapter '{name}' covers no HF projection the check knows")
    return {**{p: tuple(sorted(s)) for p, s in subs.items()}, **dict.fromkeys(fused)}


def _bases(weights: Iterable[tuple[str, Tensor]], adapters: Iterable[str], shape: MegatronShape) -> list[_Base]:
    covered = _covered(adapters)
    out = []
    for name, w in weights:
        m = _BASE.match(name)
        if m is None:
            if _WRAPPED.search(name):
                raise SyncError(f"Megatron LoRA base weight '{name}' is in no layout the merged semantic check knows")
            continue
        prefix = name[: -len(".to_wrap.weight")]
        if prefix not in covered:
            raise SyncError(f"Megatron LoRA wrapper '{prefix}' holds a base weight but no adapter")
        local = m["expert"]
        expert = None if local is None else shape.ep_rank * shape.local_experts + int(local)
        out.append(_Base(int(m["layer"]), expert, m["linear"], w, covered[prefix]))
    return sorted(out, key=lambda b: (b.layer, -1 if b.expert is None else b.expert, b.linear))


def _row_sums(w: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """([count, rows] W v, [rows] squared row norms) of a local weight, in float64 on the host,
    computed where the weight lives, CHUNK_ELEMENTS at a time."""
    v = v.to(w.device)
    step = max(1, CHUNK_ELEMENTS // max(1, w.shape[1]))
    w_v, squares = [], []
    for start in range(0, w.shape[0], step):
        block = w[start : start + step].detach().to(torch.float64)
        w_v.append(v @ block.T)
        squares.append((block * block).sum(1))
    return torch.cat(w_v, 1).cpu(), torch.cat(squares).cpu()


def _fused_out(linear: str, expert: bool, shape: MegatronShape) -> int:
    """The full output rows of a Megatron linear: every HF projection fused in it."""
    if linear == "linear_qkv":
        return (shape.heads + 2 * shape.query_groups) * shape.head_dim
    if linear == "linear_fc1":
        return 2 * (shape.expert_ffn if expert else shape.ffn)
    return shape.hidden


def _shares(base: _Base, shape: MegatronShape, count: int) -> tuple[list[str], Tensor]:
    """(HF paths of the base's LoRA projections, this rank's share [paths, count + 1] of each
    one's u^T W v and |W|_F^2)."""
    expert = base.expert is not None
    t, size = (0, 1) if expert else (shape.tp_rank, shape.tp_size)
    rows, cols = base.weight.shape
    n_in = in_features(base.linear, expert, shape)
    row_parallel = base.linear in ROW_PARALLEL
    n_out = _fused_out(base.linear, expert, shape)
    whole = (rows, cols * size) if row_parallel else (rows * size, cols)
    if whole != (n_out, n_in):
        raise SyncError(
            f"layer {base.layer} {base.linear}: base weight is {tuple(base.weight.shape)} on tensor-parallel rank "
            f"{t} of {size}; the whole is ({n_out}, {n_in})"
        )
    # Row-parallel: every output row is here, input columns t*cols...; column-parallel: rank t's rows.
    c0 = t * cols if row_parallel else 0
    w_v, squares = _row_sums(base.weight, signs(n_in, "in", count)[:, c0 : c0 + cols])
    maps = row_map(base.linear, None, expert, rows, shape, (0, 1) if row_parallel else (t, size))
    paths, sums = [], []
    for proj, local, hf_rows, proj_out in maps:
        if base.projections is not None and proj not in base.projections:
            continue
        u = signs(proj_out, "out", count)[:, hf_rows]
        sums.append(torch.cat([(u * w_v[:, local]).sum(-1), squares[local].sum().reshape(1)]))
        paths.append(hf_path(base.layer, base.expert, proj))
    if not paths:
        raise SyncError(f"layer {base.layer} {base.linear}: its adapter covers none of {[m[0] for m in maps]}")
    return paths, torch.stack(sums)


@dataclass(frozen=True)
class BaseShares:
    """This rank's shares, laid out the same on every rank of the group that sums them: dense
    bases in (layer, linear) order, experts as every global expert of each (layer, linear),
    zeros where another expert-parallel rank holds the expert. Entries: (HF paths, length)."""

    dense: list[tuple[list[str], int]]
    dense_flat: Tensor
    experts: list[tuple[list[str], int]]
    experts_flat: Tensor
    roundoff: float  # the coarsest unit roundoff of the base weights' dtypes


def megatron_base_shares(
    weights: Iterable[tuple[str, Tensor]], adapters: Iterable[str], shape: MegatronShape, count: int = PROJECTIONS
) -> BaseShares:
    """This rank's shares of every LoRA module's base projections. `weights`: named parameters
    (every one may be passed; `<linear>.to_wrap.weight` are read), `adapters`: the LoRA parameter
    names (which projections of a wrapped linear carry LoRA). Names with global layer numbers."""
    bases = _bases(weights, adapters, shape)
    if not bases:
        raise SyncError("the Megatron model has no LoRA-wrapped base weights; nothing to compare with vLLM")
    dense: list[tuple[list[str], int]] = []
    dense_flats: list[Tensor] = []
    groups: dict[tuple[int, str], dict[int, tuple[list[str], Tensor]]] = {}
    for base in bases:
        paths, sums = _shares(base, shape, count)
        if base.expert is None:
            dense.append((paths, sums.numel()))
            dense_flats.append(sums.reshape(-1))
        else:
            groups.setdefault((base.layer, base.linear), {})[base.expert] = (paths, sums.reshape(-1))
    entries, experts_flat = every_expert(groups, shape.experts, lambda paths, e: [expert_path(p, e) for p in paths])
    experts = [(paths, numel) for _, paths, numel in entries]
    roundoff = unit_roundoff(*{b.weight.dtype for b in bases})
    return BaseShares(dense, concat(dense_flats), experts, experts_flat, roundoff)


def finish_base(
    entries: list[tuple[list[str], int]], flat: Tensor, count: int = PROJECTIONS
) -> dict[str, BaseProjection]:
    """Per HF path, u^T W_base v and |W_base|_F from summed shares laid out as `entries` say."""
    out: dict[str, BaseProjection] = {}
    offset = 0
    for paths, numel in entries:
        part = flat[offset : offset + numel].cpu().view(len(paths), count + 1)
        offset += numel
        for path, row in zip(paths, part):
            if path in out:
                raise SyncError(f"two Megatron LoRA base weights cover {path}")
            out[path] = BaseProjection(row[:count].clone(), float(row[count].sqrt()))
    return out


def megatron_base_projections(
    weights: Iterable[tuple[str, Tensor]],
    adapters: Iterable[str],
    shape: MegatronShape,
    reduce_dense: Reduce | None = None,
    reduce_experts: Reduce | None = None,
    count: int = PROJECTIONS,
) -> BaseProjections:
    """Per HF module path of this pipeline stage, u^T W_base v and |W_base|_F from Megatron's own
    base weights. Collective when the reduces are given: one sum over the tensor-parallel group for
    dense layers, one over the expert tensor-and-model-parallel group for experts."""
    shares = megatron_base_shares(weights, adapters, shape, count)
    dense, experts = summed(shares, reduce_dense, reduce_experts)
    modules = {**finish_base(shares.dense, dense, count), **finish_base(shares.experts, experts, count)}
    return BaseProjections(modules, shares.roundoff)


def model_bases(model_chunks: list) -> tuple[list[tuple[str, Tensor]], list[str]]:
    """(the frozen base weights under Megatron-Bridge's LoRA wrappers, `<linear>.to_wrap.weight`;
    the LoRA parameter names) of Megatron model chunks, layers named by their global number
    (`projections.global_layer_names`), as `megatron_base_shares` takes them."""
    weights: list[tuple[str, Tensor]] = []
    adapters: list[str] = []
    for chunk in model_chunks:
        global_name = global_layer_names(chunk)
        for name, p in chunk.named_parameters():
            if _WRAPPED.search(name):
                weights.append((global_name(name), p))
            elif ".adapter." in name:
                adapters.append(global_name(name))
    return weights, adapters


__all__ = ["BaseShares", "megatron_base_shares", "finish_base", "megatron_base_projections", "model_bases"]
