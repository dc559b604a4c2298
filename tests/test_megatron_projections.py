"""The semantic check's expected side on Megatron (lorarl.engines.megatron.projections), with real tensors.

Known per-HF-module LoRA factors are packed into Megatron-Bridge's layout by a construction
written here (q/k/v interleaved per query group, [gate_t; up_t] per tensor-parallel rank, A split
on the rank or input dim, experts per expert-parallel rank, locally numbered), sharded over
simulated tensor- and expert-parallel ranks whose shares are summed as the all-reduce would. The
projections must equal PEFT's math on the known factors (u^T s B A v, float64), and an export that
unfuses with an interleave error, a gate/up mix-up or a wrong expert numbering must fail the
comparison, naming the module.
"""

from __future__ import annotations

import pytest
import torch

from lorarl.engines.megatron.projections import MegatronShape, finish, megatron_lora_projections, megatron_shares
from lorarl.errors import SyncError
from lorarl.sync import semantic

HEADS, GROUPS, HD, HIDDEN, FFN, EXPERT_FFN, R, EXPERTS = 4, 2, 4, 16, 24, 8, 4, 4
SCALING = 2.0  # alpha / dim
DIMS = {  # HF projection -> (out, in)
    "q_proj": (HEADS * HD, HIDDEN),
    "k_proj": (GROUPS * HD, HIDDEN),
    "v_proj": (GROUPS * HD, HIDDEN),
    "o_proj": (HIDDEN, HEADS * HD),
    "gate_proj": (FFN, HIDDEN),
    "up_proj": (FFN, HIDDEN),
    "down_proj": (HIDDEN, FFN),
}
EXPERT_DIMS = {"gate_proj": (EXPERT_FFN, HIDDEN), "up_proj": (EXPERT_FFN, HIDDEN), "down_proj": (HIDDEN, EXPERT_FFN)}


def known_factors(seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per HF module path (A, B); the projections fused in one Megatron linear share their A.
    Layer 0 dense, layer 1 attention + routed experts."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    out = {}
    for layer in (0, 1):
        a_qkv = rnd(R, HIDDEN)
        for p in ("q_proj", "k_proj", "v_proj"):
            out[f"model.layers.{layer}.self_attn.{p}"] = (a_qkv, rnd(DIMS[p][0], R))
        out[f"model.layers.{layer}.self_attn.o_proj"] = (rnd(R, HEADS * HD), rnd(HIDDEN, R))
    a_fc1 = rnd(R, HIDDEN)
    out["model.layers.0.mlp.gate_proj"] = (a_fc1, rnd(FFN, R))
    out["model.layers.0.mlp.up_proj"] = (a_fc1, rnd(FFN, R))
    out["model.layers.0.mlp.down_proj"] = (rnd(R, FFN), rnd(HIDDEN, R))
    for e in range(EXPERTS):
        a = rnd(R, HIDDEN)
        out[f"model.layers.1.mlp.experts.{e}.gate_proj"] = (a, rnd(EXPERT_FFN, R))
        out[f"model.layers.1.mlp.experts.{e}.up_proj"] = (a, rnd(EXPERT_FFN, R))
        out[f"model.layers.1.mlp.experts.{e}.down_proj"] = (rnd(R, EXPERT_FFN), rnd(HIDDEN, R))
    return out


def peft_projection(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    u, v = semantic.signs(b.shape[0], "out"), semantic.signs(a.shape[1], "in")
    return SCALING * torch.einsum("ko,oi,ki->k", u, b @ a, v)


def fused_qkv_b(f, layer: int) -> torch.Tensor:
    """megatron-core's interleaved rows: per query group [its q heads; its k head; its v head]."""
    q, k, v = (f[f"model.layers.{layer}.self_attn.{p}"][1] for p in ("q_proj", "k_proj", "v_proj"))
    per = HEADS // GROUPS * HD
    rows = []
    for g in range(GROUPS):
        rows += [q[g * per : (g + 1) * per], k[g * HD : (g + 1) * HD], v[g * HD : (g + 1) * HD]]
    return torch.cat(rows)


def megatron_params(f, tp_rank: int, tp: int, ep_rank: int, ep: int) -> dict[str, torch.Tensor]:
    """One rank's Megatron-Bridge LoRA parameters (fused LoRA, local layer spec, SequentialMLP)."""
    out = {}

    def put(prefix: str, a: torch.Tensor, b: torch.Tensor, a_dim: int) -> None:
        out[f"{prefix}.adapter.linear_in.weight"] = a.chunk(tp, a_dim)[tp_rank]
        out[f"{prefix}.adapter.linear_out.weight"] = b.chunk(tp, 0)[tp_rank]

    for layer in (0, 1):
        attn = f"module.decoder.layers.{layer}.self_attention"
        put(f"{attn}.linear_qkv", f[f"model.layers.{layer}.self_attn.q_proj"][0], fused_qkv_b(f, layer), 0)
        put(f"{attn}.linear_proj", *f[f"model.layers.{layer}.self_attn.o_proj"], 1)
    gate_a, gate_b = f["model.layers.0.mlp.gate_proj"]
    up_b = f["model.layers.0.mlp.up_proj"][1]
    fc1 = "module.decoder.layers.0.mlp.linear_fc1.adapter"
    out[f"{fc1}.linear_in.weight"] = gate_a.chunk(tp, 0)[tp_rank]
    out[f"{fc1}.linear_out.weight"] = torch.cat([gate_b.chunk(tp, 0)[tp_rank], up_b.chunk(tp, 0)[tp_rank]])
    put("module.decoder.layers.0.mlp.linear_fc2", *f["model.layers.0.mlp.down_proj"], 1)
    local = EXPERTS // ep
    for slot in range(local):
        e = ep_rank * local + slot
        stem = f"module.decoder.layers.1.mlp.experts.local_experts.{slot}"
        a, gate = f[f"model.layers.1.mlp.experts.{e}.gate_proj"]
        out[f"{stem}.linear_fc1.adapter.linear_in.weight"] = a
        out[f"{stem}.linear_fc1.adapter.linear_out.weight"] = torch.cat(
            [gate, f[f"model.layers.1.mlp.experts.{e}.up_proj"][1]]
        )
        a2, b2 = f[f"model.layers.1.mlp.experts.{e}.down_proj"]
        out[f"{stem}.linear_fc2.adapter.linear_in.weight"] = a2
        out[f"{stem}.linear_fc2.adapter.linear_out.weight"] = b2
    return out


def shape_of(tp_rank: int, tp: int, ep_rank: int, ep: int) -> MegatronShape:
    return MegatronShape(HEADS, GROUPS, HD, HIDDEN, FFN, EXPERT_FFN, R, EXPERTS, tp_rank, tp, ep_rank, EXPERTS // ep)


def projections_over_ranks(f, tp: int, ep: int) -> dict[str, semantic.Projection]:
    """World of max(tp, ep) ranks, rank i being tensor-parallel rank i % tp and expert-parallel
    rank i % ep; the shares are summed as the engine's all-reduces sum them (dense over the
    tensor-parallel group, experts over the expert-parallel group)."""
    shares = []
    for i in range(max(tp, ep)):
        params = megatron_params(f, i % tp, tp, i % ep, ep)
        scaling = {n.rsplit(".adapter.", 1)[0] + ".adapter": SCALING for n in params}
        shares.append(megatron_shares(params.items(), scaling, shape_of(i % tp, tp, i % ep, ep)))
    dense = sum(s.dense_flat for s in shares[:tp])
    experts = sum(s.experts_flat for s in shares[:ep])
    return {**finish(shares[0].dense, dense, R), **finish(shares[0].experts, experts, R)}


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (2, 2), (1, 2)])
def test_projections_equal_pefts_math_over_tp_and_ep(tp, ep):
    f = known_factors()
    got = projections_over_ranks(f, tp, ep)
    assert sorted(got) == sorted(f)
    for path, (a, b) in f.items():
        torch.testing.assert_close(got[path].values, peft_projection(a, b), rtol=1e-12, atol=1e-12)
        assert (got[path].out_features, got[path].in_features) == tuple(b.shape[:1]) + tuple(a.shape[1:])
        assert got[path].delta_norm == pytest.approx(SCALING * float(b.norm() * a.norm()))


def test_one_rank_without_reduces_is_the_whole():
    f = known_factors(1)
    params = megatron_params(f, 0, 1, 0, 1)
    scaling = {n.rsplit(".adapter.", 1)[0] + ".adapter": SCALING for n in params}
    got = megatron_lora_projections(params.items(), scaling, shape_of(0, 1, 0, 1))
    for path, (a, b) in f.items():
        torch.testing.assert_close(got[path].values, peft_projection(a, b), rtol=1e-12, atol=1e-12)


def wrong_unfuse(f, fault: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The per-HF factors an export with `fault` would send, from the same Megatron tensors (TP 2)."""
    out = dict(f)
    if fault == "interleave":  # fused qkv read as [q; k; v] blocks
        b = fused_qkv_b(f, 0)
        a = f["model.layers.0.self_attn.q_proj"][0]
        sizes = [DIMS[p][0] for p in ("q_proj", "k_proj", "v_proj")]
        for p, part in zip(("q_proj", "k_proj", "v_proj"), b.split(sizes)):
            out[f"model.layers.0.self_attn.{p}"] = (a, part)
    elif fault == "gate_up":  # gathered [g0; u0; g1; u1] split in halves (Megatron-Bridge #5635)
        a = f["model.layers.0.mlp.gate_proj"][0]
        gate, up = f["model.layers.0.mlp.gate_proj"][1], f["model.layers.0.mlp.up_proj"][1]
        gathered = torch.cat([gate[: FFN // 2], up[: FFN // 2], gate[FFN // 2 :], up[FFN // 2 :]])
        out["model.layers.0.mlp.gate_proj"] = (a, gathered[:FFN])
        out["model.layers.0.mlp.up_proj"] = (a, gathered[FFN:])
    elif fault == "expert_numbering":  # rank 1's experts 2, 3 sent as 0, 1 (and rank 0's as 2, 3)
        for p in ("gate_proj", "up_proj", "down_proj"):
            for e, src in ((0, 2), (1, 3), (2, 0), (3, 1)):
                out[f"model.layers.1.mlp.experts.{e}.{p}"] = f[f"model.layers.1.mlp.experts.{src}.{p}"]
    return out


PLACES = {
    "interleave": r"layer 0 self_attn\.[kqv]_proj ",
    "gate_up": r"layer 0 mlp\.(gate|up)_proj ",
    "expert_numbering": r"layer 1 mlp\.experts\.\w+ of expert 0 ",
}


@pytest.mark.parametrize("fault", [None, *PLACES])
def test_a_wrong_unfuse_is_caught_naming_the_module(fault):
    f = known_factors(2)
    expected = projections_over_ranks(f, 2, 2)
    sent = wrong_unfuse(f, fault) if fault else f
    observed = {path: (peft_projection(a, b), 1.0) for path, (a, b) in sent.items()}
    roundoff = semantic.unit_roundoff(torch.float32)
    if fault is None:
        assert semantic.compare(expected, observed, roundoff) == 1.0
        return
    with pytest.raises(SyncError, match=PLACES[fault]):
        semantic.compare(expected, observed, roundoff)


def test_an_unknown_adapter_layout_is_refused_by_name():
    name = "decoder.layers.0.mlp.experts.linear_fc1.adapter.linear_in.weight0"  # grouped-GEMM experts
    with pytest.raises(SyncError, match="linear_fc1.adapter.linear_in.weight0"):
        megatron_lora_projections([(name, torch.zeros(R, HIDDEN))], {}, shape_of(0, 1, 0, 1))


def test_model_lora_reads_scaling_and_global_layer_numbers():
    """A module tree named as Megatron-Bridge names it (two pipeline chunks, each with a local
    layer 0): the adapters' own alpha / dim, and layers renamed by their global layer_number."""
    from torch import nn

    from lorarl.engines.megatron.projections import model_lora

    def chunk(layer_number: int, alpha: float) -> nn.Module:
        adapter = nn.Module()
        adapter.alpha, adapter.dim = alpha, R
        adapter.linear_in, adapter.linear_out = nn.Linear(HIDDEN, R, bias=False), nn.Linear(R, HIDDEN, bias=False)
        layer = nn.Module()
        layer.layer_number = layer_number
        layer.self_attention = nn.Module()
        layer.self_attention.linear_proj = nn.Module()
        layer.self_attention.linear_proj.adapter = adapter
        root = nn.Module()
        root.decoder = nn.Module()
        root.decoder.layers = nn.ModuleList([layer])
        wrapped = nn.Module()
        wrapped.module = root
        return wrapped

    params, scaling = model_lora([chunk(1, 8.0), chunk(3, 2.0)])
    assert scaling == {
        "module.decoder.layers.0.self_attention.linear_proj.adapter": 8.0 / R,
        "module.decoder.layers.2.self_attention.linear_proj.adapter": 2.0 / R,
    }
    assert [n for n, _ in params] == [
        "module.decoder.layers.0.self_attention.linear_proj.adapter.linear_in.weight",
        "module.decoder.layers.0.self_attention.linear_proj.adapter.linear_out.weight",
        "module.decoder.layers.2.self_attention.linear_proj.adapter.linear_in.weight",
        "module.decoder.layers.2.self_attention.linear_proj.adapter.linear_out.weight",
    ]
