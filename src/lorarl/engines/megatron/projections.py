"""The semantic sync check's expected side on the Megatron backend, from Megatron's own LoRA factors.

Pure torch, no Megatron import. Megatron-Bridge keeps LoRA on the fused linears: one adapter
(A = `adapter.linear_in.weight`, B = `adapter.linear_out.weight`, output scaled by alpha / dim)
per `linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`, and per local expert of a
SequentialMLP. This module reads each HF module's `u^T (s B A) v` (lorarl.sync.semantic's
seeded pairs, HF module paths) straight from those factors and their tensor-parallel shards,
through its own map of where each fused row belongs. It shares nothing with the export's unfuse
(the bridge's split of the fused B): that is what it checks.

Where each local row of B belongs (tensor-parallel rank t of T):
- `linear_qkv`: rows run per query group, [q heads of the group; k; v] (megatron-core's
  interleaved QKV); rank t holds groups t*G/T ... whole.
- `linear_fc1`: rows [gate_t; up_t], rank t's slices of gate and of up.
- `linear_proj`, `linear_fc2`, CanonicalLoRA's per-projection adapters (`adapter.adapter_q`, ...):
  B's rows are the projection's, rank t holding the t-th contiguous slice.
A is split on the rank dim for column-parallel bases (linear_qkv, linear_fc1, canonical
sub-adapters) and on its input columns for row-parallel ones (linear_proj, linear_fc2)
(megatron.bridge.peft.utils.ParallelLinearAdapter). Experts are not split (expert tensor
parallelism 1, which the config requires) and local expert l of expert-parallel rank p is
global expert p * local + l.

Each rank computes its shares of y = A v, z = B^T u (per HF projection) and the squared norms;
summing the shares over the tensor-parallel group (dense layers) and the expert
tensor-and-model-parallel group (experts) gives every module once (`finish`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lorarl.errors import SyncError
from lorarl.sync.semantic import PROJECTIONS, Projection, signs

_ADAPTER = re.compile(
    r"^(?:module\.)*decoder\.layers\.(?P<layer>\d+)\.(?:self_attention|mlp)"
    r"(?:\.experts\.local_experts\.(?P<expert>\d+))?\.(?P<linear>linear_qkv|linear_proj|linear_fc1|linear_fc2)"
    r"\.adapter\.(?:(?P<sub>adapter_[a-z]+)\.)?(?P<side>linear_in|linear_out)\.weight$"
)
# CanonicalLoRA's per-projection sub-adapters -> the HF projection each covers.
SUB_PROJECTIONS = {"adapter_q": "q_proj", "adapter_k": "k_proj", "adapter_v": "v_proj", "adapter_gate": "gate_proj"}
SUB_PROJECTIONS["adapter_up"] = "up_proj"
ROW_PARALLEL = ("linear_proj", "linear_fc2")


@dataclass(frozen=True)
class MegatronShape:
    """The sizes the row maps need, and where this rank sits."""

    heads: int
    query_groups: int
    head_dim: int
    hidden: int
    ffn: int  # dense MLP intermediate size (0 when every layer is MoE)
    expert_ffn: int  # an expert's intermediate size (0 for a dense model)
    rank: int  # LoRA rank (dim)
    experts: int = 0  # routed experts in all
    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    local_experts: int = 0


@dataclass(frozen=True)
class _Adapter:
    layer: int
    expert: int | None  # global expert number
    linear: str
    sub: str | None
    a: Tensor
    b: Tensor
    scaling: float


def hf_path(layer: int, expert: int | None, projection: str) -> str:
    parent = "self_attn" if projection in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    if expert is not None:
        return f"model.layers.{layer}.mlp.experts.{expert}.{projection}"
    return f"model.layers.{layer}.{parent}.{projection}"


def row_map(
    linear: str, sub: str | None, expert: bool, n_local: int, shape: MegatronShape, tp: tuple[int, int]
) -> list[tuple[str, Tensor, int, int]]:
    """Where the `n_local` output rows tensor-parallel rank tp[0] of tp[1] holds of a column-split
    `linear` (its LoRA B, or its base weight) belong: [(HF projection, local rows of it, their HF
    rows, the projection's full out)], rows as index tensors. `sub`: a CanonicalLoRA sub-adapter
    (its own projection's rows); `expert`: the linear is a routed expert's."""
    t, size = tp
    local = torch.arange(n_local)
    hd, heads, groups = shape.head_dim, shape.heads, shape.query_groups
    ffn = shape.expert_ffn if expert else shape.ffn
    if sub is not None:
        proj = SUB_PROJECTIONS[sub]
        full = {"q_proj": heads * hd, "k_proj": groups * hd, "v_proj": groups * hd}.get(proj, ffn)
        return [(proj, local, t * n_local + local, full)]
    if linear == "linear_qkv":
        per_group = heads // groups
        block = (per_group + 2) * hd
        group = t * (groups // size) + local // block
        o = local % block
        q, k = o < per_group * hd, (o >= per_group * hd) & (o < (per_group + 1) * hd)
        v = o >= (per_group + 1) * hd
        return [
            ("q_proj", local[q], group[q] * per_group * hd + o[q], heads * hd),
            ("k_proj", local[k], group[k] * hd + o[k] - per_group * hd, groups * hd),
            ("v_proj", local[v], group[v] * hd + o[v] - (per_group + 1) * hd, groups * hd),
        ]
    if linear == "linear_fc1":
        half = n_local // 2
        return [
            ("gate_proj", local[:half], t * half + local[:half], ffn),
            ("up_proj", local[half:], t * half + local[half:] - half, ffn),
        ]
    proj = "o_proj" if linear == "linear_proj" else "down_proj"
    return [(proj, local, t * n_local + local, shape.hidden)]


def in_features(linear: str, expert: bool, shape: MegatronShape) -> int:
    """The full input width of a Megatron linear (of every HF projection fused in it)."""
    if linear == "linear_proj":
        return shape.heads * shape.head_dim
    if linear == "linear_fc2":
        return shape.expert_ffn if expert else shape.ffn
    return shape.hidden


def _shares(ad: _Adapter, shape: MegatronShape, count: int) -> tuple[list[tuple[str, int, int]], Tensor]:
    """([(HF path, out, in)] of the adapter's projections, this rank's share of [y; a_sq; z_p; b_sq_p ...])."""
    tp = (0, 1) if ad.expert is not None else (shape.tp_rank, shape.tp_size)
    r, n_in = shape.rank, in_features(ad.linear, ad.expert is not None, shape)
    a, b = ad.a.detach().to(torch.float64), ad.b.detach().to(torch.float64)
    y = torch.zeros(count, r, dtype=torch.float64)
    a_sq = torch.zeros(r, dtype=torch.float64)
    if ad.linear in ROW_PARALLEL and ad.sub is None:
        if a.shape[0] != r or a.shape[1] * tp[1] != n_in:
            raise SyncError(f"layer {ad.layer} {ad.linear}: LoRA A is {tuple(a.shape)}, expected ({r}, {n_in}/{tp[1]})")
        c0 = tp[0] * a.shape[1]
        y += signs(n_in, "in", count)[:, c0 : c0 + a.shape[1]] @ a.T.cpu()
        a_sq += (a * a).sum(1).cpu()
    else:
        if a.shape[0] * tp[1] != r or a.shape[1] != n_in:
            raise SyncError(f"layer {ad.layer} {ad.linear}: LoRA A is {tuple(a.shape)}, expected ({r}/{tp[1]}, {n_in})")
        r0 = tp[0] * a.shape[0]
        y[:, r0 : r0 + a.shape[0]] = signs(n_in, "in", count) @ a.T.cpu()
        a_sq[r0 : r0 + a.shape[0]] = (a * a).sum(1).cpu()
    paths, parts = [], [y.reshape(-1), a_sq]
    b = b.cpu()
    for proj, rows, hf_rows, n_out in row_map(ad.linear, ad.sub, ad.expert is not None, b.shape[0], shape, tp):
        u = signs(n_out, "out", count)[:, hf_rows]
        parts += [(u @ b[rows]).reshape(-1), (b[rows] * b[rows]).sum(0)]
        paths.append((hf_path(ad.layer, ad.expert, proj), n_out, n_in))
    return paths, torch.cat(parts)


def _adapters(params: Iterable[tuple[str, Tensor]], scaling: Mapping[str, float], shape: MegatronShape):
    pairs: dict[tuple, dict[str, Tensor]] = {}
    for name, p in params:
        m = _ADAPTER.match(name)
        if m is None:
            if ".adapter." in name:
                raise SyncError(f"Megatron LoRA parameter '{name}' is in no layout the semantic check knows")
            continue
        local = m["expert"]
        expert = None if local is None else shape.ep_rank * shape.local_experts + int(local)
        key = (int(m["layer"]), expert, m["linear"], m["sub"], name.rsplit(f".{m['side']}.", 1)[0])
        pairs.setdefault(key, {})[m["side"]] = p
    for (layer, expert, linear, sub, prefix), sides in sorted(pairs.items(), key=lambda kv: str(kv[0])):
        if set(sides) != {"linear_in", "linear_out"}:
            raise SyncError(f"Megatron LoRA adapter '{prefix}' lacks linear_in or linear_out")
        if prefix not in scaling:
            raise SyncError(f"Megatron LoRA adapter '{prefix}' has no alpha / dim to scale by")
        yield _Adapter(layer, expert, linear, sub, sides["linear_in"], sides["linear_out"], scaling[prefix])


Reduce = Callable[[Tensor], Tensor]
# One adapter's entry in a flat share: its projections (HF path, out, in), its length, its scaling.
Entry = tuple[list[tuple[str, int, int]], int, float]


@dataclass(frozen=True)
class Shares:
    """This rank's shares, laid out the same on every rank of the group that sums them: dense
    adapters in order, experts as every global expert of each (layer, linear) group, zeros where
    another expert-parallel rank holds the expert."""

    dense: list[Entry]
    dense_flat: Tensor
    experts: list[Entry]
    experts_flat: Tensor


def megatron_shares(
    params: Iterable[tuple[str, Tensor]], scaling: Mapping[str, float], shape: MegatronShape, count: int = PROJECTIONS
) -> Shares:
    """This rank's shares of every adapter's projections (see `megatron_lora_projections`)."""
    dense: list[Entry] = []
    dense_flats: list[Tensor] = []
    groups: dict[tuple, dict[int, tuple[list, Tensor]]] = {}
    scales: dict[tuple, float] = {}  # one scaling per group: its experts' adapters share the config
    for ad in _adapters(params, scaling, shape):
        paths, flat = _shares(ad, shape, count)
        if ad.expert is None:
            dense.append((paths, flat.numel(), ad.scaling))
            dense_flats.append(flat)
        else:
            key = (ad.layer, ad.linear, ad.sub or "")
            groups.setdefault(key, {})[ad.expert] = (paths, flat)
            scales.setdefault(key, ad.scaling)
    entries, experts_flat = every_expert(
        groups, shape.experts, lambda paths, e: [(expert_path(p, e), o, i) for p, o, i in paths]
    )
    experts = [(paths, numel, scales[key]) for key, paths, numel in entries]
    return Shares(dense, concat(dense_flats), experts, experts_flat)


def expert_path(path: str, expert: int) -> str:
    """An HF expert module path renamed to global expert `expert`."""
    return re.sub(r"\.experts\.\d+\.", f".experts.{expert}.", path)


def every_expert(
    groups: Mapping[tuple, Mapping[int, tuple[list, Tensor]]], experts: int, renamed: Callable[[list, int], list]
) -> tuple[list[tuple[tuple, list, int]], Tensor]:
    """Each group's (layer, linear, ...) shares for every global expert in turn, laid out the same on
    every expert-parallel rank so that a sum over them gives each expert once: where another rank
    holds an expert, zeros under the group's paths `renamed` to it. ([(group key, paths, length)],
    the shares flat)."""
    entries, flats = [], []
    for key in sorted(groups):
        group = groups[key]
        some_paths, some_flat = next(iter(group.values()))
        for e in range(experts):
            paths, flat = group[e] if e in group else (renamed(some_paths, e), torch.zeros_like(some_flat))
            entries.append((key, paths, flat.numel()))
            flats.append(flat)
    return entries, concat(flats)


def concat(flats: list[Tensor]) -> Tensor:
    """The shares end to end (float64; empty when there are none)."""
    return torch.cat(flats) if flats else torch.zeros(0, dtype=torch.float64)


def megatron_lora_projections(
    params: Iterable[tuple[str, Tensor]],
    scaling: Mapping[str, float],
    shape: MegatronShape,
    reduce_dense: Reduce | None = None,
    reduce_experts: Reduce | None = None,
    count: int = PROJECTIONS,
) -> dict[str, Projection]:
    """Per HF module path, the trainer's u^T (s B A) v from Megatron's LoRA parameters (named as
    in the model; `scaling` per adapter prefix `...adapter`, alpha / dim). Collective when the
    reduces are given: one sum over the tensor-parallel group for dense layers, one over the
    expert tensor-and-model-parallel group for experts."""
    shares = megatron_shares(params, scaling, shape, count)
    dense, experts = summed(shares, reduce_dense, reduce_experts)
    return {**finish(shares.dense, dense, shape.rank, count), **finish(shares.experts, experts, shape.rank, count)}


def summed(shares, reduce_dense: Reduce | None, reduce_experts: Reduce | None) -> tuple[Tensor, Tensor]:
    """A rank's (dense, expert) shares (`Shares` or base_projections' `BaseShares`) summed over their
    groups, each reduce run only where there is something to sum; as they are without reduces."""
    dense, experts = shares.dense_flat, shares.experts_flat
    if reduce_dense is not None and dense.numel():
        dense = reduce_dense(dense)
    if reduce_experts is not None and experts.numel():
        experts = reduce_experts(experts)
    return dense, experts


def finish(entries: list[Entry], flat: Tensor, r: int, count: int = PROJECTIONS) -> dict[str, Projection]:
    """Projections from summed shares laid out as `entries` say ([y; |A rows|^2; then per
    projection z; |B columns|^2], `_shares`)."""
    out: dict[str, Projection] = {}
    offset = 0
    for paths, numel, s in entries:
        part = flat[offset : offset + numel].cpu()
        offset += numel
        y, a_sq = part[: count * r].view(count, r), part[count * r : count * r + r]
        at = count * r + r
        for path, n_out, n_in in paths:
            z, b_sq = part[at : at + count * r].view(count, r), part[at + count * r : at + count * r + r]
            at += count * r + r
            values = s * (z * y).sum(-1)
            noise = s * (b_sq * y * y + z * z * a_sq).sum(-1).sqrt()
            if path in out:
                raise SyncError(f"two Megatron LoRA adapters cover {path}")
            out[path] = Projection(values, noise, n_out, n_in, s * float(b_sq.sum().sqrt() * a_sq.sum().sqrt()))
    return out


def shape_from_config(hf_config, rank: int, ps) -> MegatronShape:
    """The sizes from an HF config, the ranks from megatron-core's parallel_state `ps`."""
    heads = hf_config.num_attention_heads
    experts = int(getattr(hf_config, "num_experts", None) or 0)
    local = experts // ps.get_expert_model_parallel_world_size() if experts else 0
    return MegatronShape(
        heads=heads,
        query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        hidden=hf_config.hidden_size,
        ffn=int(getattr(hf_config, "intermediate_size", 0) or 0),
        expert_ffn=int(getattr(hf_config, "moe_intermediate_size", 0) or 0),
        rank=rank,
        experts=experts,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        ep_rank=ps.get_expert_model_parallel_rank() if experts else 0,
        local_experts=local,
    )


_LAYER = re.compile(r"^((?:module\.)*decoder\.layers\.)(\d+)(\..*)?$")


def global_layer_names(chunk) -> Callable[[str], str]:
    """name -> the same name with its layer renumbered by that TransformerLayer's own global
    `layer_number` (1-based), so a pipeline stage names its layers as the HF checkpoint does."""
    number: dict[str, int] = {}
    for name, module in chunk.named_modules():
        m = _LAYER.match(name)
        if m is not None and m[3] is None and hasattr(module, "layer_number"):
            number[m[2]] = int(module.layer_number) - 1

    def global_name(name: str) -> str:
        m = _LAYER.match(name)
        return name if m is None else f"{m[1]}{number.get(m[2], int(m[2]))}{m[3] or ''}"

    return global_name


def model_lora(model_chunks: list) -> tuple[list[tuple[str, Tensor]], dict[str, float]]:
    """(LoRA parameters by name, scaling alpha / dim per adapter module) of Megatron model chunks,
    read from the adapter modules themselves (megatron.bridge.peft's ParallelLinearAdapter scales
    its output by alpha / dim), layers named globally (`global_layer_names`)."""
    params: list[tuple[str, Tensor]] = []
    scaling: dict[str, float] = {}
    for chunk in model_chunks:
        global_name = global_layer_names(chunk)
        for name, module in chunk.named_modules():
            if name.endswith(".adapter") or re.search(r"\.adapter\.adapter_[a-z]+$", name):
                if hasattr(module, "alpha") and hasattr(module, "dim"):
                    scaling[global_name(name)] = float(module.alpha) / float(module.dim)
        params += [(global_name(n), p) for n, p in chunk.named_parameters() if ".adapter." in n]
    return params, scaling
