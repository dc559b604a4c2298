"""Qwen3-MoE expert LoRA on GPUs: adapter sync into vLLM's fused-MoE LoRA layer, checked every step.

Run on the accelerator machine after .vllmcarry/install.sh and install-extra.sh:
    pytest -m gpu tests/gpu/test_moe_gpu.py -s
Cases: one GPU (rank 1, attention + every expert, the final adapter then loaded by HF+PEFT and
by vLLM from its path, log-probs compared); two GPUs with the engine's experts sliced by tensor
parallelism (each rank checks its slice); two GPUs with expert parallelism (each rank holds and
checks half the experts). The 30B-A3B-shaped timing run is tests/gpu/moe_step.sh; the sync alone,
vLLM's loader against the in-place write: python -m bench.moe_sync --dims real --layers 16 --device cuda.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_recipe(tmp_path: Path, name: str, overrides: list[str]) -> tuple[Path, list[dict]]:
    out = Path(os.environ.get("LORARL_GPU_LOG_DIR", tmp_path)) / name
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    env.setdefault("LORARL_CACHE", str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "recipes.grpo", "+backend=fsdp", "model=qwen3_moe_tiny", "model.lora.merge=false"]
    cmd += [f"trainer.total_steps={STEPS}", "trainer.check_sync_probe_freq=1", "trainer.test_freq=-1"]
    cmd += ["trainer.val_before_train=false", "model.dtype=bfloat16", f"hydra.run.dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    (out / "run.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "sync/kind" in r]
    assert len(steps) == STEPS and all(r["sync/kind"] == "adapter" for r in steps)
    assert all(r["sync/adapter_match"] == 1.0 for r in steps)  # the expert stacks included
    assert all(r["sync/adapter_meaning"] == 1.0 for r in steps)
    assert all(r["sync/logprob_diff_max"] < 0.5 for r in steps)
    return out, steps


def test_expert_adapter_sync_rank_1_and_the_final_adapter_loads_in_peft_and_vllm(tmp_path):
    if gpus() < 1:
        pytest.skip("needs a GPU")
    out, _ = run_recipe(tmp_path, "moe_1gpu_rank1", ["model.lora.rank=1", "rollout.enforce_eager=false"])
    # One GPU: after the first load, adapters are written into vLLM's slots in place (rollout/vllm/lora_write.py).
    assert "load through vLLM's loader at every sync" not in (out / "run.log").read_text()
    final = out / "final_adapter"
    assert (final / "adapter_model.safetensors").is_file() and (final / "vllm" / "adapter_model.safetensors").is_file()
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    path = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    tokens = list(range(3, 40))
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    peft = PeftModel.from_pretrained(base, final).eval()
    with torch.no_grad():
        logits = peft(input_ids=torch.tensor([tokens]).cuda()).logits.float()
    hf = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(tokens[1:]).cuda()[:, None])[:, 0].cpu()
    del peft, base
    torch.cuda.empty_cache()
    llm = LLM(path, enable_lora=True, max_lora_rank=8, max_model_len=128, gpu_memory_utilization=0.3, dtype="bfloat16")
    req = LoRARequest("final", 1, str(final / "vllm"))
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    got = llm.generate([{"prompt_token_ids": tokens}], params, lora_request=req)[0].prompt_logprobs
    vllm_lp = torch.tensor([got[i][tokens[i]].logprob for i in range(1, len(tokens))])
    no_lora = llm.generate([{"prompt_token_ids": tokens}], params)[0].prompt_logprobs
    base_lp = torch.tensor([no_lora[i][tokens[i]].logprob for i in range(1, len(tokens))])
    diff, moved = (vllm_lp - hf).abs().max().item(), (base_lp - hf).abs().mean().item()
    print(f"final adapter: HF+PEFT vs vLLM by path max |diff| {diff:.4f}; adapter effect (mean) {moved:.4f}")
    assert diff < 0.5 and (vllm_lp - hf).abs().mean().item() < 0.5 * moved + 0.05


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2_ep2"])
def test_expert_adapter_sync_over_two_gpus(tmp_path, expert_parallel):
    """The engine split over 2 ranks: each rank's fingerprint covers the expert slices (TP) or
    the experts (EP) it holds; the Megatron-Bridge #5635 failure (silently wrong expert LoRA
    under expert tensor parallelism) would show as a mismatch here."""
    if gpus() < 2:
        pytest.skip("needs 2 GPUs")
    overrides = ["trainer.n_gpus_per_node=2", "rollout.tensor_model_parallel_size=2"]
    overrides.append(f"rollout.enable_expert_parallel={str(expert_parallel).lower()}")
    run_recipe(tmp_path, f"moe_2gpu_{'ep' if expert_parallel else 'tp'}", overrides)


def test_routed_expert_lora_grouped_gemms_match_the_per_expert_path_and_peft():
    """backend.routed_expert_lora on CUDA in bf16 takes torch's grouped_mm; the same experts,
    tokens and factors through the per-expert matmuls (the path the CPU tests compare with PEFT
    in float64) and through PEFT's fold give the same output and factor gradients, to bf16's
    rounding. 30B-A3B's widths (128 experts, H 2048, I 768), rank 16."""
    import torch

    from lorarl.engines import routed_expert_lora as rel

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
    config._experts_implementation = "grouped_mm"  # what the fold's experts run on a GPU in training
    experts = Qwen3MoeExperts(config).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02).requires_grad_(False)
    hidden = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    index = torch.stack([torch.randperm(128, device="cuda")[:8] for _ in range(512)])
    weights = torch.rand(512, 8, device="cuda", dtype=torch.bfloat16)
    shapes = {"gate_up_proj": (2048, 1536), "down_proj": (768, 2048)}
    factors = {
        name: (torch.randn(128, 16, i, device="cuda") * 0.05, torch.randn(128, o, 16, device="cuda") * 0.05, 2.0)
        for name, (i, o) in shapes.items()
    }

    def run(path) -> tuple[torch.Tensor, list[torch.Tensor]]:
        leaves = [t.clone().requires_grad_(True) for a, b, _ in factors.values() for t in (a, b)]
        lora = {
            n: (leaves[2 * i].bfloat16(), leaves[2 * i + 1].bfloat16(), f[2])
            for i, (n, f) in enumerate(factors.items())
        }
        out = path(lora)
        (out.float() * torch.linspace(-1, 1, 2048, device="cuda")).sum().backward()
        return out.float(), [t.grad for t in leaves]

    assert rel._grouped_mm_fits(hidden, experts, {n: f for n, f in factors.items()})
    grouped = run(lambda lora: rel.routed_experts(experts, hidden, index, weights, lora))
    original = rel._grouped_mm_fits
    rel._grouped_mm_fits = lambda *_: False
    try:
        per_expert = run(lambda lora: rel.routed_experts(experts, hidden, index, weights, lora))
    finally:
        rel._grouped_mm_fits = original

    def folded(lora):  # PEFT's arithmetic: W + s B A on the whole stack, then transformers' experts
        saved = {n: getattr(experts, n) for n in lora}
        try:
            for n, (a, b, s) in lora.items():
                delattr(experts, n)
                setattr(experts, n, saved[n] + s * torch.bmm(b, a))
            return experts(hidden, index, weights)
        finally:
            for n, p in saved.items():
                delattr(experts, n)
                experts.register_parameter(n, p)

    fold = run(folded)
    # By norm, not element by element: the three paths sum in different orders in bf16, and a few
    # of the 1M outputs land ulps apart (5 beyond atol 0.02 on one H100), while a wrong expert,
    # factor or gate/up half moves the whole output or gradient.
    for other in (per_expert, fold):
        for g, h in zip((grouped[0], *grouped[1]), (other[0], *other[1]), strict=True):
            assert (g - h).norm() <= 2e-2 * h.norm(), ((g - h).norm(), h.norm())
