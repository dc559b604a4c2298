"""The merged semantic check on the Megatron engine (model.lora.merge=true), with real tensors on CPU.

Megatron's forward needs CUDA and Megatron-Bridge Python 3.12, so the engine's ranks are simulated
(tests/megatron_ranks.py): the embedded tiny Qwen2 and Qwen3-MoE checkpoints in Megatron's fused,
tensor-parallel-sharded layout under Megatron-Bridge's LoRA wrappers, with real factors, at TP 1/2,
EP 1/2 and PP 1/2, fused LoRA and CanonicalLoRA, float32 and bfloat16. lorarl's own code computes
the expected side on every rank (the base side: lorarl.engines.megatron.base_projections; the
delta side: lorarl.engines.megatron.projections), the shares summed as the engine's all-reduces
sum them. It is checked against the HF checkpoint and the factors with plain torch, and the real
MergedCheck (lorarl.sync.semantic_merged) compares it with the weights vLLM would serve: the
HF-layout merged weights W + s B A, projected in plain torch as vLLM's worker projects its own
(`ServedWeights`). A correct merge passes; every merged sync fault (lorarl.sync.faults_merged, as
the session applies it), a delta left out of any one module and the Megatron-specific unfuse bugs
(q/k/v read as blocks, gate/up of TP ranks split in halves, experts misnumbered) fail, naming the
module.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lorarl.config.schema import FAULTS
from lorarl.contract.payload import WeightPayload
from lorarl.errors import ConfigError, SyncError
from lorarl.sync import semantic
from lorarl.sync.faults import SyncFault
from lorarl.sync.semantic_merged import MergedCheck, merged_expected
from tests import megatron_reference as R
from tests.megatron_ranks import SCALING, Case, Checkpoint, SimulatedMegatron, make_factors

CASES = [
    Case("qwen2_tiny"),
    Case("qwen2_tiny", tp=2),
    Case("qwen2_tiny", tp=2, pp=2, dtype="bfloat16"),
    Case("qwen2_tiny", tp=2, lora="canonical_lora"),
    Case("qwen3_moe_tiny"),
    Case("qwen3_moe_tiny", ep=2),
    Case("qwen3_moe_tiny", tp=2, ep=2, pp=2),
    Case("qwen3_moe_tiny", ep=2, dtype="bfloat16"),
]
IDS = [c.id for c in CASES]
# What the one line names for each merged fault (lorarl.sync.faults_merged).
PLACE = {
    "gate_up_swap": r"layer 0 mlp\.(experts\.)?(gate|up)_proj ",
    "expert_swap": r"layer 0 mlp\.experts\.\w+ of expert [01] \(",
    "scale_x2": r"layer 0 ",
    "scale_half": r"layer 0 ",
    "transpose": r"layer 0 self_attn\.[qo]_proj ",
    "missing_module": r"layer 0 self_attn\.v_proj ",
    "stale_layer": r"layer 1 ",
    "qk_swap": r"layer 0 self_attn\.[qk]_proj ",
}
MERGED = "the merged weight vLLM serves is not the trainer's base + delta"
# trainer_scaling changes PEFT's per-module `scaling` dict in the trainer (SyncFault.on_engine);
# Megatron's adapters keep alpha and dim instead, so on this engine it has nothing to act on.
MERGED_FAULTS = [f for f in FAULTS if f != "trainer_scaling"]


@pytest.fixture(scope="module")
def checkpoints(tiny_model_path: Path) -> dict[str, Checkpoint]:
    """The embedded tiny Qwen2 and Qwen3-MoE as saved on disk (experts per expert), built once per session."""
    from lorarl.models.tiny import default_tiny_model_path, ensure_tiny_model

    moe = ensure_tiny_model(default_tiny_model_path(arch="qwen3_moe"), arch="qwen3_moe")
    return {"qwen2_tiny": Checkpoint.load(tiny_model_path), "qwen3_moe_tiny": Checkpoint.load(moe)}


@pytest.fixture(scope="module")
def simulated(checkpoints):
    """case -> (SimulatedMegatron, its factors), built once per case."""
    built: dict[Case, tuple[SimulatedMegatron, dict]] = {}

    def get(case: Case) -> tuple[SimulatedMegatron, dict]:
        if case not in built:
            ck = checkpoints[case.model]
            factors = make_factors(ck, case)
            built[case] = (SimulatedMegatron(ck, factors, case), factors)
        return built[case]

    return get


def merged_hf(sim: SimulatedMegatron) -> dict[str, torch.Tensor]:
    """The checkpoint with every LoRA module merged in HF layout, W + s B A in float64 cast to the
    case's dtype: the weights a correct merged export sends (plain torch, per HF module)."""
    dtype = sim.case.torch_dtype
    out = {n: t.to(dtype) for n, t in sim.ck.tensors.items()}
    for path, (a, b) in sim.factors.items():
        w = out[f"{path}.weight"]
        out[f"{path}.weight"] = (w.double() + SCALING * b.double() @ a.double()).to(dtype)
    return out


class ServedWeights:
    """What the check asks of the rollout (`weight_projections`, `torch_dtype`), from the HF-layout
    weights vLLM would load, one engine rank: u^T W v per wanted module in plain torch, its share
    1 when the weight is there (lorarl.rollout.vllm_weights reads vLLM's own copy the same way)."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
        self.tensors, self.torch_dtype = tensors, dtype

    def weight_projections(self, wanted: dict[str, tuple[int, int, int]]):
        values = torch.zeros(len(wanted), semantic.PROJECTIONS, dtype=torch.float64)
        share = torch.zeros(len(wanted), dtype=torch.float64)
        for path, (i, n_out, n_in) in wanted.items():
            w = self.tensors.get(f"{path}.weight")
            if w is None:
                continue
            assert tuple(w.shape) == (n_out, n_in), (path, tuple(w.shape), (n_out, n_in))
            u, v = semantic.signs(n_out, "out"), semantic.signs(n_in, "in")
            values[i] = ((u @ w.double()) * v).sum(-1)
            share[i] = 1.0
        return values, share, 0.0


def check(sim: SimulatedMegatron, served: dict[str, torch.Tensor]) -> float:
    """The real merged check (a fresh one: its base side computed, then cached) on `served`."""
    return MergedCheck().verify(sim, ServedWeights(served, sim.case.torch_dtype))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_both_sides_are_the_checkpoints_and_factors_own(simulated, case):
    """Every LoRA module's u^T W_base v and |W_base|_F from Megatron's shards equal the HF
    checkpoint's, and its u^T (s B A) v PEFT's math on the factors, in float64."""
    sim, factors = simulated(case)
    base, delta = sim.base_projections(), sim.lora_projections()
    assert sorted(base.modules) == sorted(factors) == sorted(delta)
    assert base.roundoff == semantic.unit_roundoff(case.torch_dtype)
    for path, (a, b) in factors.items():
        w = sim.ck.tensors[f"{path}.weight"].to(case.torch_dtype).double()
        u, v = semantic.signs(w.shape[0], "out"), semantic.signs(w.shape[1], "in")
        scale = float(w.norm())
        torch.testing.assert_close(
            base.modules[path].values, torch.einsum("ko,oi,ki->k", u, w, v), rtol=0, atol=1e-12 * scale
        )
        assert base.modules[path].norm == pytest.approx(scale, rel=1e-12)
        want = SCALING * torch.einsum("ko,or,ri,ki->k", u, b.double(), a.double(), v)
        torch.testing.assert_close(delta[path].values, want, rtol=0, atol=1e-12 * scale)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_a_correct_merge_passes_and_no_delta_hides_in_the_bound(simulated, case):
    """The correct merged weights pass. In float32 they sit far inside the bound and every
    module's delta far outside it (so a delta missing anywhere would show); in bfloat16 the bound
    is the served dtype's rounding of W + delta (lorarl.sync.semantic_merged), which a delta of
    the self-test's size still exceeds (the faults below)."""
    sim, _ = simulated(case)
    served = merged_hf(sim)
    assert check(sim, served) == 1.0
    base, delta = sim.base_projections(), sim.lora_projections()
    expected = merged_expected(base.modules, delta)
    roundoff = max(semantic.unit_roundoff(case.torch_dtype, torch.float32), base.roundoff)
    bound = torch.stack([semantic.NOISE_SIGMAS * roundoff * e.noise for e in expected.values()])
    values, _, _ = ServedWeights(served, case.torch_dtype).weight_projections(
        {p: (i, e.out_features, e.in_features) for i, (p, e) in enumerate(expected.items())}
    )
    correct = float(((values - torch.stack([e.values for e in expected.values()])).abs() / bound).max())
    detect = float((torch.stack([d.values for d in (delta[p] for p in expected)]).abs() / bound).min())
    print(f"{case.id}: correct merge at {correct:.3g} of the bound; smallest delta {detect:.3g} x the bound")
    assert correct < (0.1 if case.dtype == "float32" else 0.5)
    if case.dtype == "float32":
        assert detect > 10


@pytest.mark.parametrize("fault", MERGED_FAULTS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_merged_fault_is_caught_naming_the_module(simulated, case, fault):
    """`trainer.sync_fault` as the session applies it to the merged export (SyncFault.corrupt_merged
    on the payload of HF-named merged weights, per expert as the bridge exports them): the check
    stops it, naming the module, or the payload refuses it (base_as_lora)."""
    sim, _ = simulated(case)
    merged = WeightPayload.base(merged_hf(sim))
    if fault == "expert_swap" and not sim.ck.experts:
        with pytest.raises(ConfigError, match="trainer.sync_fault=expert_swap needs"):
            SyncFault(fault).corrupt_merged(merged, sim)
        return
    sent = SyncFault(fault).corrupt_merged(merged, sim)
    if fault == "base_as_lora":
        with pytest.raises(
            SyncError, match=r"base payload tensor 'base_model\.model\.model\.layers\.0\.\w+\.\w+\.lora_A"
        ):
            dict(sent.tensors)
        return
    with pytest.raises(SyncError) as err:
        check(sim, dict(sent.tensors))
    message = str(err.value)
    assert MERGED in message and "\n" not in message, message
    assert re.search(PLACE[fault], message), message


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.dtype == "float32"], ids=[c.id for c in CASES if c.dtype == "float32"]
)
def test_a_delta_left_out_of_any_one_module_is_named(simulated, case):
    """Each LoRA module in turn (every projection of every layer, every expert, whichever tensor-
    or expert-parallel rank holds it) served as its bare base weight: the check names that module."""
    sim, factors = simulated(case)
    served = merged_hf(sim)
    for path in factors:
        bare = dict(served)
        bare[f"{path}.weight"] = sim.ck.tensors[f"{path}.weight"].to(case.torch_dtype)
        with pytest.raises(SyncError, match=rf"\({re.escape(path)}\): {re.escape(MERGED)}"):
            check(sim, bare)


def wrong_unfuse(sim: SimulatedMegatron, served: dict[str, torch.Tensor], fault: str) -> None:
    """The merged weights an export with `fault` would send, from the same merged Megatron tensors
    (in place): q/k/v read as [q; k; v] blocks; TP ranks' [g_0; u_0; g_1; u_1] split in halves;
    expert-parallel rank 1's experts numbered from 0 (and rank 0's after them)."""
    shape, layer = sim.ck.attention, "model.layers.0"
    if fault == "qkv_blocks":
        names = [f"{layer}.self_attn.{p}_proj.weight" for p in "qkv"]
        fused = R.merge_qkv(*(served[n] for n in names), shape)
        for n, part in zip(names, fused.split([shape.q_size, shape.kv_size, shape.kv_size])):
            served[n] = part.clone()
    elif fault == "fc1_halves":
        gate, up = f"{layer}.mlp.gate_proj.weight", f"{layer}.mlp.up_proj.weight"
        fused = R.merge_gate_up(served[gate], served[up], sim.case.tp)
        served[gate], served[up] = (part.clone() for part in fused.chunk(2))
    elif fault == "expert_numbering":
        experts, local = sim.ck.experts, sim.ck.experts // sim.case.ep
        stem = f"{layer}.mlp.experts"
        moved = {e: (e + local) % experts for e in range(experts)}
        old = {n: t for n, t in served.items() if n.startswith(f"{stem}.")}
        for n in old:
            e = int(n.split(".")[5])
            served[n.replace(f"{stem}.{e}.", f"{stem}.{moved[e]}.")] = old[n]


UNFUSE_CASES = [
    ("qkv_blocks", Case("qwen2_tiny", tp=2), r"layer 0 self_attn\.[kqv]_proj "),
    ("qkv_blocks", Case("qwen3_moe_tiny", tp=2, ep=2, pp=2), r"layer 0 self_attn\.[kqv]_proj "),
    ("fc1_halves", Case("qwen2_tiny", tp=2), r"layer 0 mlp\.(gate|up)_proj "),
    ("expert_numbering", Case("qwen3_moe_tiny", ep=2), r"layer 0 mlp\.experts\.\w+ of expert 0 "),
]


@pytest.mark.parametrize(("fault", "case", "place"), UNFUSE_CASES, ids=[f"{f}-{c.id}" for f, c, _ in UNFUSE_CASES])
def test_a_wrong_merged_unfuse_is_caught_naming_the_module(simulated, fault, case, place):
    """The Megatron layout bugs a merged export could make (their adapter-side twins:
    tests/test_megatron_projections.py): each stops the check at the module it misplaces."""
    sim, _ = simulated(case)
    served = merged_hf(sim)
    wrong_unfuse(sim, served, fault)
    with pytest.raises(SyncError, match=place) as err:
        check(sim, served)
    assert MERGED in str(err.value)


def test_a_base_weight_in_no_known_layout_is_refused_by_name():
    """TransformerEngine's grouped experts keep `weight<e>` per expert: not read as a whole weight."""
    from lorarl.engines.megatron.base_projections import megatron_base_shares
    from lorarl.engines.megatron.projections import MegatronShape

    shape = MegatronShape(4, 2, 8, 32, 64, 16, 4, experts=4, local_experts=4)
    name = "module.decoder.layers.0.mlp.experts.linear_fc1.to_wrap.weight3"
    with pytest.raises(SyncError, match=re.escape(name)):
        megatron_base_shares([(name, torch.zeros(32, 32))], [], shape)
    wrapped = "module.decoder.layers.0.self_attention.linear_proj.to_wrap.weight"
    with pytest.raises(SyncError, match="linear_proj' holds a base weight but no adapter"):
        megatron_base_shares([(wrapped, torch.zeros(32, 32))], [], shape)


def test_megatron_backend_checks_merged_syncs_by_meaning():
    from lorarl.engines import BACKENDS
    from lorarl.engines.megatron.engine import MegatronEngine

    assert BACKENDS["megatron"].checks_meaning(merge=True) and BACKENDS["megatron"].checks_meaning(merge=False)
    assert callable(MegatronEngine.base_projections) and callable(MegatronEngine.base_stream)


def test_the_gpu_tests_comparison_on_the_simulated_engine(simulated):
    """tests/gpu's merged_check_against_export (not yet run on a GPU) with the simulated engine in
    the real one's place: the merged export passes, the pure base export passes against the base
    side alone, and the pure base sent as if merged fails."""
    from tests.gpu.test_megatron_gpu import merged_check_against_export

    sim, _ = simulated(Case("qwen3_moe_tiny", tp=2, ep=2, pp=2))
    base = {n: t.to(sim.case.torch_dtype) for n, t in sim.ck.tensors.items()}
    assert merged_check_against_export(sim, merged_hf(sim)) == 1.0
    assert merged_check_against_export(sim, base, with_delta=False) == 1.0
    with pytest.raises(SyncError, match=re.escape(MERGED)):
        merged_check_against_export(sim, base)
