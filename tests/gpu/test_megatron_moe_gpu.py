"""Megatron engine on a Qwen3-MoE: expert LoRA trained, exported and checked against HF, on GPUs.

Run on the accelerator machine (megatron-core 0.19.2 + megatron-bridge 0.6.2; the local layer
spec, so TransformerEngine may be absent):

    pytest -m gpu tests/gpu/test_megatron_moe_gpu.py -s
    LORARL_GPU_LOG_DIR=tests/gpu_logs/moe pytest -m gpu tests/gpu/test_megatron_moe_gpu.py -s   # keep JSON

Cases: expert parallel 1 on one GPU (float32 and bfloat16) and expert parallel 2 on two GPUs
(float32; skipped with fewer). Each builds a random-init Qwen3-MoE folder (LORARL_GPU_MOE_LAYERS
layers, default 2; hidden 512, 8 heads / 4 KV heads, 8 experts of width 256, top-2 with
normalised weights as Qwen3-30B-A3B), runs `torchrun --nproc_per_node=EP` on this file: it
builds MegatronEngine with backend.expert_model_parallel_size=EP, trains 3 PPO steps with LoRA
rank 8 on attention and every expert, and writes the exports. The pytest side checks:
- before training (B = 0) policy log-probs == reference log-probs, exactly;
- the adapter export has every expert of every layer under the per-expert names vLLM loads
  (`mlp.experts.E.gate_proj.lora_A.weight`), on every expert-parallel rank the same;
- EP=1: our own split of the raw Megatron LoRA parameters == the bridge's export, exactly;
- HF (transformers' fused experts) with the exported adapter merged in by hand, expert by
  expert, gives the Megatron policy's log-probs within TOL, while the adapter moves them by
  more than 3x that (so the check can fail); the reference pass is within TOL of HF base;
- EP=1: the merged export (W + BA, model.lora.merge) equals that hand merge;
- the merged semantic check's expected side (engine.base_projections from Megatron's own expert and
  attention shards, plus engine.lora_projections) against the merged export at EP=1 (merged sync
  is refused at EP > 1), and its base side against the pure base export at every EP
  (tests.gpu.test_megatron_gpu.merged_check_against_export; written without a GPU, not yet run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

LAYERS = int(os.environ.get("LORARL_GPU_MOE_LAYERS", "2"))
EXPERTS, TOPK, HIDDEN, EXPERT_WIDTH = 8, 2, 512, 256
RANK, ALPHA = 8, 16
PROMPT_LEN, RESPONSE_LEN, N_SEQ = 16, 24, 8
# |logp_megatron - logp_hf|: float32 as the dense check; bfloat16 may flip a near-tied top-k
# choice for a token, so the bound is on the mean there, with a loose max.
TOL = {"float32": {"max": 2e-3, "mean": 2e-4}, "bfloat16": {"max": 1.0, "mean": 0.05}}
MERGE_TOL = {"float32": 1e-5, "bfloat16": 2e-2}
CASES = [(1, "float32"), (1, "bfloat16"), (2, "float32")]


# ---------------------------------------------------------------------------------------------
# torchrun side
# ---------------------------------------------------------------------------------------------


def _run_config(hf_dir: str, ep: int, dtype: str):
    from lorarl.config.compose import compose

    seqs = N_SEQ // 2 * ep  # prompts per step: every data-parallel rank trains N_SEQ sequences
    return compose(
        [
            "+backend=megatron", f"model.path={hf_dir}", "model.builder=null", f"model.dtype={dtype}",
            f"model.lora.rank={RANK}", f"model.lora.alpha={ALPHA}", "model.lora.target_modules=[all-linear]",
            "model.lora.init_A=kaiming", f"data.train_batch_size={seqs}", "rollout.n=2", "rollout.temperature=1.0",
            "actor.optim.lr=5e-3", f"actor.ppo_mini_batch_size={seqs}", "actor.ppo_micro_batch_size_per_gpu=4",
            "actor.use_dynamic_bsz=false", "actor.grad_clip=1.0", f"trainer.n_gpus_per_node={ep}",
            "trainer.device=cuda", "trainer.seed=7", f"backend.expert_model_parallel_size={ep}",
            "backend.transformer_impl=local",
        ]
    )  # fmt: skip


def _own_split(engine, hf_config: dict) -> dict[str, torch.Tensor]:
    """Our split of the raw Megatron LoRA parameters (EP=1: local expert index = global)."""
    import re

    from tests.gpu.megatron_workers import lora_shards
    from tests.megatron_moe_reference import expert_lora_to_peft
    from tests.megatron_reference import AttentionShape, megatron_lora_to_peft

    shards = lora_shards(engine)
    dense = {k: v for k, v in shards.items() if ".experts." not in k}
    out = megatron_lora_to_peft(dense, AttentionShape.from_hf_config(hf_config))
    pattern = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.adapter\.linear_in")
    for name in shards:
        m = pattern.search(name)
        if not m:
            continue
        stem = name.split(".linear_fc1.")[0]
        # Expert tensor parallel is 1 (the only size allowed): one shard per parameter.
        fc1, fc2 = (
            (shards[f"{stem}.{lin}.adapter.linear_in.weight"][0], shards[f"{stem}.{lin}.adapter.linear_out.weight"][0])
            for lin in ("linear_fc1", "linear_fc2")
        )
        out.update(expert_lora_to_peft(int(m.group(1)), int(m.group(2)), fc1, fc2))
    return out


def worker(hf_dir: str, out_dir: str, ep: int, dtype: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from lorarl.algorithms.ppo import AdapterPlan, Correction, ppo_update
    from lorarl.contract.engine import build_batch
    from lorarl.contract.payload import PayloadKind
    from lorarl.driver.jobs import sampling_of
    from lorarl.driver.prepare import engine_spec
    from lorarl.engines.megatron.engine import MegatronEngine
    from tests.gpu.megatron_workers import save_probe_and_result

    out = Path(out_dir)
    t0 = time.perf_counter()
    run = _run_config(hf_dir, ep, dtype)
    engine = MegatronEngine(engine_spec(run, "cuda"))
    temp = run.rollout.temperature
    sampling = sampling_of(run)
    correction = Correction.of(run.algorithm.rollout_correction, "cuda")
    rank = dist.get_rank()
    result: dict = {"ep": ep, "dtype": dtype, "layers": LAYERS, "experts": EXPERTS, "build_s": time.perf_counter() - t0}
    g = torch.Generator().manual_seed(123)
    prompts = [torch.randint(10, 1000, (PROMPT_LEN - i % 3,), generator=g).tolist() for i in range(N_SEQ)]
    responses = [torch.randint(10, 1000, (RESPONSE_LEN - i % 5,), generator=g).tolist() for i in range(N_SEQ)]
    batch = build_batch(prompts, responses, pad_id=0, advantages=[1.0 if i % 2 else -1.0 for i in range(N_SEQ)])
    mask = batch.response_mask.bool()
    result["initial_policy_vs_reference_max"] = float(
        (engine.log_probs(batch, temperature=temp) - engine.log_probs(batch, temperature=temp, reference=True))
        .abs()[mask]
        .max()
    )
    metrics = []
    for step in range(3):
        batch.old_logp = engine.log_probs(batch, temperature=temp)
        batch.ref_logp = engine.log_probs(batch, temperature=temp, reference=True)
        t = time.perf_counter()
        m = ppo_update(engine, batch, step, [AdapterPlan(run.actor, sampling, correction)])[0].metrics()
        m["update_s"] = time.perf_counter() - t
        metrics.append(m)
    result["metrics"] = metrics
    probe = build_batch([list(range(100, 130))], [list(range(500, 534))], pad_id=0)
    probe_policy = engine.log_probs(probe, temperature=temp)
    probe_reference = engine.log_probs(probe, temperature=temp, reference=True)

    t = time.perf_counter()
    try:
        payload, _ = engine.export(PayloadKind.ADAPTER)
        adapter = dict(payload.tensors)
        result["payload_validated"] = True
    except ModuleNotFoundError as e:  # WeightPayload checks names with vLLM's parser
        if "vllm" not in str(e):
            raise
        adapter = engine.lora_state()
        result["payload_validated"] = "skipped: vllm not installed"
    result["export_adapter_s"] = time.perf_counter() - t
    result["adapter_tensors"] = len(adapter)
    result["adapter_bytes"] = sum(v.numel() * v.element_size() for v in adapter.values())
    # The semantic check's Megatron expected side, experts over the expert-parallel ranks, against the export.
    from tests.gpu.test_megatron_gpu import merged_check_against_export, semantic_check_against_export

    result["semantic_check"] = semantic_check_against_export(engine, adapter)
    # The merged check's base side, experts over the expert-parallel ranks, against the pure base export.
    base_export = dict(engine.bridge.export_base(engine.model))
    result["base_side_check"] = merged_check_against_export(engine, base_export, with_delta=False)
    if ep == 1:
        ours = _own_split(engine, json.loads((Path(hf_dir) / "config.json").read_text()))
        result["own_split_names_equal"] = set(ours) == set(adapter)
        result["own_split_max_diff"] = max(
            float((ours[k].float().cpu() - adapter[k].float().cpu()).abs().max()) for k in adapter
        )
        merged_all = dict(engine.bridge.export_merged(engine.model))
        result["merged_semantic_check"] = merged_check_against_export(engine, merged_all)
        merged = {k: v for k, v in merged_all.items() if "layers.0." in k and "proj" in k}
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in adapter.items()}, str(out / f"adapter_rank{rank}.safetensors")
    )
    if rank == 0:
        (out / "adapter_config.json").write_text(json.dumps(engine.adapter_config()))
        if ep == 1:
            save_file(
                {k: v.detach().cpu().contiguous() for k, v in merged.items()}, str(out / "merged_layer0.safetensors")
            )
        save_probe_and_result(out, probe, probe_policy, probe_reference, result)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# pytest side
# ---------------------------------------------------------------------------------------------

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=32000, hidden_size=HIDDEN, intermediate_size=1024, moe_intermediate_size=EXPERT_WIDTH,
        num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        num_experts=EXPERTS, num_experts_per_tok=TOPK, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    d = tmp_path_factory.mktemp("qwen3_moe_shaped")
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # RMSNorm scales start at 1: make a q/k norm mix-up visible
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(str(d), safe_serialization=True)  # per-expert tensors on disk, float32
    return d


def hand_merged_state(
    base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scale: float, expert_width: int
) -> dict[str, torch.Tensor]:
    """transformers' Qwen3-MoE state (fused experts: gate_up_proj[e] = [gate; up]) with every
    LoRA tensor merged in (W + scale * B A), in float64. Tested on CPU in tests/test_megatron_moe.py."""
    from lorarl.engines.megatron.names import parse_expert_lora_name

    out = {k: v.double().clone() for k, v in base.items()}
    for name, a in adapter.items():
        if not name.endswith("lora_A.weight"):
            continue
        b = adapter[name.replace("lora_A", "lora_B")]
        delta = scale * b.double() @ a.double()
        parsed = parse_expert_lora_name(name)
        if parsed is None:
            out[name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")] += delta
            continue
        layer, expert, proj, _ = parsed
        stem = f"model.layers.{layer}.mlp.experts"
        if proj == "down_proj":
            out[f"{stem}.down_proj"][expert] += delta
        else:
            rows = slice(0, expert_width) if proj == "gate_proj" else slice(expert_width, 2 * expert_width)
            out[f"{stem}.gate_up_proj"][expert][rows] += delta
    return out


def _hf_logp(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(ids.cuda()).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].cuda().unsqueeze(-1)).squeeze(-1).cpu()


@pytest.mark.parametrize("ep, dtype", CASES, ids=[f"ep{e}-{d}" for e, d in CASES])
def test_megatron_moe_expert_lora_against_hf(hf_dir, tmp_path, ep, dtype):
    if torch.cuda.device_count() < ep:
        pytest.skip(f"needs {ep} GPUs")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lorarl.engines.megatron.names import parse_expert_lora_name

    out = tmp_path / "out"
    root = Path(__file__).parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ep}", __file__,
           "--worker", str(hf_dir), str(out), str(ep), dtype]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root), os.environ.get("PYTHONPATH", "")]),
    }
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads((out / "result.json").read_text())
    result["torchrun_s"] = time.perf_counter() - t0
    adapters = [load_file(str(out / f"adapter_rank{r}.safetensors")) for r in range(ep)]
    adapter = adapters[0]
    experts = {parse_expert_lora_name(k) for k in adapter} - {None}
    result["experts_exported"] = len({(layer, e) for layer, e, _, _ in experts})
    result["ep_ranks_identical"] = all(
        a.keys() == adapter.keys() and all(torch.equal(a[k], adapter[k]) for k in a) for a in adapters
    )

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    # eager experts: a plain per-expert matmul loop as the reference (no grouped-GEMM kernel choice)
    base_model = (
        AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch_dtype, experts_implementation="eager")
        .cuda()
        .eval()
    )
    probe = load_file(str(out / "probe.safetensors"))
    mask = probe["mask"].bool()
    hf_base = _hf_logp(base_model, probe["ids"])
    base_state = {k: v.float().cpu() for k, v in base_model.state_dict().items()}
    merged_state = hand_merged_state(base_state, adapter, ALPHA / RANK, EXPERT_WIDTH)
    base_model.load_state_dict({k: v.to(torch_dtype) for k, v in merged_state.items()})
    hf_lora = _hf_logp(base_model, probe["ids"])
    diff_policy = (hf_lora - probe["policy"]).abs()[mask]
    diff_reference = (hf_base - probe["reference"]).abs()[mask]
    effect = (hf_lora - hf_base).abs()[mask]
    result.update(
        policy_vs_hf_max=float(diff_policy.max()), policy_vs_hf_mean=float(diff_policy.mean()),
        reference_vs_hf_base_max=float(diff_reference.max()), reference_vs_hf_base_mean=float(diff_reference.mean()),
        adapter_effect_mean=float(effect.mean()), tolerance=TOL[dtype],
    )  # fmt: skip
    if ep == 1:
        merged = load_file(str(out / "merged_layer0.safetensors"))
        worst = 0.0
        for name, w in merged.items():
            parsed = name.split(".")  # model.layers.0.mlp.experts.E.gate_proj.weight or attention
            if ".experts." in name:
                e, proj = int(parsed[5]), parsed[6]
                fused = merged_state[
                    f"model.layers.0.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
                ][e]
                ref = (
                    fused
                    if proj == "down_proj"
                    else fused[:EXPERT_WIDTH]
                    if proj == "gate_proj"
                    else fused[EXPERT_WIDTH:]
                )
            else:
                ref = merged_state[name]
            worst = max(worst, float((w.double() - ref).abs().max() / ref.abs().max()))
        result["merged_vs_hand_merge_rel_max"] = worst
    print(json.dumps(result, indent=1, default=float))
    log_dir = os.environ.get("LORARL_GPU_LOG_DIR")
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        (Path(log_dir) / f"megatron_moe_ep{ep}_{dtype}.json").write_text(json.dumps(result, indent=1, default=float))

    assert result["initial_policy_vs_reference_max"] == 0.0
    assert all(m["actor/grad_norm"] == m["actor/grad_norm"] for m in result["metrics"])  # finite
    assert result["experts_exported"] == LAYERS * EXPERTS and result["ep_ranks_identical"]
    assert result["semantic_check"] == 1.0
    assert result["base_side_check"] == 1.0
    assert result["adapter_tensors"] == LAYERS * (4 * 2 + EXPERTS * 3 * 2)
    if ep == 1:
        assert result["own_split_names_equal"] and result["own_split_max_diff"] == 0.0
        assert result["merged_vs_hand_merge_rel_max"] <= MERGE_TOL[dtype], result
        assert result["merged_semantic_check"] == 1.0
    assert diff_policy.max() <= TOL[dtype]["max"] and diff_policy.mean() <= TOL[dtype]["mean"], result
    assert diff_reference.max() <= TOL[dtype]["max"] and diff_reference.mean() <= TOL[dtype]["mean"], result
    assert effect.mean() > 3 * diff_policy.mean(), f"adapter too weak to tell apart from numeric noise: {result}"


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
