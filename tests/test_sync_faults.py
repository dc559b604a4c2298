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
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lorarl.contract.messages import SyncRequest
from lorarl.errors import ConfigError, LorarlError, SyncError
from lorarl.sync import semantic
from lorarl.sync.faults import FAULTS, SyncFault
from tests import workers

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


def make_worker(model: str, cache: Path, *overrides: str):
    """The real Worker (vLLM CPU + FSDP2 over gloo, one process) for the embedded `model`."""
    return workers.make_worker(f"model={model}", *overrides, cache=cache)


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
    session = worker.sync_sessions[0]
    session.fault, session._self_tested = SyncFault(fault), False
    return worker.sync(SyncRequest(step=step, last=False))[0]


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
    # The self-test's adapter went through vLLM's loader; the trained one was written in place,
    # after the writer was shown to leave what that loader leaves (lorarl.rollout.vllm.lora_write).
    assert worker.rollout._writes_in_place is True
    move_adapter(worker, seed=1)
    out = worker.sync(SyncRequest(step=1, last=False))[0]
    assert out.adapter_meaning == 1.0 and out.meaning_check_seconds > 0


def test_vllms_side_reads_the_same_with_every_slot_alone(worker, monkeypatch):
    """The observed side stacks the slots of one shape (vLLM runs in this process): one slot per
    stack reads the same values."""
    from lorarl.rollout.vllm import lora_slots

    move_adapter(worker, seed=1)
    expected = worker.engine.lora_projections()
    first_sync(worker, None)
    wanted = semantic.wanted_slots(expected, worker.rollout.adapter_layout())
    stacked = worker.rollout.lora_projections(wanted)
    monkeypatch.setattr(lora_slots, "STACK_BYTES", 1)
    alone = worker.rollout.lora_projections(wanted)
    assert stacked[2] == alone[2] == [] and torch.equal(stacked[1], alone[1])
    torch.testing.assert_close(stacked[0], alone[0], rtol=1e-12, atol=0)


def test_the_expected_side_is_pefts_delta(worker, monkeypatch):
    """The trainer's projections equal u^T dW v of PEFT's own get_delta_weight (FSDP over one rank),
    with the modules of one shape stacked and with every module alone."""
    move_adapter(worker, seed=2)
    theirs = peft_projections(worker.engine.model)
    stacked = worker.engine.lora_projections()
    monkeypatch.setattr(semantic, "STACK_BYTES", 1)
    for mine in (stacked, worker.engine.lora_projections()):
        assert sorted(mine) == sorted(theirs)
        for path, want in theirs.items():
            torch.testing.assert_close(mine[path].values, want, rtol=1e-4, atol=1e-6)  # PEFT forms dW in float32
    if worker.model_name == "qwen3_moe_tiny":
        assert any(".experts.7.down_proj" in p for p in stacked)


def fault_message(worker, fault: str) -> str | None:
    """The one-line SyncError that `fault` raises at the first sync of a moved adapter (None where
    the fault cannot apply to the worker's model: then its ConfigError is checked here); afterwards
    the trainer's scaling is restored and a correct sync passes again."""
    move_adapter(worker, seed=3)
    scaling = None
    if fault == "trainer_scaling":
        module = next(m for m in worker.engine.model.modules() if isinstance(getattr(m, "scaling", None), dict))
        scaling = dict(module.scaling)
    try:
        if (worker.model_name, fault) in NOT_APPLICABLE:
            with pytest.raises(ConfigError, match=f"trainer.sync_fault={fault} needs"):
                first_sync(worker, fault)
            return None
        if fault == "trainer_scaling":
            SyncFault(fault).on_engine(worker.engine)
        with pytest.raises(SyncError) as err:
            first_sync(worker, fault)
        message = str(err.value)
        assert "\n" not in message
        return message
    finally:
        if scaling is not None:
            module.scaling.update(scaling)
        # The trained factors are back, and the correct export passes again.
        assert first_sync(worker, None, step=4).adapter_meaning == 1.0


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_stops_the_first_sync_naming_the_place(worker, fault):
    message = fault_message(worker, fault)
    if message is not None:
        assert re.search(PLACE.get(fault, r"layer \d+ "), message), message


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
