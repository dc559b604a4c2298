"""backend.share_base: the trainer's frozen base as views of the colocated vLLM engine's weights.

On the real vLLM CPU engine and tiny Qwen2 in a real worker: the trainer's frozen parameters read
the very memory vLLM computes with (storage address, offset, shape and strides), after load, after
updates and syncs (the semantic check passing at each) and after a checkpoint resume into a new
worker; a view of the wrong rows is seen by that comparison and stopped by the log-prob probe.
Over 2 gloo ranks: the replicated shared-base engine trains exactly as the FSDP-sharded one.
Where sharing cannot apply, auto falls back and says why; true is a one-line config error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lorarl.contract.messages import SyncRequest
from lorarl.errors import ConfigError, SyncError
from lorarl.files.peft_io import load_peft_adapter
from tests.test_fsdp_engine import ROOT, torchrun
from tests.test_sync_faults import make_worker, move_adapter

CHECK = ROOT / "tests" / "distributed" / "shared_base_check.py"


def hf_name(trainer_name: str) -> str:
    name = trainer_name.removeprefix("base_model.model.")
    while ".base_layer." in name:  # PEFT nests one wrapper per targeted expert stack
        name = name.replace(".base_layer.", ".")
    return name


def checkpoint_tensor(saved: dict, name: str) -> torch.Tensor:
    """The checkpoint's tensor of a Hugging Face parameter name. Transformers holds a MoE layer's
    experts as two stacks, `experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its
    up rows) and `experts.down_proj` [E, H, I], where the checkpoint holds one tensor per expert
    and projection; the stacks are rebuilt here from those, in that layout."""
    if name in saved:
        return saved[name]
    experts, _, stack = name.rpartition(".")
    count = 0
    while f"{experts}.{count}.down_proj.weight" in saved:
        count += 1
    assert count and stack in ("gate_up_proj", "down_proj"), f"the checkpoint has no tensor for {name}"
    parts = ("gate_proj", "up_proj") if stack == "gate_up_proj" else ("down_proj",)
    return torch.stack([torch.cat([saved[f"{experts}.{e}.{part}.weight"] for part in parts]) for e in range(count)])


def differ_from_checkpoint(worker) -> list[str]:
    """Trainer base parameters whose values are not the checkpoint's own tensors of that name (read
    from its safetensors files): a row view of the wrong part of a fused tensor, or a re-laid
    one, reads other values."""
    return differing(worker.engine.model, Path(worker.spec.engine.model.path))


def differing(model: torch.nn.Module, path: Path) -> list[str]:
    from safetensors.torch import load_file

    saved = {}
    for file in sorted(path.glob("*.safetensors")):
        saved.update(load_file(str(file)))
    frozen = {hf_name(n): p for n, p in model.named_parameters() if not p.requires_grad}
    return [
        name
        for name, p in frozen.items()
        if not torch.equal(p.detach().cpu(), checkpoint_tensor(saved, name).to(p.dtype))
    ]


def unshared(worker) -> list[str]:
    """Trainer base parameters whose storage span differs from the one vLLM computes with, read
    afresh from the live engine (expected side: vLLM's own parameters, not the engine's binding)."""
    from lorarl.rollout.vllm.base_views import engine_base_views, storage_spans

    engine = storage_spans(engine_base_views(worker.rollout))
    frozen = {hf_name(n): p for n, p in worker.engine.model.named_parameters() if not p.requires_grad}
    return [name for name, span in storage_spans(frozen).items() if engine.get(name) != span]


def vllm_param_addresses(worker) -> set[int]:
    """Storage addresses of every parameter vLLM's model holds (its own listing)."""
    from lorarl.rollout.vllm.in_worker import vllm_worker

    def read(w):
        return {p.untyped_storage().data_ptr() for p in vllm_worker(w).model_runner.get_model().parameters()}

    return worker.rollout.run_in_worker(read)


def train_step(worker, step: int) -> dict:
    """A real update of the trainer (ppo_update on its own log-probs), then the worker's sync."""
    from lorarl.algorithms.ppo import AdapterPlan, ppo_update
    from lorarl.contract.engine import build_batch
    from lorarl.contract.messages import Sampling
    from tests.distributed.fsdp_engine_check import PROMPTS, RESPONSES

    engine = worker.engine
    batch = build_batch(PROMPTS, RESPONSES, engine.pad_token_id, [1.0, -1.0], engine.left_pad_prompts)
    batch.old_logp = engine.log_probs(batch, temperature=1.0)
    batch.ref_logp = engine.log_probs(batch, temperature=1.0, reference=True)
    # The worker's own actor settings and correction; one sequence per prompt, as the batch is.
    sampling = Sampling(n=1, temperature=1.0, max_response_length=len(max(RESPONSES, key=len)), seed=0)
    ppo_update(engine, batch, step, [AdapterPlan(worker.spec.engine.actor, sampling, worker.correction)])
    return worker.sync(SyncRequest(step=step, last=False))[0]


@pytest.fixture()
def cache(run_cache: Path, lorarl_cache: Path):
    """The run cache for make_worker, which points LORARL_CACHE at it; the session's put back after."""
    import os

    yield run_cache
    os.environ["LORARL_CACHE"] = str(lorarl_cache)


def test_trainer_base_is_vllms_memory_after_load_updates_syncs_and_resume(cache, tmp_path):
    w = make_worker("qwen2_tiny", cache)
    try:
        check_shared_through_training(w, tmp_path / "ckpt")
    finally:
        w.shutdown()
    resumed = make_worker("qwen2_tiny", cache)
    try:
        resumed.load_checkpoint([str(tmp_path / "ckpt")])
        assert unshared(resumed) == []
        saved, _ = load_peft_adapter(tmp_path / "ckpt" / "adapter")
        for name, t in resumed.engine.lora_state().items():
            torch.testing.assert_close(t, saved[name], rtol=0, atol=0)
        report = resumed.sync(SyncRequest(step=3, last=False))[0]
        assert report.kind == "adapter" and report.adapter_meaning == 1.0
    finally:
        resumed.shutdown()


def check_shared_through_training(w, checkpoint: Path) -> None:
    assert w.spec.base_plan.shared and w.rollout.base_shared and w.rollout.base_loaded
    assert unshared(w) == [] and differ_from_checkpoint(w) == []
    assert sum(not p.requires_grad for p in w.engine.model.parameters()) == 26  # tiny Qwen2's base, head tied
    frozen = [p for p in w.engine.model.parameters() if not p.requires_grad]
    assert {p.untyped_storage().data_ptr() for p in frozen} <= vllm_param_addresses(w)
    # Row views of the fused projections, not copies: q, k and v start where vLLM's qkv rows do.
    attn = w.engine.model.base_model.model.model.layers[0].self_attn
    q, k = attn.q_proj.base_layer.weight, attn.k_proj.base_layer.weight
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert k.storage_offset() == q.storage_offset() + q.numel()

    reports = [w.sync(SyncRequest(step=0, last=False))[0]] + [train_step(w, step) for step in (1, 2)]
    assert [r.kind for r in reports] == ["adapter"] * 3  # never a base payload
    assert all(r.adapter_match == 1.0 and r.adapter_meaning == 1.0 for r in reports)
    assert unshared(w) == []

    w.save_checkpoint([str(checkpoint)])


def test_a_view_of_the_wrong_rows_is_seen_and_stopped_by_the_probe(cache):
    """The fault the sharing must never carry: layer 0's q_proj bound to layer 1's rows."""
    from lorarl.engines.shared_base import bind
    from lorarl.rollout.vllm.base_views import engine_base_views

    w = make_worker("qwen2_tiny", cache)
    try:
        move_adapter(w, seed=3)
        w.sync(SyncRequest(step=0, last=False))[0]
        probes = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]]
        w.sync_sessions[0].set_probes(probes)
        w.sync_sessions[0].probe_if_due(SyncRequest(step=1, last=False), w.sync(SyncRequest(step=1, last=False))[0])
        wrong = engine_base_views(w.rollout)["model.layers.1.self_attn.q_proj.weight"]
        bind(w.engine.model, "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", wrong)
        assert unshared(w) == differ_from_checkpoint(w) == ["model.layers.0.self_attn.q_proj.weight"]
        w.sync_sessions[0].set_probes(probes)
        with pytest.raises(SyncError, match="disagree on the probe"):
            w.sync_sessions[0].probe_if_due(SyncRequest(step=2, last=False), w.sync(SyncRequest(step=2, last=False))[0])
        # A rollout that lost its base is never sent one: the trainer's base is vLLM's own.
        w.rollout.base_loaded = False
        with pytest.raises(SyncError, match="the base is shared with vLLM"):
            w.sync(SyncRequest(step=3, last=False))[0]
    finally:
        w.shutdown()


@pytest.fixture(scope="module")
def two_ranks(tiny_model_path, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("shared2")
    torchrun(2, str(tiny_model_path), str(out), script=CHECK)
    return json.loads((out / "result.json").read_text())


def test_replicated_shared_base_trains_as_fsdp_sharded_over_two_ranks(two_ranks):
    """Same LoRA start and per-rank batches: equal losses, full LoRA gradients and factors for 3
    steps, within float32 roundoff; FSDP manages only LoRA (no base all-gather), each rank holds
    the whole base over the tensors it was given."""
    r = two_ranks
    assert r["shared_frozen"] == r["shared_frozen_whole"] == 26 and r["shared_same_storage"]
    assert r["shared_managed"] == r["lora_params"] and len(r["lora_params"]) == 28
    assert len(r["sharded_managed"]) == 26 + 28  # the two-copy engine shards the base too
    assert len(r["steps"]) == 3
    for step in r["steps"]:
        assert step["grads_compared"] == 28
        assert step["grad_max_diff"] <= 1e-5 * step["grad_max"], step
        assert step["lora_max_diff"] <= 1e-3 * step["lora_moved"], step
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            a, b = step["metrics"]["sharded"][key], step["metrics"]["shared"][key]
            assert b == pytest.approx(a, rel=1e-5, abs=1e-7), (key, step)


def test_two_rank_comparison_sees_a_wrong_view(tiny_model_path, tmp_path):
    """The comparison above fails on the fault it exists for: one base view of the wrong rows."""
    torchrun(2, str(tiny_model_path), str(tmp_path), "wrong_rows", script=CHECK)
    step = json.loads((tmp_path / "result.json").read_text())["steps"][0]
    assert step["grad_max_diff"] > 1e-2 * step["grad_max"]


# ---- when it applies ------------------------------------------------------------------------


def compose_run(*overrides: str):
    from lorarl.config.compose import compose

    return compose(["+backend=fsdp", "trainer.device=cpu", *overrides])


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (["model.lora.merge=true"], "model.lora.merge=true"),
        (["rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"], "rollout.tensor_model_parallel_size=2"),
        (["rollout.load_format=dummy"], "rollout.load_format=dummy"),
        (["backend.param_offload=true"], "backend.param_offload=true"),
    ],
)
def test_auto_falls_back_and_true_is_a_config_error(overrides, why):
    from lorarl.driver.base_plan import plan_base

    plan = plan_base(compose_run(*overrides))
    assert not plan.shared and why in str(plan) and "two copies" in str(plan)
    with pytest.raises(ConfigError, match=rf"^backend\.share_base=true cannot apply: .*{why.replace('.', '.')}"):
        compose_run(*overrides, "backend.share_base=true")


def test_runtime_reasons_dtype_and_moe_on_cpu():
    from lorarl.driver.base_plan import plan_base

    run = compose_run()
    assert plan_base(run, "cpu", "float32", False).shared
    assert "vLLM holds the base in bfloat16" in str(plan_base(run, "cpu", "bfloat16", False))
    assert "fused-MoE" in str(plan_base(run, "cpu", "float32", True))
    assert "backend.mixed_precision=bfloat16" in str(plan_base(run, "cuda", "float32", False))
    assert str(plan_base(compose_run("backend.share_base=false"), "cpu", "float32", False)).endswith(
        "(backend.share_base=false)"
    )
    with pytest.raises(ConfigError, match="backend.share_base=true cannot apply: vLLM's CPU build"):
        plan_base(compose_run("backend.share_base=true"), "cpu", "float32", True)
    with pytest.raises(ConfigError, match="backend.share_base='yes' is not valid"):
        compose_run("backend.share_base=yes")


@pytest.mark.slow
def test_default_recipe_trains_the_same_with_one_copy_or_two(run_cache, tmp_path):
    """3 steps of the default recipe, shared vs two copies: every training metric (rewards,
    lengths, losses, gradient norm, learning rate) identical, the log lines say which layout ran.
    vLLM's own log-probs (rollout_corr/*, the probe's sync/logprob_diff_*) may differ in float32
    roundoff: sharing makes vLLM's CPU linears compute with torch's linear instead of its oneDNN
    kernels (lorarl.rollout.vllm.base_views); the sampled tokens are the same."""
    from tests.test_grpo_e2e import grpo, metrics

    runs = {}
    for mode in ("true", "false"):
        out = grpo(
            tmp_path / mode, run_cache, "trainer.total_steps=3", "trainer.device=cpu", f"backend.share_base={mode}"
        )
        assert out.returncode == 0, out.stderr[-5000:]
        runs[mode] = metrics(tmp_path / mode)
        layout = "one copy" if mode == "true" else "two copies"
        assert f"base: {layout}" in out.stdout + out.stderr
    shared, two = runs["true"], runs["false"]
    assert len(shared) == len(two) == 3
    for a, b in zip(shared, two, strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if key.startswith(("timing/", "perf/")) or "seconds" in key or not isinstance(value, (int, float)):
                continue
            if key.startswith(("rollout_corr/", "sync/logprob_diff")):
                # Log-prob differences of ~1e-7 (their KL, chi2) and importance ratios 1 +- 1e-5
                # (their spread): 1e-3 is far above that roundoff and far below a wrong weight.
                assert value == pytest.approx(b[key], abs=1e-3), key
            else:
                assert value == b[key], (key, value, b[key])


def test_checkpoint_comparison_rebuilds_expert_stacks_and_sees_a_swap():
    """differ_from_checkpoint on a MoE (what the GPU check reads vLLM's fused-MoE stacks against):
    transformers' expert stacks equal the per-expert checkpoint tensors; gate and up swapped in
    one expert, or two experts exchanged, are seen in that stack alone."""
    from transformers import AutoModelForCausalLM

    from lorarl.models.tiny import default_tiny_model_path, ensure_tiny_model

    path = ensure_tiny_model(default_tiny_model_path(arch="qwen3_moe"), arch="qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).requires_grad_(False)
    assert differing(model, path) == []
    experts = model.model.layers[1].mlp.experts
    with torch.no_grad():
        half = experts.gate_up_proj.shape[1] // 2
        experts.gate_up_proj[3] = experts.gate_up_proj[3].roll(half, 0)  # gate and up exchanged
        assert differing(model, path) == ["model.layers.1.mlp.experts.gate_up_proj"]
        experts.gate_up_proj[3] = experts.gate_up_proj[3].roll(half, 0)
        experts.down_proj[[0, 1]] = experts.down_proj[[1, 0]]
        assert differing(model, path) == ["model.layers.1.mlp.experts.down_proj"]


def test_base_plan_reads_the_checkpoint_dtype_and_experts(tiny_model_path, tmp_path):
    """What the driver decides from the checkpoint: the tiny float32 Qwen2 shares on CPU, not when
    vLLM is told another dtype; a bfloat16 checkpoint with rollout.dtype=auto (the GPU presets)
    shares on a GPU, since vLLM then serves it in bfloat16; a MoE config on CPU does not."""
    from transformers import Qwen2Config, Qwen3MoeConfig

    from lorarl.driver.base_plan import plan_for_run

    cpu, cuda = "cpu", "cuda"
    assert plan_for_run(compose_run(f"model.path={tiny_model_path}"), cpu).shared
    plan = plan_for_run(compose_run(f"model.path={tiny_model_path}", "rollout.dtype=bfloat16"), cpu)
    assert not plan.shared and "vLLM holds the base in bfloat16" in str(plan)
    Qwen2Config(dtype="bfloat16").save_pretrained(tmp_path / "bf16")
    run = compose_run(f"model.path={tmp_path / 'bf16'}", "model.dtype=bfloat16")
    assert plan_for_run(run, cuda).shared
    assert "float32" in str(plan_for_run(compose_run(f"model.path={tmp_path / 'bf16'}"), cuda))
    Qwen3MoeConfig(num_experts=4, dtype="float32").save_pretrained(tmp_path / "moe")
    plan = plan_for_run(compose_run(f"model.path={tmp_path / 'moe'}", "model.lora.merge=false"), cpu)
    assert not plan.shared and "fused-MoE" in str(plan)


def test_data_parallel_plan_says_what_each_layout_needs_per_gpu(tiny_model_path):
    """At world size > 1 the plan states the per-GPU bytes of the shared layout and of a sharded
    second copy; the LoRA count is checked against the config's own dims (rank x (in + out) for
    each of the seven projections of every layer) and the bytes against the checkpoint's files."""
    from transformers import AutoConfig

    from lorarl.driver.base_plan import LayoutBytes, layout_bytes, plan_for_run

    run = compose_run(f"model.path={tiny_model_path}", "trainer.n_gpus_per_node=2")
    c = AutoConfig.from_pretrained(tiny_model_path)
    h, i = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    sizes = layout_bytes(run, c)
    assert sizes.lora_params == run.model.lora.rank * per_layer * c.num_hidden_layers
    assert sizes.weight_bytes == sum(f.stat().st_size for f in Path(tiny_model_path).glob("*.safetensors"))
    plan = plan_for_run(run, "cpu", c)
    assert plan.shared and str(plan).startswith("base: one copy") and "GiB shared, against" in str(plan)
    eight = LayoutBytes(world_size=8, weight_bytes=16 << 30, lora_params=1 << 30)
    assert (eight.shared, eight.sharded) == ((16 << 30) + (2 << 30), (18 << 30) + (2 << 30))
