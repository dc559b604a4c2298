"""The semantic check: the delta vLLM applies per module is the delta the trainer trains.

The transport check proves vLLM holds the bytes that were sent; this one proves those bytes mean
what the trainer trained. Its two sides share no code with the export and none with each other:

- expected, in the trainer: for every LoRA module (every expert of a targeted expert parameter),
  the delta PEFT's layer applies, `scaling * B @ A`, from the trainer's own parameters and its own
  per-module scaling, as PEFT's Linear / ParamWrapper compute it;
- observed, inside vLLM: from the LoRA slots vLLM will compute with, after its own packing
  (q/k/v and gate/up stacked, experts as w1/w2/w3) and with its own scaling folded into B.

Deltas are compared layout-free, as `u^T dW v` for a few seeded +-1 vectors per module, named by
the HF module path (experts as `<experts>.<e>.gate_proj|up_proj|down_proj`, the per-expert names
of HF's older Qwen-MoE modules). Both sides compute in float64, so the only difference a correct
sync leaves is the rounding of the stored factors to vLLM's LoRA dtype; the bound is that rounding
noise, estimated per module from the same factors (`noise`), times NOISE_SIGMAS.

A delta of zero (a freshly initialised B) hides every layout fault, so the first adapter sync of a
process first runs the whole export -> load -> check once with seeded random LoRA values
(`randomized`), then restores the trained values bit for bit and syncs those.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from lorarl.errors import SyncError

PROJECTIONS = 3  # seeded (u, v) pairs per module
SEED = 20261204
# A correct sync differs from the trainer only by rounding the factors to vLLM's dtype: a sum of
# many independent rounding errors, close to Gaussian with the estimated standard deviation. 10
# of them leaves no false alarm over 10^6 compared values; a factor-2 scaling error reads ~25x
# past the bound in bf16, a swapped expert more.
NOISE_SIGMAS = 10.0

# transformers' Qwen-MoE experts: gate_up_proj [E, 2I, H] holds gate then up (its forward splits
# the projection with chunk(2)); down_proj [E, H, I].
EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
PEFT_PREFIX = "base_model.model."


@functools.lru_cache(maxsize=256)
def _signs(dim: int, side: str, count: int, seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + dim * 2 + (side == "in"))
    return torch.randint(0, 2, (count, dim), generator=gen, dtype=torch.float64) * 2 - 1


def signs(dim: int, side: str, count: int = PROJECTIONS, seed: int = SEED, device=None) -> Tensor:
    """[count, dim] float64 of +-1, the same for every caller that asks for this length and side
    ("out" for u, "in" for v). u and v differ even when the lengths do, so a delta sent
    transposed (dW^T) does not read the same as dW."""
    return _signs(dim, side, count, seed).to(device)


@dataclass(frozen=True)
class Projection:
    """u_j^T dW v_j for each seeded pair j, and the rounding noise scale of each."""

    values: Tensor  # [PROJECTIONS] float64
    noise: Tensor  # [PROJECTIONS] float64: sqrt(sum of squared terms), times the scaling
    out_features: int
    in_features: int
    # An upper bound on the delta's Frobenius norm, scaling * |B|_F * |A|_F (the merged check's
    # rounding noise of W + delta); None where not computed.
    delta_norm: float | None = None


# ------------------------------------------------------------------------------ trainer side


@dataclass(frozen=True)
class TrainerLora:
    """One PEFT LoRA layer of the trainer: its factors (possibly sharded), its scaling."""

    path: str  # HF module path (Linear) or experts module path (ParamWrapper)
    a: Tensor  # [r, in] or [r * E, in], expert-major rows
    b: Tensor  # [out, r] or [out, r * E], expert-minor columns
    scaling: float
    num_experts: int  # 1 for a Linear
    parameter: str | None  # the expert parameter a ParamWrapper wraps (gate_up_proj | down_proj)


def trainer_loras(model: torch.nn.Module, adapter: str = "default") -> list[TrainerLora]:
    """Every LoRA layer of a PEFT model, with the scaling PEFT's forward multiplies by."""
    out = []
    for name, module in model.named_modules():
        factors_a = getattr(module, "lora_A", None)
        if not isinstance(factors_a, torch.nn.ModuleDict) or adapter not in factors_a:
            continue
        if getattr(module, "fan_in_fan_out", False) or getattr(module, "use_dora", {}).get(adapter, False):
            raise SyncError(f"LoRA module '{name}' uses fan_in_fan_out or DoRA; the semantic check covers plain LoRA")
        path = name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name
        experts = int(getattr(module, "num_experts", 1) or 1)
        parameter = getattr(module, "parameter_name", None) if experts > 1 else None
        if experts > 1:
            if not getattr(module, "_did_swap_in_out_features", False):
                raise SyncError(f"expert parameter '{name}.{parameter}' is not stored (experts, out, in)")
            while path.endswith(".base_layer"):  # nested wrappers (both expert parameters targeted)
                path = path[: -len(".base_layer")]
        out.append(
            TrainerLora(
                path,
                factors_a[adapter].weight,
                module.lora_B[adapter].weight,
                float(module.scaling[adapter]),
                experts,
                parameter,
            )
        )
    if not out:
        raise SyncError("the trainer's model has no LoRA layers; nothing to compare with vLLM")
    return out


def _local(p: Tensor) -> tuple[Tensor, int]:
    """(this rank's rows, their offset in the full tensor): FSDP2 shards dim 0."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return p.detach(), 0
    if any(not isinstance(pl, (Shard, Replicate)) or (isinstance(pl, Shard) and pl.dim != 0) for pl in p.placements):
        raise SyncError(f"a LoRA factor is placed as {p.placements}; the semantic check reads dim-0 shards only")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = p.to_local().detach()
    if any(isinstance(pl, Replicate) for pl in p.placements) and p.device_mesh.get_local_rank(0) != 0:
        local = local[:0]  # a replicated factor counts once in the sum over ranks
    return local, offset[0]


def _stack_sums(loras: list[TrainerLora], held: list[tuple], count: int) -> list[list[Tensor]]:
    """This rank's share of the four sums each module's projections need (R = rank x experts),
    for modules whose factors have one shape and one sharding, stacked so that the work is a few
    kernels per shape, not per module (a 7B model's 196 modules have 7 shapes): y = A v
    [count, R] and A's squared row sums [R] from A's rows, z = B^T u [parts, count, R] and B's
    squared column sums [parts, R] from B's rows (parts: gate and up of a fused expert parameter,
    else one). `held`: each module's (A rows, offset), (B rows, offset) on this rank (_local).
    Summing the shares over the ranks that hold the rows gives the whole."""
    (_, a0), (_, b0) = held[0]
    a64 = torch.stack([a for (a, _), _ in held]).to(torch.float64)  # [k, rows of A held, in]
    b64 = torch.stack([b for _, (b, _) in held]).to(torch.float64)  # [k, rows of B held, R]
    (rows_r, n_in), n_out, k = loras[0].a.shape, loras[0].b.shape[0], len(loras)
    parts = EXPERT_PARTS[loras[0].parameter] if loras[0].parameter else (None,)
    part_rows, f64, device = n_out // len(parts), torch.float64, a64.device
    y = torch.zeros(k, count, rows_r, dtype=f64, device=device)
    a_sq = torch.zeros(k, rows_r, dtype=f64, device=device)
    y[:, :, a0 : a0 + a64.shape[1]] = torch.einsum("ci,kri->kcr", signs(n_in, "in", count, device=device), a64)
    a_sq[:, a0 : a0 + a64.shape[1]] = (a64 * a64).sum(-1)
    z = torch.zeros(k, len(parts), count, rows_r, dtype=f64, device=device)
    b_sq = torch.zeros(k, len(parts), rows_r, dtype=f64, device=device)
    u = signs(part_rows, "out", count, device=device)
    for i in range(len(parts)):
        lo, hi = max(b0, i * part_rows), min(b0 + b64.shape[1], (i + 1) * part_rows)
        if lo < hi:
            rows = b64[:, lo - b0 : hi - b0]
            z[:, i] = torch.einsum("ch,khr->kcr", u[:, lo - i * part_rows : hi - i * part_rows], rows)
            b_sq[:, i] = (rows * rows).sum(1)
    return [[y[j], a_sq[j], z[j], b_sq[j]] for j in range(k)]


STACK_BYTES = 256 << 20  # float64 factors stacked at once: bounded, an MoE's expert stacks are large


def _module_sums(loras: list[TrainerLora], count: int) -> list[list[Tensor]]:
    """_stack_sums of every module, in the order of `loras`: modules of one factor shape and
    sharding are stacked, at most STACK_BYTES of float64 at a time."""
    stacks: dict[tuple, list[list[int]]] = {}
    held = [(_local(lora.a), _local(lora.b)) for lora in loras]
    for i, lora in enumerate(loras):
        key = (lora.parameter, tuple(lora.a.shape), tuple(lora.b.shape), lora.a.dtype, lora.b.dtype)
        key += tuple((tuple(t.shape), offset, t.device) for t, offset in held[i])
        chunks = stacks.setdefault(key, [[]])
        if chunks[-1] and 8 * (lora.a.numel() + lora.b.numel()) * (len(chunks[-1]) + 1) > STACK_BYTES:
            chunks.append([])
        chunks[-1].append(i)
    out: list[list[Tensor]] = [[] for _ in loras]
    for chunk in (chunk for chunks in stacks.values() for chunk in chunks):
        for i, sums in zip(chunk, _stack_sums([loras[i] for i in chunk], [held[i] for i in chunk], count)):
            out[i] = sums
    return out


def trainer_projections(
    loras: list[TrainerLora], all_reduce: Callable[[Tensor], Tensor] | None = None, count: int = PROJECTIONS
) -> dict[str, Projection]:
    """Per HF module path (and expert projection), the trainer's `u^T dW v`. Collective over the
    ranks that share the factors' shards: `all_reduce` sums a float64 tensor over them (None on
    one rank). One reduction for the whole model."""
    shares = _module_sums(loras, count)
    flat = torch.cat([t.reshape(-1) for share in shares for t in share])
    if all_reduce is not None:
        flat = all_reduce(flat)
    flat = flat.cpu()  # one transfer; the comparison runs on the host
    out: dict[str, Projection] = {}
    offset = 0
    for lora, share in zip(loras, shares):
        full = []
        for s in share:
            full.append(flat[offset : offset + s.numel()].view_as(s))
            offset += s.numel()
        out.update(_per_module(lora, *full))
    return out


def _per_module(lora: TrainerLora, y: Tensor, a_sq: Tensor, z: Tensor, b_sq: Tensor) -> dict[str, Projection]:
    """PEFT's delta per module from the summed factors. A Linear: scaling * B @ A. A ParamWrapper
    over E experts (PEFT's get_delta_weight): A viewed (E, r, in), B viewed (out, r, E)."""
    count, s = y.shape[0], lora.scaling
    n_in, n_out = lora.a.shape[1], lora.b.shape[0] // z.shape[0]
    if lora.num_experts == 1:
        values = s * (z[0] * y).sum(-1)
        noise = s * (b_sq[0] * y * y + z[0] * z[0] * a_sq).sum(-1).sqrt()
        norm = s * float(b_sq[0].sum().sqrt() * a_sq.sum().sqrt())
        return {lora.path: Projection(values, noise, n_out, n_in, norm)}
    e = lora.num_experts
    y_e = y.view(count, e, -1)  # [K, E, r]: A's rows are expert-major
    a_sq_e = a_sq.view(e, -1)
    out = {}
    for i, part in enumerate(EXPERT_PARTS[lora.parameter]):
        z_e = z[i].view(count, -1, e).transpose(1, 2)  # [K, E, r]: B's columns are expert-minor
        b_sq_e = b_sq[i].view(-1, e).T
        values = s * (z_e * y_e).sum(-1)  # [K, E]
        noise = s * (b_sq_e * y_e * y_e + z_e * z_e * a_sq_e).sum(-1).sqrt()
        norms = s * (b_sq_e.sum(-1).sqrt() * a_sq_e.sum(-1).sqrt())  # [E]
        # Split per expert in one call each: a 30B-A3B adapter is 18k expert projections.
        per_expert = zip(values.T.unbind(0), noise.T.unbind(0), norms.tolist())
        for expert, (v, n, norm) in enumerate(per_expert):
            out[f"{lora.path}.{expert}.{part}"] = Projection(v, n, n_out, n_in, norm)
    return out


# ------------------------------------------------------------------------------ vLLM side


def slice_offset(full: int, held: int, tp_rank: int, tp_size: int) -> tuple[int, float]:
    """(offset of the `held` rows a tensor-parallel rank keeps of `full`, how many ranks keep
    the same rows): vLLM gives each rank a contiguous 1/tp_size, or, when there are fewer
    shards than ranks (key/value heads), one shard to several ranks."""
    if held >= full:
        return 0, float(tp_size)
    shards = full // held
    if full % held or tp_size % shards:
        raise SyncError(f"cannot tell which {held} of {full} rows tensor-parallel rank {tp_rank} holds")
    return (tp_rank * shards // tp_size) * held, tp_size / shards


def slot_projections(
    names: list[str],
    a: Tensor,
    b: Tensor,
    wanted: dict[str, tuple[int, int, int]],
    tp: tuple[int, int],
    spread: bool,
    count: int = PROJECTIONS,
) -> Iterator[tuple[list[str], Tensor, float]]:
    """(names, u^T B A v [len(names), count] on the host, share of its module each slot covers)
    for a group of equal-shaped vLLM LoRA slots, A [n, r, in] and B [n, out, r] as vLLM computes
    with them (its scaling folded into B), one host transfer per module size. `wanted` maps a
    slot name to (index, full out, full in); `spread`: each slot is held by one rank (experts
    under expert parallelism)."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    rows, cols = b.shape[1], a.shape[2]
    by_dims: dict[tuple[int, int], list[int]] = {}
    for i, name in enumerate(names):
        by_dims.setdefault(wanted[name][1:], []).append(i)
    for (n_out, n_in), idx in by_dims.items():
        r0, rep_rows = slice_offset(n_out, rows, *tp)
        c0, rep_cols = slice_offset(n_in, cols, *tp)
        # How many ranks hold this same slot: rows replicated x columns replicated, over tp.
        rep = 1.0 if spread else rep_rows * rep_cols / tp[1]
        u = signs(n_out, "out", count, device=a.device)[:, r0 : r0 + rows]
        v = signs(n_in, "in", count, device=a.device)[:, c0 : c0 + cols]
        z = torch.einsum("ko,nor->nkr", u, b64[idx])
        y = torch.einsum("ki,nri->nkr", v, a64[idx])
        yield [names[i] for i in idx], ((z * y).sum(-1) / rep).cpu(), rows * cols / (n_out * n_in) / rep


# ------------------------------------------------------------------------------ the comparison


def unit_roundoff(*dtypes: torch.dtype) -> float:
    """The coarsest rounding among the dtypes the factors passed through on their way into vLLM."""
    return max(torch.finfo(d).eps / 2 for d in dtypes)


def compare(
    expected: dict[str, Projection],
    observed: dict[str, tuple[Tensor, float]],
    roundoff: float,
    rank: int | None = None,
    extra: Iterable[str] = (),
    merged: bool = False,
) -> float:
    """1.0 when vLLM applies every module's delta within rounding; else a SyncError naming the
    first module (layer, module, expert) that differs, and how. All modules at once: an MoE
    model has tens of thousands of expert projections. `merged`: the values are of the whole
    served weight (base + delta, lorarl.sync.semantic_merged), and the line says so."""
    who = "" if rank is None else f"rank {rank}: "
    paths = sorted(expected, key=_natural)
    cover = torch.tensor([observed[p][1] if p in observed else 0.0 for p in paths], dtype=torch.float64)
    missing = ((cover - 1.0).abs() > 1e-6).nonzero()
    if len(missing):
        i = int(missing[0])
        raise SyncError(
            f"{who}{_place(paths[i])}: vLLM holds {float(cover[i]):.2f} of this module's "
            f"{'weight' if merged else 'LoRA'} after the sync (1.00 expected); the export left it out or vLLM has no "
            "slot for it"
        )
    want = torch.stack([expected[p].values for p in paths])
    got = torch.stack([observed[p][0] for p in paths]).to(want)
    bound = NOISE_SIGMAS * roundoff * torch.stack([expected[p].noise for p in paths])
    excess = (got - want).abs() - bound
    wrong = (excess > 0).any(1).nonzero()
    if len(wrong):
        i = int(wrong[0])
        j = int(excess[i].argmax())
        w, g = float(want[i, j]), float(got[i, j])
        ratio = g / w if w != 0 else float("inf")
        what, quantity = (
            ("the merged weight vLLM serves is not the trainer's base + delta", "u^T W v")
            if merged
            else ("the delta vLLM applies is not the trainer's", "u^T dW v")
        )
        raise SyncError(
            f"{who}{_place(paths[i])}: {what} ({quantity} {g:.4g} vs {w:.4g}, "
            f"ratio {ratio:.3g}, allowed difference {float(bound[i, j]):.2g}); vLLM would not compute what the "
            "trainer trains (a module in the wrong place, order or scale)"
        )
    stray = sorted(extra)
    if stray:
        raise SyncError(f"{who}vLLM applies a LoRA delta at '{stray[0]}', which the trainer does not train")
    return 1.0


_LAYER = re.compile(r"\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(?P<module>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)$")


def _place(path: str) -> str:
    """'layer 3 mlp.experts.gate_proj of expert 5 (model.layers.3.mlp.experts.5.gate_proj)'."""
    m = _LAYER.search(path)
    if m is None:
        return f"module {path}"
    module = m[2]
    expert = _EXPERT.match(module)
    if expert is not None:
        return f"layer {m[1]} {expert['module']}.{expert['proj']} of expert {expert['e']} ({path})"
    return f"layer {m[1]} {module} ({path})"


@functools.cache  # the same paths every sync
def _natural(path: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path))


# ------------------------------------------------------------------------ the first-sync self-test


@contextlib.contextmanager
def randomized(params: Iterable[Tensor], seed: int = SEED, std: float = 0.02) -> Iterator[None]:
    """Fill every trainable LoRA factor (this rank's shard) with seeded noise, and put the trained
    values back bit for bit on exit. A zero B (every fresh adapter) makes every delta zero, and
    then no layout fault shows; under this context the real export, load and checks run on
    factors that are all non-zero."""
    from torch.distributed.tensor import DTensor

    locals_ = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    saved = [t.detach().clone() for t in locals_]
    gen = torch.Generator().manual_seed(seed)
    try:
        with torch.no_grad():
            for t in locals_:
                t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t) * std)
        yield
    finally:
        with torch.no_grad():
            for t, old in zip(locals_, saved):
                t.copy_(old)


# ------------------------------------------------------------------------------ run it


def verify(engine, rollout, rank: int | None = None) -> float:
    """The semantic check after an adapter sync: 1.0, or a SyncError naming the first module whose
    delta in vLLM is not the trainer's. `engine` is a training engine (`lora_projections`,
    collective), `rollout` a VLLMRollout holding the adapter."""
    return verify_projections(engine.lora_projections(), rollout, rank)


def wanted_slots(expected: dict[str, Projection], layout) -> dict[str, tuple[int, int, int]]:
    """vLLM slot name -> (row of `expected`, full out, full in features): vLLM's own parser names
    the slot each HF module's LoRA lands in."""
    slot_of = {path: layout.module_of(f"{PEFT_PREFIX}{path}.lora_A.weight")[0] for path in expected}
    if len(set(slot_of.values())) != len(slot_of):
        raise SyncError("two trained LoRA modules map to one vLLM slot; vLLM cannot serve this adapter")
    return {slot_of[path]: (i, p.out_features, p.in_features) for i, (path, p) in enumerate(expected.items())}


def verify_projections(expected: dict[str, Projection], rollout, rank: int | None = None) -> float:
    """The semantic check's comparison, in the process that holds `rollout`: `expected` is the
    trainer's side (`lora_projections` of its engine, computed where the engine lives and sent
    over on split placement)."""
    if not rollout.has_adapter:
        who = "" if rank is None else f"rank {rank}: "
        raise SyncError(
            f"{who}vLLM holds no adapter after the sync, while the trainer's has {len(expected)} LoRA modules; "
            "the adapter never reached this rollout"
        )
    layout = rollout.adapter_layout()
    values, share, stray = rollout.lora_projections(wanted_slots(expected, layout))
    observed = {path: row for path, row in zip(expected, zip(values.unbind(0), share.tolist()))}
    roundoff = unit_roundoff(rollout.torch_dtype, layout.lora_dtype)
    return compare(expected, observed, roundoff, rank, stray)
