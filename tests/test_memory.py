"""The update's memory estimate (lorarl.rollout.memory) against what autograd really keeps, and the
sleep decision it drives."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from lorarl.rollout.memory import GIB, ModelDims, layer_activation_bytes, plan_from_peak, plan_sleep, update_bytes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def saved_bytes(model, input_ids: torch.Tensor) -> int:
    """Bytes of the distinct activations autograd saves for backward during one forward (the
    weights it also saves are the model's own, not extra memory)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=input_ids, use_cache=False)
        out.logits.float().sum().backward()
    return sum(seen.values())


def qwen2_lora(layers: int, dtype: torch.dtype):
    cfg = Qwen2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    # LoRA in the compute dtype, as FSDP's mixed precision runs it (PEFT alone would keep it in
    # float32 and save a float32 copy of every LoRA input).
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
    return cfg, get_peft_model(model, lora, autocast_adapter_dtype=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_estimate_bounds_what_autograd_keeps(dtype):
    """A Qwen2 with PEFT LoRA on all seven projections: the estimate per token and layer is an
    upper bound of the saved tensors, and not a loose one (within 2x)."""
    ids = torch.randint(0, 512, (4, 64))
    cfg, four = qwen2_lora(4, dtype)
    _, two = qwen2_lora(2, dtype)
    measured = (saved_bytes(four, ids) - saved_bytes(two, ids)) / 2 / ids.numel()  # one layer, per token
    estimate = layer_activation_bytes(ModelDims.of(cfg), dtype_bytes=torch.finfo(dtype).bits // 8)
    assert measured <= estimate <= 2 * measured, (measured, estimate)


def test_checkpointing_and_model_parallelism_shrink_the_estimate():
    dims = ModelDims(3584, 18944, 28, 28, 4, 128, 152064)  # Qwen2.5-7B
    kw = dict(tokens=4096, response_tokens=3000, rank=64, targets=TARGETS)
    full = update_bytes(dims, checkpointing=False, **kw)
    assert 25 * GIB < full < 45 * GIB  # ~8 MB per token over 28 layers, plus logits and AdamW state
    assert update_bytes(dims, checkpointing=True, **kw) < full / 4
    assert update_bytes(dims, checkpointing=False, model_parallel=2, **kw) == pytest.approx(full / 2, rel=0.01)


def test_sleep_plan():
    assert plan_sleep(True).sleeps and not plan_sleep(False).sleeps
    assert "rollout.free_cache_engine=false" in str(plan_sleep(False))
    awake = plan_sleep(None, free_bytes=80 * GIB, need_bytes=40 * GIB)
    assert not awake.sleeps and "stays awake" in str(awake) and "80.0 GiB free" in str(awake)
    # The margin: 60 GiB needed is 77 GiB with it, so 70 free is not enough.
    assert plan_sleep(None, free_bytes=70 * GIB, need_bytes=60 * GIB).sleeps


def test_a_measured_peak_decides_again():
    # The 7B update at an 8192-token budget peaked at ~59 GiB with 76 GiB free beside the awake
    # engine (bench/results/update_profile_2026-12-02b), where the estimate, 67.9 GiB and 86.8
    # with its margin, has the engine sleep.
    plan = plan_from_peak(76 * GIB, 59 * GIB, tokens=8100, max_tokens=8192)
    assert not plan.sleeps and "peaked at 59.0 GiB" in str(plan) and "76.0 GiB free" in str(plan)
    # A peak from smaller micro-batches is scaled to the largest the run allows: 30 GiB at 4096
    # tokens is 60 at 8192, 68 with the margin.
    assert plan_from_peak(67 * GIB, 30 * GIB, tokens=4096, max_tokens=8192).sleeps
    assert not plan_from_peak(69 * GIB, 30 * GIB, tokens=4096, max_tokens=8192).sleeps
    # One sequence longer than the budget makes a larger micro-batch; it is not scaled down.
    assert plan_from_peak(34 * GIB, 30 * GIB, tokens=9000, max_tokens=8192).sleeps  # 35 GiB with margin


def test_a_kept_sleep_is_said_once_with_its_measured_peak(tmp_path):
    """The worker's re-plan after measured updates (one rank, over gloo): a peak that does not fit
    keeps the sleep and says why once; a later one that fits wakes the rollout for good."""
    import torch.distributed as dist

    from lorarl.config.compose import compose
    from lorarl.contract.messages import SyncReport
    from lorarl.contract.specs import SleepSpec
    from lorarl.driver.prepare import run_update_tokens
    from lorarl.rollout.sleep import RolloutSleep

    sleep = RolloutSleep.__new__(RolloutSleep)  # the GPU-only setup replaced by its outcome
    run = compose(["+backend=fsdp", "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=4096"])
    sleep.spec = SleepSpec(None, update_bytes=60 * GIB, update_tokens=run_update_tokens(run, dp_size=1))
    sleep.device = torch.device("cpu")
    sleep.plan, sleep._free_awake = plan_sleep(None, 70 * GIB, 60 * GIB), 70 * GIB
    sleep._update_peak, sleep._some_rank_sleeps, sleep._said_still_asleep = None, True, False
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        said = []
        for peak in (120, 119, 30, 120):  # GiB, each over micro-batches of 4096 tokens
            sleep.record_update(peak * GIB, 4096)
            said.append(sleep.replan())
    finally:
        dist.destroy_process_group()
    kept, again, woke, after = said
    assert "rollout sleeps" in kept and "peaked at 120.0 GiB" in kept and "70.0 GiB free" in kept
    assert again is None and "rollout stays awake" in woke and after is None and not sleep.sleeps
    # Whichever worker says it, the merged report carries it.
    quiet = SyncReport("adapter", 0, 0, 0.0, 0.0, 0.0, 0.0)
    assert SyncReport.merge([quiet, dataclasses.replace(quiet, sleep_plan=kept)]).sleep_plan == kept
    # With the plan goes whether vLLM now sleeps: the trainer's off-policy overlap follows it.
    merged = SyncReport.merge([quiet, dataclasses.replace(quiet, sleep_plan=woke, rollout_sleeps=False)])
    assert merged.sleep_plan == woke and merged.rollout_sleeps is False
    assert SyncReport.merge([quiet, quiet]).rollout_sleeps is None


def test_the_largest_micro_batch_a_run_allows():
    from lorarl.config.compose import compose
    from lorarl.driver.prepare import run_update_tokens

    budget = compose(["+backend=fsdp", "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=4096"])
    assert run_update_tokens(budget, dp_size=1) == 4096
    seq = budget.data.max_prompt_length + budget.data.max_response_length
    rows = compose(["+backend=fsdp", "actor.ppo_micro_batch_size_per_gpu=8"])
    assert run_update_tokens(rows, dp_size=1) == 8 * seq


@pytest.mark.parametrize(
    "shape,preset,gib", [("qwen2.5-7b", "qwen2_5_7b_instruct", 35.1), ("qwen2.5-0.5b", "qwen2_5_0_5b_instruct", 54.1)]
)
def test_the_presets_estimate_is_what_the_h200_runs_logged(shape, preset, gib):
    """The estimate for the presets on the benchmark's work (bench/results/gpu_step_2026-12-01:
    'the update needs ~35.1 GiB' at 7B, ~54.1 at 0.5B, both then run awake without running out)."""
    from bench.common import SHAPES
    from lorarl.config.compose import compose
    from lorarl.driver.prepare import run_update_bytes

    run = compose(["+backend=fsdp", f"model={preset}", "data.max_response_length=128", "rollout.n=8"])
    dims = ModelDims.of(Qwen2Config(**SHAPES[shape]))
    assert run_update_bytes(run, dims, dp_size=1, model_parallel=1) / GIB == pytest.approx(gib, abs=0.05)


def test_fsdp_without_resharding_counts_the_gathered_weights_it_keeps():
    """`backend.reshard_after_forward=false` keeps every layer's gathered weights until the
    backward: the 7B update's measured peak rose by 14.5 GiB (93.8 -> 108.3,
    bench/results/update_profile_2026-12-04c); the estimate adds the model's bf16 weights."""
    from bench.common import SHAPES
    from lorarl.config.compose import compose
    from lorarl.driver.prepare import run_update_bytes

    dims = ModelDims.of(Qwen2Config(**SHAPES["qwen2.5-7b"]))
    need = [
        run_update_bytes(
            compose(["+backend=fsdp", "model=qwen2_5_7b_instruct", *extra]), dims, dp_size=1, model_parallel=1
        )
        for extra in ([], ["backend.reshard_after_forward=false"])
    ]
    assert (need[1] - need[0]) / GIB == pytest.approx(14.5, abs=0.5)


def test_megatron_counts_its_head_at_every_position_and_its_attention_scores():
    """Megatron's head runs at every position. On one TP rank its loss is the FSDP engine's
    blockwise log-softmax over the logits in bf16 (2 + 2 + 2 bytes a logit: the logits, their
    gradient, a float32 block); split over TP ranks it is the vocab-parallel cross entropy, which
    holds two float32 copies of every position's (2 + 4 + 4 bytes a logit). With those copies at
    one rank the estimate at the benchmark's 0.5B work was 75.0 GiB, and the awake run failed in
    its first update beside the 80.6 GiB free on the H200 (bench/results/gpu_step_2026-12-04b_megatron.md).
    Its local spec's attention materialises the probabilities: a float32 softmax and its bf16
    copy per head and key position, for every token of every layer."""
    from bench.common import SHAPES
    from lorarl.config.compose import compose
    from lorarl.driver.prepare import run_update_bytes

    dims = ModelDims.of(Qwen2Config(**SHAPES["qwen2.5-0.5b"]))
    work = ["model=qwen2_5_0_5b_instruct", "data.max_response_length=128"]
    need = {}
    for name, extra in (
        ("fsdp", ["+backend=fsdp"]),
        ("megatron", ["+backend=megatron"]),
        ("megatron_tp2", ["+backend=megatron", "backend.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"]),
    ):
        run = compose([*extra, *work])
        need[name] = run_update_bytes(run, dims, dp_size=1, model_parallel=run.backend.model_parallel_size())
    tokens, vocab = 24_576, dims.vocab  # the preset's token budget, all under the head
    width = run.data.max_prompt_length + run.data.max_response_length
    scores = tokens * dims.layers * dims.heads * width * (4 + 2)
    assert scores / GIB == pytest.approx(8.86, abs=0.01)  # rows of 192 positions; 4x that in rows of 768
    head = 3 * tokens * vocab * 2
    without_copies = 75.0 - tokens * vocab * 10 / GIB + head / GIB
    assert need["megatron"] / GIB == pytest.approx(without_copies + scores / GIB, abs=0.05)
    assert need["fsdp"] < need["megatron"] < 75.0 * GIB + scores
    # Two TP ranks: each holds half of everything, the float32 copies and the scores included.
    assert need["megatron_tp2"] * 2 / GIB == pytest.approx(75.0 + scores / GIB, abs=0.05)
    assert not plan_sleep(None, free_bytes=int(80.6 * GIB), need_bytes=need["fsdp"]).sleeps
    # Over TransformerEngine's fused attention nothing of the kind is kept.
    te = compose(["+backend=megatron", "backend.transformer_impl=transformer_engine", *work])
    assert run_update_bytes(te, dims, dp_size=1, model_parallel=1) == need["megatron"] - scores


def test_the_switch_to_awake_needs_every_rank():
    """The measured plan wakes the rollout only when every rank's update fits (two gloo ranks)."""
    from tests.test_fsdp_engine import ROOT, torchrun

    torchrun(2, script=ROOT / "tests" / "distributed" / "all_ranks_check.py", timeout=120)


def test_a_shared_base_keeps_no_gathered_weights():
    """backend.share_base: the trainer's frozen weights are vLLM's and FSDP manages only LoRA, so
    the update's estimate holds no gathered base (the model's parameters as transformers counts
    them), also under reshard_after_forward=false."""
    from bench.common import SHAPES
    from lorarl.config.compose import compose
    from lorarl.driver.prepare import run_update_bytes

    config = Qwen2Config(**SHAPES["qwen2.5-7b"])
    with torch.device("meta"):
        numel = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    dims = ModelDims.of(config)
    run = compose(["+backend=fsdp", "model=qwen2_5_7b_instruct", "backend.reshard_after_forward=false"])
    kept = run_update_bytes(run, dims, dp_size=1, model_parallel=1)
    shared = run_update_bytes(run, dims, dp_size=1, model_parallel=1, shared_base=True)
    resharded = compose(["+backend=fsdp", "model=qwen2_5_7b_instruct"])
    assert shared == run_update_bytes(resharded, dims, dp_size=1, model_parallel=1)
    assert (kept - shared) / GIB == pytest.approx(numel * 2 / GIB, rel=0.01)


def qwen3_moe_lora(layers: int, routed: bool):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from lorarl.engines.routed_expert_lora import route_expert_lora

    cfg = Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=8192, moe_intermediate_size=96, num_experts=16,
        num_experts_per_tok=4, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=256, tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS[:4], target_parameters=list(EXPERT_TARGETS))
    model = get_peft_model(model, lora, autocast_adapter_dtype=False)
    if routed:
        route_expert_lora(model)
    return cfg, model


EXPERT_TARGETS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@pytest.mark.parametrize("routed", [False, True], ids=["peft_fold", "routed"])
def test_moe_layer_estimate_bounds_what_autograd_keeps(routed):
    """A Qwen3-MoE with attention and expert LoRA, per layer: what autograd saves per token is
    bounded by the estimate within 2x (the dense MLP width in its config, never used, plays no
    part), and PEFT's fold saves one folded expert stack per layer whatever the tokens, which the
    estimate counts; the routed expert LoRA saves no stack."""
    saved = {}
    for seq in (32, 64):
        ids = torch.randint(0, 512, (4, seq), generator=torch.Generator().manual_seed(seq))
        cfg, four = qwen3_moe_lora(4, routed)
        _, two = qwen3_moe_lora(2, routed)
        saved[seq] = (saved_bytes(four, ids) - saved_bytes(two, ids)) / 2
    per_token = (saved[64] - saved[32]) / (4 * 32)
    fixed = saved[32] - per_token * 4 * 32
    dims = ModelDims.of(cfg)
    estimate = layer_activation_bytes(dims, dtype_bytes=2)
    assert per_token <= estimate <= 2 * per_token, (per_token, estimate)
    stack = dims.expert_stack_numel() * 2
    kw = dict(tokens=256, response_tokens=128, checkpointing=False, rank=8, targets=TARGETS[:4], dtype_bytes=2)
    folded = update_bytes(dims, expert_targets=list(EXPERT_TARGETS), folded_expert_lora=True, **kw)
    unfolded = update_bytes(dims, expert_targets=list(EXPERT_TARGETS), **kw)
    assert folded - unfolded == (dims.layers + 1) * stack  # every layer's folded stack, and one gradient
    if routed:
        assert fixed < stack / 10, (fixed, stack)
    else:
        assert stack <= fixed < 1.1 * stack, (fixed, stack)


def test_the_30b_a3b_preset_counts_its_expert_lora_and_the_fold():
    """Qwen3-30B-A3B at rank 16 on attention and every expert: 643M LoRA parameters (the preset's
    own count), 10 GB of float32 weights, gradients and AdamW moments; PEFT's fold adds two
    expert stacks (2.3 GiB in bf16) under checkpointing, which backend.routed_expert_lora (the default) saves."""
    from transformers import Qwen3MoeConfig

    from bench.common import SHAPES
    from lorarl.config.compose import compose
    from lorarl.driver.prepare import run_update_bytes
    from lorarl.rollout.memory import lora_numel

    dims = ModelDims.of(Qwen3MoeConfig(**{k: v for k, v in SHAPES["qwen3-30b-a3b"].items() if k != "model_type"}))
    assert lora_numel(dims, 16, TARGETS[:4], list(EXPERT_TARGETS)) == pytest.approx(643e6, rel=0.005)
    run = compose(["+backend=fsdp", "model=qwen3_30b_a3b"])
    routed = run_update_bytes(run, dims, dp_size=1, model_parallel=1)  # the default
    run.backend.routed_expert_lora = False
    folded = run_update_bytes(run, dims, dp_size=1, model_parallel=1)
    assert folded - routed == 2 * dims.expert_stack_numel() * 2 and 2.2 * GIB < folded - routed < 2.4 * GIB
    assert routed > 16 * 643e6  # the LoRA state alone
