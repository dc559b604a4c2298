"""The weights vLLM serves, projected inside its worker: the merged semantic check's observed side.

Handed to vLLM's worker through collective_rpc (lorarl.sync.semantic_merged). Every module is
read where vLLM keeps it after its own loading, named by the HF module path it serves:

- a linear layer: its weight, with a fused layer's rows split by the layer's own `output_sizes`
  in the order of the model's `packed_modules_mapping` (qkv_proj -> q, k, v; gate_up_proj ->
  gate, up). vLLM's CPU build keeps linear weights only packed for its GEMM library (the
  parameter is left empty), so there W v comes from the layer's own `quant_method.apply`, vLLM's
  kernel on its packed weight, and the rollout reports that product's extra rounding.
- a fused-MoE layer: its w13 stack ([local experts, 2 I, H], gate rows then up rows, padded to
  2 P rows when the CPU kernel pads the intermediate size) and w2 stack ([E, H, I]); local expert
  l is global expert e where vLLM's expert map says so. The CPU build re-lays both stacks in
  place for its grouped GEMM; that re-layout is a permutation of the elements, which is read
  back by passing the element indices through vLLM's own prepack op and inverted.

Tensor-parallel slices are placed with lorarl.sync.semantic.slice_offset; each rank returns its
part and the share of each module it holds, which the rollout sums over the engine's ranks.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from lorarl.errors import SyncError
from lorarl.rollout.vllm.in_worker import _cpu_prepacked_experts, _served, vllm_worker
from lorarl.sync.semantic import PROJECTIONS, signs, slice_offset, unit_roundoff

Wanted = dict[str, tuple[int, int, int]]  # HF module path -> (row in the result, full out, full in)


class _Result:
    def __init__(self, wanted: Wanted, count: int):
        self.wanted = wanted
        self.values = torch.zeros(len(wanted), count, dtype=torch.float64)
        self.share = torch.zeros(len(wanted), dtype=torch.float64)
        self.roundoff = 0.0
        self.count = count

    def add(self, path: str, w_v: Tensor, cols: int, tp: tuple[int, int]) -> None:
        """Module `path`'s block held here: `w_v` [count, rows] = W_block v_slice, `cols` the
        input columns held."""
        rows = w_v.shape[1]
        index, n_out, n_in = self.wanted[path]
        r0, rep_rows = slice_offset(n_out, rows, *tp)
        c0, rep_cols = slice_offset(n_in, cols, *tp)
        rep = rep_rows * rep_cols / tp[1]  # ranks holding this same block
        u = signs(n_out, "out", self.count)[:, r0 : r0 + rows]
        self.values[index] += (u * w_v.cpu()).sum(-1) / rep
        self.share[index] += rows * cols / (n_out * n_in) / rep


def _times_v(layer, weight: Tensor | None, rows: int, v: Tensor, result: _Result) -> Tensor:
    """[count, rows] W v for a linear layer's local weight (all its rows), in float64."""
    if weight is not None and weight.numel() == rows * v.shape[1]:
        w = weight.detach().reshape(rows, -1)
        if w.dtype in (torch.float32, torch.float64):
            return v.to(w.device) @ w.to(torch.float64).T
        # 16-bit weights: a float32 product (a float64 copy of a 7B layer per module is not needed)
        result.roundoff = max(result.roundoff, unit_roundoff(torch.float32) * math.sqrt(v.shape[1]))
        return (v.to(w.device, torch.float32) @ w.float().T).double()
    # Packed for the CPU GEMM: vLLM's own kernel on its packed weight, no bias.
    dtype = getattr(layer, "params_dtype", None) or torch.get_default_dtype()
    out = layer.quant_method.apply(layer, v.to(dtype))
    result.roundoff = max(result.roundoff, unit_roundoff(dtype) + unit_roundoff(torch.float32) * math.sqrt(v.shape[1]))
    return out.double()


def _linear(name: str, layer, packed: dict, result: _Result, tp: tuple[int, int]) -> None:
    prefix, _, leaf = name.rpartition(".")
    parts = packed.get(leaf)
    if parts is not None:
        paths = [f"{prefix}.{p}" if prefix else p for p in parts]
        sizes = [s // tp[1] for s in layer.output_sizes]
    else:
        paths, sizes = [name], [layer.output_size_per_partition]
    if len(paths) != len(sizes):
        raise SyncError(f"vLLM's {name} packs {parts} into {len(sizes)} output blocks; lorarl cannot split its rows")
    if not any(p in result.wanted for p in paths):
        return
    cols = layer.input_size_per_partition
    n_in = result.wanted[next(p for p in paths if p in result.wanted)][2]
    c0, _ = slice_offset(n_in, cols, *tp)
    v = signs(n_in, "in", result.count)[:, c0 : c0 + cols]
    w_v = _times_v(layer, getattr(layer, "weight", None), sum(sizes), v, result)
    start = 0
    for path, rows in zip(paths, sizes):
        if path in result.wanted:
            result.add(path, w_v[:, start : start + rows], cols, tp)
        start += rows


@functools.lru_cache(maxsize=16)
def _prepack_order(shape: tuple[int, ...], dtype: torch.dtype, isa: str) -> Tensor:
    """For the CPU fused-MoE prepack of a stack of `shape`: packed.flatten() ==
    raw.flatten()[order]. Read by packing the element indices themselves, in digits small enough
    for `dtype` to hold exactly."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    numel = math.prod(shape)
    base = round(1 / torch.finfo(dtype).eps)  # 2^mantissa bits: every integer below it is exact
    order = torch.zeros(numel, dtype=torch.long)
    index = torch.arange(numel, dtype=torch.long)
    for d in range(max(1, math.ceil(math.log(numel, base)))):
        digit = (index // base**d) % base
        packed = cpu_prepack_moe_weight(digit.to(dtype).reshape(shape), isa)
        order += packed.reshape(-1).to(torch.long) * base**d
    if not torch.equal(order.sort().values, index):
        raise SyncError(
            f"vLLM's CPU fused-MoE prepack ({isa}) of a {shape} stack is not a re-layout of its elements; "
            "lorarl cannot read the served expert weights (trainer.check_sync=false turns the sync checks off)"
        )
    return order


def _raw_stack(weight: Tensor, isa: str | None) -> Tensor:
    if isa is None:
        return weight.detach()
    order = _prepack_order(tuple(weight.shape), weight.dtype, isa)
    raw = torch.empty(weight.numel(), dtype=weight.dtype)
    raw[order] = weight.detach().reshape(-1).cpu()
    return raw.view(weight.shape)


def _experts(name: str, layer, isa: str | None, result: _Result) -> None:
    """A fused-MoE layer's experts, as `<experts>.<e>.gate_proj|up_proj|down_proj`."""
    prefix = _served(name.removesuffix(".routed_experts") + ".").rstrip(".")
    config = getattr(getattr(layer, "moe_config", None), "moe_parallel_config", None) or layer
    tp = (int(getattr(config, "tp_rank", 0)), int(getattr(config, "tp_size", 1)))
    w13, w2 = _raw_stack(layer.w13_weight, isa), _raw_stack(layer.w2_weight, isa)
    local, padded = w13.shape[0], w13.shape[1] // 2
    inter = int(getattr(layer, "intermediate_size_per_partition", padded))
    expert_map = getattr(layer, "expert_map", None)
    global_of = list(range(local))
    if expert_map is not None:
        global_of = [int(e) for e in (expert_map >= 0).nonzero().flatten()]
        global_of.sort(key=lambda e: int(expert_map[e]))
    for slot, e in enumerate(global_of):
        for part, block in (
            ("gate_proj", w13[slot, :inter]),
            ("up_proj", w13[slot, padded : padded + inter]),
            ("down_proj", w2[slot, :, :inter]),
        ):
            path = f"{prefix}.{e}.{part}"
            if path not in result.wanted:
                continue
            n_in = result.wanted[path][2]
            rows, cols = block.shape
            c0, _ = slice_offset(n_in, cols, *tp)
            v = signs(n_in, "in", result.count)[:, c0 : c0 + cols]
            result.add(path, _times_v(None, block, rows, v, result), cols, tp)


def weight_projections(
    worker, wanted: Wanted, tp: tuple[int, int], count: int = PROJECTIONS
) -> tuple[Tensor, Tensor, float]:
    """The merged check's observed side on this rank: ([len(wanted), count] float64 u^T W v of
    each wanted HF module's served weight, [len(wanted)] share of the module held here, the
    unit roundoff the reading itself adds). Partial values sum to the whole over the ranks."""
    model = vllm_worker(worker).model_runner.get_model()
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    isa = {n: experts.isa for n, _, experts in _cpu_prepacked_experts(model)}
    result = _Result(wanted, count)
    for name, module in model.named_modules():
        if hasattr(module, "w13_weight") and hasattr(module, "w2_weight"):
            _experts(name, module, isa.get(name), result)
        elif hasattr(module, "output_size_per_partition") and hasattr(module, "input_size_per_partition"):
            _linear(_served(name + ".").rstrip("."), module, packed, result, tp)
    return result.values, result.share, result.roundoff
