"""The FSDP2 engine on real shards (gloo, 1 and 2 processes) against HF + PEFT on one process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lorarl.contract.engine import build_batch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "distributed" / "fsdp_engine_check.py"


def torchrun(nproc: int, *args: str, timeout: int = 600, script: Path = SCRIPT) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--standalone",
        str(script),
        *args,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def engine_run(request, tiny_model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"fsdp{request.param}")
    torchrun(request.param, str(tiny_model_path), str(out))
    return request.param, out


def hf_peft(model_path: Path, adapter: dict[str, torch.Tensor] | None):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    if adapter is None:
        return model.eval()
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    result = set_peft_model_state_dict(peft_model, adapter)
    assert not result.unexpected_keys
    return peft_model.eval()


def logprobs(model, prompts, responses) -> torch.Tensor:
    from lorarl.algorithms.losses import token_logprobs

    batch = build_batch(prompts, responses, pad_id=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    return token_logprobs(logits, batch.input_ids[:, 1:])[0] * batch.response_mask


def test_adapter_gather_methods_agree(engine_run):
    _, out = engine_run
    bucketed = load_file(out / "adapter_bucketed.safetensors")
    for method in ("layered",):
        other = load_file(out / f"adapter_{method}.safetensors")
        assert other.keys() == bucketed.keys()
        for k in bucketed:
            torch.testing.assert_close(other[k], bucketed[k], rtol=0, atol=0)
    # 2 layers x 7 projections x (A, B), PEFT names that vLLM's parser accepts.
    assert len(bucketed) == 28
    assert all(
        k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
        for k in bucketed
    )


def test_engine_logprobs_match_hf_peft(engine_run, tiny_model_path):
    """Policy log-probs = HF + PEFT with the gathered adapter; reference = the plain base model."""
    from tests.distributed.fsdp_engine_check import PROMPTS, RESPONSES

    _, out = engine_run
    got = load_file(out / "logprobs.safetensors")
    adapter = load_file(out / "adapter_bucketed.safetensors")
    want_policy = logprobs(hf_peft(tiny_model_path, adapter), PROMPTS, RESPONSES)
    want_ref = logprobs(hf_peft(tiny_model_path, None), PROMPTS, RESPONSES)
    torch.testing.assert_close(got["policy"] * got["mask"], want_policy, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got["reference"] * got["mask"], want_ref, atol=1e-4, rtol=1e-4)
    assert (want_policy - want_ref).abs().max() > 1e-3, "the random adapter must change the policy"
    # Left-padded prompts (the layout the FSDP engine trains on) give the same response log-probs.
    left = got["policy_left"][got["mask_left"].bool()]
    torch.testing.assert_close(left, got["policy"][got["mask"].bool()], atol=1e-5, rtol=1e-5)
    # Both rows in one micro-batch, padding inside it: the same log-probs.
    padded = got["policy_padded"][got["mask_left"].bool()]
    torch.testing.assert_close(padded, got["policy"][got["mask"].bool()], atol=1e-5, rtol=1e-5)


def test_padding_inside_a_micro_batch_leaves_the_update_as_it_was(engine_run):
    """One micro-batch of two padded rows against two of one row each: the same gradient (a
    padding position that attended to nothing would make it NaN; one that a real token attended
    to would move it). The loss metrics average per micro-batch, so only the gradient compares."""
    _, out = engine_run
    result = json.loads((out / "result.json").read_text())
    one_row, padded = result["metrics"]["actor/grad_norm"], result["metrics_padded"]["actor/grad_norm"]
    assert one_row > 0
    assert padded == pytest.approx(one_row, rel=1e-5)


def test_update_after_a_reference_pass_with_unsharded_parameters(engine_run):
    """backend.reshard_after_forward=false: an update, a reference pass (adapter off, no grad),
    then an update that still trains the adapter (it used to find the LoRA weights frozen)."""
    _, out = engine_run
    again = json.loads((out / "result.json").read_text())["metrics_padded_again"]
    assert math.isfinite(again["actor/grad_norm"]) and again["actor/grad_norm"] > 0


def test_base_export_is_the_hf_checkpoint(engine_run, tiny_model_path):
    _, out = engine_run
    base = load_file(out / "base.safetensors")
    hf = hf_peft(tiny_model_path, None).state_dict()  # lists the tied lm_head too, as the export must
    assert base.keys() == hf.keys()
    for k in hf:
        torch.testing.assert_close(base[k], hf[k], rtol=0, atol=0)


def test_merged_export_equals_peft_merge(engine_run, tiny_model_path):
    _, out = engine_run
    merged = load_file(out / "merged.safetensors")
    adapter = load_file(out / "adapter_bucketed.safetensors")  # same seeded values as the merged engine's
    want = hf_peft(tiny_model_path, adapter).merge_and_unload().state_dict()
    assert merged.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(merged[k], want[k], atol=1e-5, rtol=1e-5)


def test_update_changes_the_adapter(engine_run):
    _, out = engine_run
    before = load_file(out / "adapter_bucketed.safetensors")
    after = load_file(out / "adapter_after_update.safetensors")
    changed = sum(not torch.equal(before[k], after[k]) for k in before)
    assert changed == len(before)
    result = json.loads((out / "result.json").read_text())
    m = result["metrics"]
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    assert m["actor/grad_norm"] > 0


def test_gather_is_the_same_at_any_world_size(tmp_path_factory):
    outs = [p for p in tmp_path_factory.getbasetemp().glob("fsdp*") if (p / "adapter_bucketed.safetensors").exists()]
    if len(outs) < 2:
        pytest.skip("needs both parametrised runs of this module")
    a, b = (load_file(p / "adapter_bucketed.safetensors") for p in outs[:2])
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_reference_pass_first_keeps_float32_lora_gradients(tiny_model_path):
    """FSDP2 fixes gradient dtypes at the first forward; PEFT's adapter-off context turns
    requires_grad off, so a reference pass first used to leave bf16 gradients on float32 LoRA
    weights (a GPU run with KL loss stopped at its first backward). Mixed precision as on GPU."""
    torchrun(1, str(tiny_model_path), script=ROOT / "tests" / "distributed" / "fsdp_mixed_precision_check.py")


def test_compiled_and_fused_lora_engines_compute_what_the_plain_engine_does(tiny_model_path):
    """backend.compile=true (torch.compile per decoder layer, before FSDP) and
    backend.fused_lora=true (every LoRA linear one autograd node) against the plain engine:
    reference pass, two updates and the log-probs after them, on micro-batches of different
    shapes; no graph break, and every LoRA linear of a training forward fused."""
    torchrun(1, str(tiny_model_path), script=ROOT / "tests" / "distributed" / "fsdp_variants_check.py")


def test_semantic_expected_side_from_shards_is_pefts_delta(engine_run, tiny_model_path):
    """The trainer's u^T dW v, summed from FSDP shards over 1 and 2 ranks, equals the same
    projection of PEFT's own get_delta_weight on one process; the self-test's random factors
    changed the export and were put back bit for bit."""
    from lorarl.sync import semantic

    _, out = engine_run
    result = json.loads((out / "result.json").read_text())
    assert result["randomized_differs"] and result["restored"]
    model = hf_peft(tiny_model_path, load_file(out / "adapter_bucketed.safetensors"))
    want = {}
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {}):
            delta = module.get_delta_weight("default").double()
            u, v = semantic.signs(delta.shape[0], "out"), semantic.signs(delta.shape[1], "in")
            want[name.removeprefix("base_model.model.")] = torch.einsum("ko,oi,ki->k", u, delta, v)
    got = result["projections"]
    assert sorted(got) == sorted(want) and len(want) == 14
    for path, values in got.items():
        torch.testing.assert_close(torch.tensor(values, dtype=torch.float64), want[path], rtol=1e-4, atol=1e-6)
