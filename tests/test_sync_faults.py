"""The sync checks against the export faults they exist for, on the live vLLM CPU engine.

Each `trainer.sync_fault` corrupts the real export before the real rollout loads it; the first
sync after it (preceded, as every process's first adapter sync, by the export's self-test on
random factors) must stop with one line naming the place, on the tiny Qwen2, the tiny Qwen3 and
the tiny Qwen3-MoE (adapter sync: vLLM's CPU build loads expert LoRA, it only cannot generate
with it). The correct export must pass, with B still zero and after it moved. A fault the checks
were not written around, the trainer's own scaling of one module changed after the adapter was
made, must be caught too. The expected side is PEFT's own `get_delta_weight`, never the export.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lorarl.errors import ConfigError, LorarlError, SyncError
from lorarl.messages import SyncRequest
from lorarl.sync import semantic
from lorarl.sync.faults import FAULTS, SyncFault

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["qwen2_tiny", "qwen3_tiny", "qwen3_moe_tiny"]
# A fault that needs a part the model lacks is refused by name, before anything is sent.
NOT_APPLICABLE = {("qwen2_tiny", "expert_swap"), ("qwen3_tiny", "expert_swap")}
# What the one line names: a layer's module (and expert), or the tensor the payload refuses.
PLACE = {
    "expert_swap": r"layer 0 mlp\.experts\.\w+ of expert [01] \(",
    "base_as_lora": r"base weight 'base_model\.model\.model\.embed_tokens\.weight'",
    "stale_layer": r"layer 1 ",
    "missing_module": r"layer 0 self_attn\.v_proj ",
    "qk_swap": r"layer 0 self_attn\.[qk]_proj ",
    "gate_up_swap": r"layer 0 mlp\.(experts\.)?(gate|up)_proj ",
}


@pytest.fixture(scope="module")
def model_cache(run_cache: Path) -> Path:
    """run_cache with the session's Qwen3 and Qwen3-MoE under their presets' names."""
    from lorarl.models.tiny import default_tiny_model_path, ensure_tiny_model

    for arch in ("qwen3", "qwen3_moe"):
        link = run_cache / f"{arch}_tiny"
        if not link.exists():
            link.symlink_to(ensure_tiny_model(default_tiny_model_path(arch=arch), arch=arch), target_is_directory=True)
    return run_cache


def make_worker(model: str, cache: Path, *overrides: str):
    """The real Worker (vLLM CPU + FSDP2 over gloo, one process), composed from the real config."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lorarl.config.compose import to_run_config
    from lorarl.messages import Rendezvous
    from lorarl.prepare import prepare_model, worker_spec
    from lorarl.worker import Worker

    os.environ["LORARL_CACHE"] = str(cache)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "grpo",
            overrides=[
                "+backend=fsdp",
                f"model={model}",
                "trainer.experiment_name=x",
                "trainer.device=cpu",
                *overrides,
            ],
        )
    GlobalHydra.instance().clear()
    run = to_run_config(cfg)
    prepare_model(run)
    worker = Worker(worker_spec(run, "cpu"), rank=0, world_size=1, device="cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker.setup(Rendezvous(master_addr="127.0.0.1", master_port=port))
    return worker


@pytest.fixture(scope="module", params=MODELS)
def worker(request, model_cache: Path, lorarl_cache: Path):
    overrides = ["model.lora.merge=false"] if request.param == "qwen3_moe_tiny" else []
    w = make_worker(request.param, model_cache, *overrides)
    w.model_name = request.param
    yield w
    w.shutdown()
    os.environ["LORARL_CACHE"] = str(lorarl_cache)


def first_sync(worker, fault: str | None, step: int = 0):
    """A process's first adapter sync (self-test included) with `fault` switched on."""
    session = worker.sync_session
    session.fault, session._self_tested = SyncFault(fault), False
    return worker.sync(SyncRequest(step=step, last=False))


def move_adapter(worker, seed: int) -> dict[str, torch.Tensor]:
    """Trained-looking factors in the engine's shards (B non-zero), as training leaves them."""
    gen = torch.Generator().manual_seed(seed)
    lora = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in worker.engine.lora_state().items()}
    worker.engine.load_state(lora, None, None)
    return lora


def peft_projections(model) -> dict[str, torch.Tensor]:
    """u^T dW v per HF module (per expert projection) from PEFT's own get_delta_weight."""
    from torch.distributed.tensor import DTensor

    out = {}
    for lora in semantic.trainer_loras(model):
        module = dict(model.named_modules())[_peft_name(model, lora)]
        delta = module.get_delta_weight("default")
        delta = (delta.full_tensor() if isinstance(delta, DTensor) else delta).double()
        parts = semantic.EXPERT_PARTS[lora.parameter] if lora.parameter else (None,)
        deltas = delta.unsqueeze(0) if lora.num_experts == 1 else delta  # [E, out, in]
        rows = deltas.shape[1] // len(parts)
        for e in range(deltas.shape[0]):
            for i, part in enumerate(parts):
                d = deltas[e, i * rows : (i + 1) * rows]
                u, v = semantic.signs(d.shape[0], "out"), semantic.signs(d.shape[1], "in")
                path = lora.path if part is None else f"{lora.path}.{e}.{part}"
                out[path] = torch.einsum("ko,oi,ki->k", u, d, v)
    return out


def _peft_name(model, lora) -> str:
    for name, module in model.named_modules():
        if getattr(module, "lora_A", None) is not None and "default" in module.lora_A:
            if module.lora_A["default"].weight is lora.a:
                return name
    raise AssertionError(lora.path)


def test_correct_export_passes_fresh_and_moved(worker):
    out = first_sync(worker, None)
    assert out.adapter_match == 1.0 and out.adapter_meaning == 1.0
    # The self-test put the trained factors back bit for bit: B is still exactly zero.
    assert all(not v.any() for k, v in worker.engine.lora_state().items() if "lora_B" in k)
    move_adapter(worker, seed=1)
    out = worker.sync(SyncRequest(step=1, last=False))
    assert out.adapter_meaning == 1.0 and out.meaning_check_seconds > 0


def test_the_expected_side_is_pefts_delta(worker):
    """The trainer's projections equal u^T dW v of PEFT's own get_delta_weight (FSDP over one rank)."""
    move_adapter(worker, seed=2)
    mine = worker.engine.lora_projections()
    theirs = peft_projections(worker.engine.model)
    assert sorted(mine) == sorted(theirs)
    for path, want in theirs.items():
        torch.testing.assert_close(mine[path].values, want, rtol=1e-4, atol=1e-6)  # PEFT forms dW in float32
    if worker.model_name == "qwen3_moe_tiny":
        assert any(".experts.7.down_proj" in p for p in mine)


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_stops_the_first_sync_naming_the_place(worker, fault):
    move_adapter(worker, seed=3)
    scaling = None
    if fault == "trainer_scaling":
        module = next(m for m in worker.engine.model.modules() if isinstance(getattr(m, "scaling", None), dict))
        scaling = dict(module.scaling)
    try:
        if (worker.model_name, fault) in NOT_APPLICABLE:
            with pytest.raises(ConfigError, match=f"trainer.sync_fault={fault} needs"):
                first_sync(worker, fault)
            return
        if fault == "trainer_scaling":
            SyncFault(fault).on_engine(worker.engine)
        with pytest.raises(SyncError) as err:
            first_sync(worker, fault)
        message = str(err.value)
        assert "\n" not in message
        assert re.search(PLACE.get(fault, r"layer \d+ "), message), message
    finally:
        if scaling is not None:
            module.scaling.update(scaling)
    # The trained factors are back, and the correct export passes again.
    assert first_sync(worker, None, step=4).adapter_meaning == 1.0


def test_faults_in_bfloat16_at_real_layer_sizes():
    """The bound in vLLM's bf16 at Qwen2.5-7B and Qwen3-30B-A3B widths, rank 64 and 16: the correct
    slots pass; a doubled or halved scaling, a gate/up swap and a swapped expert fail."""
    gen = torch.Generator().manual_seed(0)
    for n_out, n_in, rank, experts in ((3584, 3584, 64, 1), (768 * 2, 2048, 16, 8)):
        a = torch.randn(rank * experts, n_in, generator=gen) / n_in**0.5
        b = torch.randn(n_out, rank * experts, generator=gen) * 0.01
        lora = semantic.TrainerLora("model.layers.0.x", a, b, 2.0, experts, "gate_up_proj" if experts > 1 else None)
        expected = semantic.trainer_projections([lora])
        slots = _vllm_slots(a, b, 2.0, experts)
        roundoff = semantic.unit_roundoff(torch.bfloat16)

        def observed(slots, expected=expected):
            out = {}
            for name, (sa, sb) in slots.items():
                want = expected[name]
                wanted = {name: (0, want.out_features, want.in_features)}
                ((_, values, share),) = semantic.slot_projections([name], sa[None], sb[None], wanted, (0, 1), False)
                out[name] = (values[0], share)
            return out

        assert semantic.compare(expected, observed(slots), roundoff) == 1.0
        for fault in ("x2", "half", "swap", "expert"):
            bad = dict(slots)
            if fault in ("x2", "half"):
                f = 2.0 if fault == "x2" else 0.5
                bad = {k: (sa, (sb.float() * f).bfloat16()) for k, (sa, sb) in slots.items()}
            elif fault == "swap" and experts > 1:
                g, u = "model.layers.0.x.1.gate_proj", "model.layers.0.x.1.up_proj"
                bad[g], bad[u] = slots[u], slots[g]
            elif fault == "expert" and experts > 1:
                for p in ("gate_proj", "up_proj"):
                    bad[f"model.layers.0.x.0.{p}"] = slots[f"model.layers.0.x.3.{p}"]
            else:
                continue
            with pytest.raises(SyncError, match="the delta vLLM applies is not the trainer's"):
                semantic.compare(expected, observed(bad), roundoff)


def _vllm_slots(a, b, scaling, experts):
    """Slots as vLLM holds them: factors cast to bf16, then B times the scaling in bf16, per
    expert (A_e: rows e*r..; B_e: columns e, e+E, ...), gate/up as the two halves of B's rows."""
    if experts == 1:
        return {"model.layers.0.x": (a.bfloat16(), b.bfloat16() * scaling)}
    rank = a.shape[0] // experts
    out = {}
    for e in range(experts):
        a_e, b_e = a[e * rank : (e + 1) * rank], b[:, e::experts]
        half = b.shape[0] // 2
        out[f"model.layers.0.x.{e}.gate_proj"] = (a_e.bfloat16(), b_e[:half].bfloat16() * scaling)
        out[f"model.layers.0.x.{e}.up_proj"] = (a_e.bfloat16(), b_e[half:].bfloat16() * scaling)
    return out


@pytest.mark.slow
def test_a_fault_stops_the_run_at_the_first_sync_with_exit_2(model_cache: Path, tmp_path: Path):
    """`python -m recipes.grpo ... +trainer.sync_fault=expert_swap` on the tiny Qwen3-MoE with
    adapter sync: one `error:` line naming the expert, exit 2, no adapter or checkpoint written."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "LORARL_CACHE": str(model_cache), "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    cmd = [sys.executable, "-m", "recipes.grpo", "+backend=fsdp", "model=qwen3_moe_tiny", "model.lora.merge=false"]
    cmd += ["+trainer.sync_fault=expert_swap", "trainer.total_steps=2", "trainer.device=cpu"]
    cmd += ["trainer.val_before_train=false", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "of expert" in errors[0] and "layer 0" in errors[0], proc.stderr[-3000:]
    assert not (run_dir / "final_adapter").exists() and not (run_dir / "checkpoints").exists()
    rows = (
        [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if (run_dir / "metrics.jsonl").exists()
        else []
    )
    assert not any("reward/mean" in r for r in rows)  # it never trained a step


def test_unknown_fault_is_refused_by_name():
    with pytest.raises(LorarlError, match="trainer.sync_fault='nope' is not a fault"):
        SyncFault("nope")


# ------------------------------------------------------------------------------ merged sync

# Merged sync (model.lora.merge=true) on the dense and the MoE model: the same faults, made in the
# merged weights (lorarl.sync.faults_merged), caught by the merged semantic check (or the payload).
MERGED_MODELS = ["qwen2_tiny", "qwen3_moe_tiny"]
MERGED_PLACE = {
    **PLACE,
    "base_as_lora": r"base payload tensor 'base_model\.model\.model\.layers\.0\.\w+\.\w+\.lora_A\.weight'",
    "stale_layer": r"layer 1 ",
}


@pytest.fixture(scope="module", params=MERGED_MODELS)
def merged_worker(request, model_cache: Path, lorarl_cache: Path):
    w = make_worker(request.param, model_cache, "model.lora.merge=true")
    w.model_name = request.param
    yield w
    w.shutdown()
    os.environ["LORARL_CACHE"] = str(lorarl_cache)


def test_merged_correct_sync_passes_fresh_and_moved(merged_worker):
    out = first_sync(merged_worker, None)
    assert out.weights_match == 1.0 and out.adapter_meaning == 1.0
    assert all(not v.any() for k, v in merged_worker.engine.lora_state().items() if "lora_B" in k)
    move_adapter(merged_worker, seed=1)
    out = merged_worker.sync(SyncRequest(step=1, last=False))
    assert out.adapter_meaning == 1.0 and out.meaning_check_seconds > 0


def test_merged_expected_side_is_the_models_base_plus_pefts_delta(merged_worker):
    """u^T W_base v (cached) + the delta, against the HF weights read directly and PEFT's get_delta_weight."""
    move_adapter(merged_worker, seed=2)
    model = merged_worker.engine.model
    base = merged_worker.engine.base_projections().modules
    delta = peft_projections(model)
    assert sorted(base) == sorted(delta)
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).double() for n, p in model.named_parameters()}
    for path, got in base.items():
        m = re.match(r"^(.+\.experts)\.(\d+)\.(\w+)$", path)
        if m is None:
            w = weights[f"base_model.model.{path}.base_layer.weight"]
        else:
            stem, e, proj = m[1], int(m[2]), m[3]
            stack = next(
                t
                for n, t in weights.items()
                if n.startswith(f"base_model.model.{stem}.")
                and n.endswith("gate_up_proj" if proj != "down_proj" else "down_proj")
            )
            w = stack[e]
            if proj != "down_proj":
                half = w.shape[0] // 2
                w = w[:half] if proj == "gate_proj" else w[half:]
        u, v = semantic.signs(w.shape[0], "out"), semantic.signs(w.shape[1], "in")
        torch.testing.assert_close(got.values, torch.einsum("ko,oi,ki->k", u, w, v), rtol=1e-12, atol=1e-9)
        assert got.norm == pytest.approx(float(w.norm()), rel=1e-9)


@pytest.mark.parametrize("fault", FAULTS)
def test_merged_each_fault_stops_the_first_sync_naming_the_place(merged_worker, fault):
    move_adapter(merged_worker, seed=3)
    scaling = None
    if fault == "trainer_scaling":
        module = next(m for m in merged_worker.engine.model.modules() if isinstance(getattr(m, "scaling", None), dict))
        scaling = dict(module.scaling)
    try:
        if (merged_worker.model_name, fault) in NOT_APPLICABLE:
            with pytest.raises(ConfigError, match=f"trainer.sync_fault={fault} needs"):
                first_sync(merged_worker, fault)
            return
        if fault == "trainer_scaling":
            SyncFault(fault).on_engine(merged_worker.engine)
        with pytest.raises(SyncError) as err:
            first_sync(merged_worker, fault)
        message = str(err.value)
        assert "\n" not in message
        assert re.search(MERGED_PLACE.get(fault, r"layer \d+ "), message), message
        if fault != "base_as_lora":
            assert "the merged weight vLLM serves is not the trainer's base + delta" in message, message
    finally:
        if scaling is not None:
            module.scaling.update(scaling)
    assert first_sync(merged_worker, None, step=4).adapter_meaning == 1.0


def test_merged_margin_with_moved_factors_and_a_missing_delta(merged_worker):
    """With the adapter moved, a correct sync sits far inside the bound and every module's delta far
    outside it; a sync whose delta is missing for one module fails on the moved factors alone (no
    self-test): the bound does not hide the delta."""
    from lorarl.sync.semantic_merged import merged_expected

    session = merged_worker.sync_session
    move_adapter(merged_worker, seed=5)
    assert merged_worker.sync(SyncRequest(step=5, last=False)).adapter_meaning == 1.0
    engine, rollout = merged_worker.engine, merged_worker.rollout
    base = engine.base_projections()
    delta = engine.lora_projections()
    expected = merged_expected(base.modules, delta)
    wanted = {p: (i, e.out_features, e.in_features) for i, (p, e) in enumerate(expected.items())}
    values, share, read = rollout.weight_projections(wanted)
    roundoff = max(semantic.unit_roundoff(rollout.torch_dtype, torch.float32), base.roundoff) + read
    bound = torch.stack([semantic.NOISE_SIGMAS * roundoff * e.noise for e in expected.values()])
    want = torch.stack([e.values for e in expected.values()])
    assert torch.allclose(share, torch.ones_like(share))
    correct = float(((values - want).abs() / bound).max())
    detect = float((torch.stack([d.values for d in delta.values()]).abs() / bound).min())
    print(
        f"{merged_worker.model_name}: correct sync at {correct:.3g} of the bound; smallest delta {detect:.3g} x the bound"
    )
    assert correct < 0.1 and detect > 10
    session.fault, session._self_tested = SyncFault("missing_module"), True
    try:
        with pytest.raises(SyncError, match=r"layer 0 self_attn\.v_proj .*base \+ delta"):
            merged_worker.sync(SyncRequest(step=6, last=False))
    finally:
        session.fault = SyncFault(None)
    assert merged_worker.sync(SyncRequest(step=7, last=False)).adapter_meaning == 1.0


@pytest.mark.parametrize("relative", [0.2, 0.005])
def test_merged_bound_in_bfloat16_at_a_7b_layer(relative):
    """At a Qwen2.5-7B projection (3584 x 3584, bf16 base, rank 64): a correct merged weight
    (W + delta rounded to bf16, as the export sends it) passes; the same weight without its delta
    fails when |delta|_F is 20% of |W|_F and passes (the documented limit) at 0.5%, where bf16
    rounding of W + delta is of the delta's own size."""
    from lorarl.sync.semantic_merged import TrainerBase, base_projections, merged_expected

    gen = torch.Generator().manual_seed(0)
    n, rank = 3584, 64
    w = (torch.randn(n, n, generator=gen) * 0.02).bfloat16()
    a = torch.randn(rank, n, generator=gen) / n**0.5
    b = torch.randn(n, rank, generator=gen)
    delta = b @ a
    b *= relative * float(w.float().norm()) / float(2.0 * delta.norm())  # scaling 2: |delta|_F = relative |W|_F
    path = "model.layers.0.self_attn.q_proj"
    base = base_projections([TrainerBase(path, w, None)])
    expected = merged_expected(
        base.modules, semantic.trainer_projections([semantic.TrainerLora(path, a, b, 2.0, 1, None)])
    )
    roundoff = max(semantic.unit_roundoff(torch.bfloat16, torch.float32), base.roundoff)
    u, v = semantic.signs(n, "out"), semantic.signs(n, "in")

    def observed(served: torch.Tensor) -> dict:
        return {path: (torch.einsum("ko,oi,ki->k", u, served.double(), v), 1.0)}

    merged = (w.float() + 2.0 * b @ a).bfloat16()
    assert semantic.compare(expected, observed(merged), roundoff, merged=True) == 1.0
    if relative > 0.1:
        with pytest.raises(SyncError, match="the merged weight vLLM serves is not the trainer's base"):
            semantic.compare(expected, observed(w), roundoff, merged=True)
    else:
        assert semantic.compare(expected, observed(w), roundoff, merged=True) == 1.0
