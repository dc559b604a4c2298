"""The sync checks on real tensors, real vLLM (CPU build) and the real worker (FSDP2 over gloo).

Fingerprint: exact, so every mutation of what vLLM holds (a skipped sync, a zeroed adapter, one
module's B left out) is caught and named; a correct sync matches in both transports. Probe:
judged on the worst token against a per-dtype bound and on the mean against the adapter-off
reference (its end-to-end runs are in test_sync_probe.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from lorarl.contract.payload import WeightPayload
from lorarl.errors import SyncError
from lorarl.rollout.vllm import engine_args
from lorarl.rollout.vllm.engine import VLLMRollout
from lorarl.sync import fingerprint as fingerprints
from lorarl.sync import probe, transport
from lorarl.sync.fingerprint import ZERO, Fingerprint, combine, fingerprint
from lorarl.sync.probe import FP32_BOUNDS, HALF_BOUNDS, ProbeReading, judge_probe

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ------------------------------------------------------------------------- fingerprints


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fingerprint_sees_every_bit_and_composes(dtype):
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(r, 24, generator=gen).to(dtype) for r in (5, 3, 7)]
    whole = torch.cat(parts)
    assert combine((fingerprint(p), p.numel()) for p in parts) == fingerprint(whole)
    # One ulp anywhere, or two values swapped, changes it.
    bumped = whole.clone()
    bumped.view(torch.int16 if dtype != torch.float32 else torch.int32)[4, 7] += 1
    assert fingerprint(bumped) != fingerprint(whole)
    swapped = whole.clone()
    swapped[[0, 1]] = whole[[1, 0]]
    assert fingerprint(swapped) != fingerprint(whole)
    # Trailing zero rows (vLLM's rank padding) add nothing; zeros fingerprint to ZERO.
    assert fingerprint(torch.cat([whole, torch.zeros(4, 24, dtype=dtype)])) == fingerprint(whole)
    assert fingerprint(torch.zeros(3, 3, dtype=dtype)) == ZERO
    # Cast first: the fingerprint of a float32 tensor "as stored in" dtype is the cast one's.
    assert fingerprint(whole.float(), dtype) == fingerprint(whole)


def test_fingerprint_wraps_like_int64():
    big = torch.full((1 << 12,), 3.0e38, dtype=torch.float32)
    fp = fingerprint(big)  # the weighted sum overflows int64 many times over
    assert -(1 << 63) <= fp.weighted < (1 << 63)
    halves = combine([(fingerprint(big[:1000]), 1000), (fingerprint(big[1000:]), big.numel() - 1000)])
    assert halves == fp == Fingerprint(fp.total, fp.weighted)


def test_batched_fingerprints_equal_one_at_a_time(monkeypatch):
    """Stacked same-shape reductions give each tensor's own integers, whatever the mix of
    shapes, dtypes, empty tensors and column chunks (a small chunk forces several passes)."""
    gen = torch.Generator().manual_seed(1)
    tensors = [torch.randn(8, 40, generator=gen).to(torch.bfloat16) for _ in range(5)]
    tensors += [torch.randn(40, 8, generator=gen), torch.zeros(0, 4), torch.randn(3, generator=gen).half()]
    tensors.append(torch.randn(30, 20, generator=gen))  # above the chunk: reduced alone
    tensors.insert(2, torch.randn(8, 40, generator=gen))  # same shape as the first, other dtype
    one_by_one = [fingerprint(t) for t in tensors]
    monkeypatch.setattr(fingerprints, "_CHUNK", 400)  # 5 stacked rows of 320 -> 80 columns per pass
    assert fingerprints.resolve(fingerprints.fingerprint_sums_many(tensors)) == one_by_one
    as_bf16 = fingerprints.resolve(fingerprints.fingerprint_sums_many(tensors[:3], torch.bfloat16))
    assert as_bf16 == [fingerprint(t, torch.bfloat16) for t in tensors[:3]]
    with pytest.raises(SyncError, match="cannot fingerprint"):
        fingerprints.fingerprint_sums_many([torch.zeros(2, dtype=torch.int64)])


def test_fingerprint_refuses_integer_tensors():
    with pytest.raises(SyncError, match="cannot fingerprint"):
        fingerprint(torch.zeros(2, dtype=torch.int64))


# ----------------------------------------------------------------------- probe judgement


def reading(sync_max, sync_mean, ref_mean) -> ProbeReading:
    return ProbeReading(sync_max, sync_mean, ref_mean, tokens=100)


def test_bf16_7b_noise_with_a_fresh_adapter_passes():
    # What the 7B bf16 run read with correct weights at step 1: max 0.157-0.20, adapter barely moved.
    judge_probe(reading(0.20, 0.02, 0.004), HALF_BOUNDS)
    judge_probe(reading(0.20, 0.03, 1.5), HALF_BOUNDS)


def test_zeroed_adapter_after_it_moved_fails_in_bf16():
    # vLLM serving the base: its distance to the trainer is the reference's.
    with pytest.raises(SyncError, match="as far from the trainer as the adapter-off reference"):
        judge_probe(reading(0.45, 0.30, 0.31), HALF_BOUNDS)


def test_absolute_bound_per_dtype():
    with pytest.raises(SyncError, match=r"max \|log-prob diff\| 0.0020 > 0.001"):
        judge_probe(reading(2e-3, 1e-4, 1.0), FP32_BOUNDS)
    with pytest.raises(SyncError, match="> 0.5"):
        judge_probe(reading(0.7, 0.01, 1.0), HALF_BOUNDS)
    with pytest.raises(SyncError):  # vLLM NaN where the trainer is finite
        judge_probe(
            probe.read_probe(torch.zeros(3), torch.tensor([0.0, float("nan"), 0.0]), torch.zeros(3)), HALF_BOUNDS
        )
    # The trainer's own NaN is divergence, reported by the next update with its step, not a sync fault.
    judge_probe(probe.read_probe(torch.tensor([float("nan"), 0, 0]), torch.zeros(3), torch.zeros(3)), FP32_BOUNDS)
    assert probe.probe_bounds(True, "float32") == FP32_BOUNDS
    assert probe.probe_bounds(True, "bfloat16") == HALF_BOUNDS
    assert probe.probe_bounds(False, "float32", 0.3).max == 0.3


def test_probe_sequences_prefer_long_ones():
    seqs = [[1] * 10, [2] * 40, [3] * 33, [4] * 20, [5] * 50, [6] * 35]
    assert [s[0] for s in probe.choose_probes(seqs)] == [2, 3, 5, 6]
    assert [s[0] for s in probe.choose_probes(seqs[:1] + seqs[3:4])] == [4, 1]


# ------------------------------------------------------- fingerprint against real vLLM


@pytest.fixture(scope="module")
def peft_model(tiny_model_path: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    # alpha/r = 1.5: the scaling vLLM folds into B is not a power of two, so rounding shows.
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=12, target_modules=PROJECTIONS)).eval()


def adapter(model, seed: int, std: float = 0.2) -> WeightPayload:
    from peft import get_peft_model_state_dict

    gen = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(v.shape, generator=gen) * std for k, v in get_peft_model_state_dict(model).items()}
    return WeightPayload.adapter(tensors, model.peft_config["default"].to_dict())


def mutated(payload: WeightPayload, edit) -> WeightPayload:
    tensors = {k: v.clone() for k, v in payload.tensors}
    edit(tensors)
    return WeightPayload.adapter(tensors, payload.adapter_config)


@pytest.fixture(scope="module", params=["tmpfs", "memory"])
def rollout(request, tiny_model_path: Path):
    args = engine_args.build(tiny_model_path, lora_rank=8, max_model_len=128, seed=0, on_cpu=True)
    r = VLLMRollout(args, adapter_transport=request.param)
    yield r
    r.shutdown()


def test_synced_adapter_matches_exactly(rollout, peft_model):
    sent = adapter(peft_model, seed=1)
    rollout.apply(sent)
    assert transport.verify_adapter(rollout, sent) == 1.0
    # Every module vLLM wraps has a slot, q/k/v and gate/up by their own names.
    held = rollout.held_adapter_sums().names
    assert len(held) == 2 * len(PROJECTIONS), sorted(held)
    assert "model.layers.1.self_attn.k_proj" in held and "model.layers.0.mlp.up_proj" in held


def test_skipped_sync_is_named(rollout, peft_model):
    old, new = adapter(peft_model, seed=2), adapter(peft_model, seed=3)
    rollout.apply(old)  # the trainer moved on to `new`, the sync never happened
    with pytest.raises(SyncError, match="rank 3: .* lora_A of 'model.layers.0.mlp.down_proj'.*other values"):
        transport.verify_adapter(rollout, new, rank=3)


def test_zeroed_adapter_is_named(rollout, peft_model):
    sent = adapter(peft_model, seed=4)

    def zero(t):
        for v in t.values():
            v.zero_()

    rollout.apply(mutated(sent, zero))
    with pytest.raises(SyncError, match="lora_A of 'model.layers.0.mlp.down_proj'.*holds zeros"):
        transport.verify_adapter(rollout, sent)


def test_one_layers_b_left_out_is_named(rollout, peft_model):
    sent = adapter(peft_model, seed=5)
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    rollout.apply(mutated(sent, lambda t: t[name].zero_()))
    with pytest.raises(SyncError, match="lora_B of 'model.layers.1.self_attn.v_proj'.*holds zeros"):
        transport.verify_adapter(rollout, sent)


def test_one_bit_off_is_caught(rollout, peft_model):
    sent = adapter(peft_model, seed=6)
    name = "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"
    rollout.apply(mutated(sent, lambda t: t[name].view(torch.int32)[3, 2].add_(1)))
    with pytest.raises(SyncError, match="lora_B of 'model.layers.0.mlp.gate_proj'"):
        transport.verify_adapter(rollout, sent)


def test_untargeted_modules_must_hold_zeros_and_lower_rank_pads(rollout, tiny_model_path: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]),
    )
    sent = adapter(model, seed=7)
    rollout.apply(sent)  # rank 4 in a rank-8 engine: B sits in a padded slot
    assert transport.verify_adapter(rollout, sent) == 1.0
    held = rollout.held_adapter_sums()
    v_proj_a = held.sums[held.names.index("model.layers.0.self_attn.v_proj"), :2]
    assert Fingerprint(*v_proj_a.tolist()) == ZERO


# -------------------------------------------------------- merged mode: the pushed weights


def _bump_norm(worker) -> None:
    """Inside vLLM's worker: change one stored bit of a layer norm, as a lost write would."""
    from lorarl.rollout.vllm.in_worker import vllm_worker

    model = vllm_worker(worker).model_runner.get_model()
    weight = dict(model.named_parameters())["model.layers.1.post_attention_layernorm.weight"]
    weight.data.view(torch.int32)[7] += 1


def test_merged_weights_fingerprint(tiny_model_path: Path, peft_model):
    merged = copy.deepcopy(peft_model)
    with torch.no_grad():
        for name, p in merged.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    state = merged.merge_and_unload().state_dict()
    args = engine_args.build(tiny_model_path, lora_rank=None, max_model_len=128, seed=0, on_cpu=True)
    with VLLMRollout(args, fingerprint_base=True) as r:
        r.apply(WeightPayload.base(state.items()))
        match, checked = transport.verify_weights(r, rank=0)
        # The CPU build keeps linear weights only packed for its GEMM library: embeddings and
        # norms are what can be read back here (on GPU every weight is).
        assert match == 1.0 and checked >= 5
        r.run_in_worker(_bump_norm)
        with pytest.raises(SyncError, match="'model.layers.1.post_attention_layernorm.weight' .* differs"):
            transport.verify_weights(r, rank=0)
