"""VLLMRollout against HF + PEFT on the tiny model: real vLLM (CPU build), real PEFT.

Tolerance: fp32 on CPU. Greedy tokens must match exactly; per-token log-probs within
LOGPROB_TOL (measured max |diff| ~6e-5 for a random rank-8 adapter on all 7 projections).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from lorarl.contract.payload import PayloadKind, WeightPayload
from lorarl.data import arith
from lorarl.errors import ConfigError, SyncError
from lorarl.models.tiny import prompt_ids
from lorarl.rollout.vllm import engine_args
from lorarl.rollout.vllm.engine import VLLMRollout

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOGPROB_TOL = 1e-3
NEW_TOKENS = 8
MAX_LEN = 128


def make_rollout(path: Path, adapter_transport: str = "tmpfs", **kw) -> VLLMRollout:
    """`kw`: engine arguments (engine_args.build)."""
    kw.setdefault("lora_rank", 8)
    args = engine_args.build(path, max_model_len=MAX_LEN, seed=0, on_cpu=True, **kw)
    return VLLMRollout(args, adapter_transport=adapter_transport)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    return [prompt_ids(tiny_tokenizer, r["prompt"]) for r in arith.make_rows(6, seed=0, split="test")]


@pytest.fixture(scope="module")
def hf_base(tiny_model_path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


@pytest.fixture(scope="module")
def peft_model(tiny_model_path: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS)).eval()


def randomize(model, seed: int, std: float = 0.2) -> None:
    """Non-zero LoRA weights (PEFT starts with B = 0, which would test nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def adapter_payload(model) -> WeightPayload:
    from peft import get_peft_model_state_dict

    return WeightPayload.adapter(get_peft_model_state_dict(model), model.peft_config["default"].to_dict())


@torch.no_grad()
def hf_greedy(model, prompts) -> list[list[int]]:
    out = []
    for p in prompts:
        ids = model.generate(
            input_ids=torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=2, pad_token_id=0
        )
        out.append(ids[0, len(p) :].tolist())
    return out


@torch.no_grad()
def hf_logprobs(model, seq: list[int], start: int) -> list[float]:
    logp = model(input_ids=torch.tensor([seq])).logits[0].float().log_softmax(-1)
    return [logp[i - 1, seq[i]].item() for i in range(start, len(seq))]


def vllm_greedy(rollout: VLLMRollout, prompts) -> list[list[int]]:
    return [r[0] for r in rollout.sample(prompts, n=1, temperature=0.0, max_tokens=NEW_TOKENS).token_ids]


@pytest.fixture(scope="module", params=["tmpfs", "memory"])
def rollout(request, tiny_model_path: Path):
    r = make_rollout(tiny_model_path, adapter_transport=request.param)
    yield r
    r.shutdown()


# ------------------------------------------------------------------ adapter mode
def test_synced_adapter_reproduces_hf_peft(rollout, peft_model, hf_base, prompts):
    randomize(peft_model, seed=1)
    stats = rollout.apply(adapter_payload(peft_model))
    assert stats.kind is PayloadKind.ADAPTER and stats.num_tensors == 2 * 2 * len(PROJECTIONS)
    assert stats.bytes == sum(p.numel() * 4 for n, p in peft_model.named_parameters() if "lora_" in n)
    assert rollout.num_adapters() == 1

    want = hf_greedy(peft_model, prompts)
    assert want != hf_greedy(hf_base, prompts)  # the adapter changes the output at all
    samples = rollout.sample(prompts, n=1, temperature=0.0, max_tokens=NEW_TOKENS)
    assert [s[0] for s in samples.token_ids] == want

    worst = 0.0
    for p, resp, lps in zip(prompts, want, samples.logprobs):
        seq = p + resp
        ref = hf_logprobs(peft_model, seq, len(p))
        got = rollout.prompt_logprobs(seq, len(p))
        worst = max(worst, *(abs(a - b) for a, b in zip(got, ref)), *(abs(a - b) for a, b in zip(lps[0], ref)))
    assert worst < LOGPROB_TOL, worst


def test_fifty_syncs_keep_one_adapter_and_serve_the_last(rollout, peft_model, prompts):
    outputs = []
    for i in range(50):
        randomize(peft_model, seed=100 + i)
        rollout.apply(adapter_payload(peft_model))
        assert rollout.num_adapters() == 1
        if i >= 47:
            outputs.append(vllm_greedy(rollout, prompts))
    assert outputs[-1] != outputs[-2] != outputs[-3]  # each new adapter is the one used
    assert outputs[-1] == hf_greedy(peft_model, prompts)


def test_rollout_owns_its_adapter_tensors(rollout, peft_model, hf_base, prompts):
    randomize(peft_model, seed=7)
    sent = {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}
    rollout.apply(adapter_payload(peft_model))
    # vLLM scales lora_B in place while loading; the trainer's tensors must not see it.
    assert all(torch.equal(p, sent[n]) for n, p in peft_model.named_parameters() if "lora_" in n)
    want = vllm_greedy(rollout, prompts)
    with torch.no_grad():  # the trainer keeps training in place after the sync
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    rollout.reset_prefix_cache()
    assert vllm_greedy(rollout, prompts) == want
    # A base sync makes vLLM drop its adapters; the rollout re-attaches its own copy.
    rollout.apply(WeightPayload.base(hf_base.state_dict().items()))
    assert rollout.num_adapters() == 1
    assert vllm_greedy(rollout, prompts) == want


def test_seeded_sampling_is_reproducible_when_prefill_is_chunked(rollout, tiny_tokenizer):
    # 48 sequences of ~115 prompt tokens exceed vLLM's CPU budget of 4096 tokens per
    # step, so prefills get chunked: that crashed seeded sampling on CPU before the fix.
    rows = arith.make_rows(6, seed=1, split="train")
    prompts = [
        prompt_ids(tiny_tokenizer, [{"role": "user", "content": " ".join([r["prompt"][0]["content"]] * 7)}])
        for r in rows
    ]
    assert 4096 < 8 * sum(map(len, prompts)) and max(map(len, prompts)) + 4 <= MAX_LEN
    torch.manual_seed(0)
    expected_next = torch.rand(1)
    torch.manual_seed(0)
    a = rollout.sample(prompts, n=8, temperature=1.0, max_tokens=4, seed=5).token_ids
    assert torch.equal(torch.rand(1), expected_next)  # the caller's RNG stream is untouched
    b = rollout.sample(prompts, n=8, temperature=1.0, max_tokens=4, seed=5).token_ids
    c = rollout.sample(prompts, n=8, temperature=1.0, max_tokens=4, seed=6).token_ids
    assert len(a) == 6 and all(len(g) == 8 for g in a)
    assert a == b and a != c
    assert any(len(set(map(tuple, g))) > 1 for g in a)  # the n samples of a prompt differ


def test_rank_above_the_engine_limit_is_refused(rollout, tiny_model_path: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    big = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_path),
        LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj"]),
    )
    before = rollout.num_adapters()
    with pytest.raises(SyncError, match="exceeds the engine's max_lora_rank 8"):
        rollout.apply(adapter_payload(big))
    assert rollout.num_adapters() == before
    # The engine was built for rank <= 8 and one adapter, and (every request carrying it) with
    # no CUDA graphs kept apart for adapter-free batches.
    config = rollout.llm.llm_engine.vllm_config
    assert (config.lora_config.max_lora_rank, config.lora_config.max_loras) == (8, 1)
    assert config.compilation_config.cudagraph_specialize_lora is False


def test_rejected_adapter_leaves_no_adapter_and_generate_refuses(rollout, peft_model, prompts):
    randomize(peft_model, seed=21)
    good = adapter_payload(peft_model)
    rollout.apply(good)
    tensors = dict(good.tensors)
    # An input width the model does not have: the payload is well formed, vLLM's slot copy fails.
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.randn(8, 300)
    with pytest.raises(SyncError, match="vLLM rejected the adapter"):
        rollout.apply(WeightPayload.adapter(tensors, good.adapter_config))
    assert not rollout.has_adapter and rollout.adapter_rejected and rollout.num_adapters() == 0
    for call in (lambda: rollout.sample(prompts[:1]).token_ids, lambda: rollout.prompt_logprobs(prompts[0], 1)):
        with pytest.raises(SyncError, match="holds no valid adapter: vLLM rejected the last one"):
            call()
    rollout.apply(good)  # the next valid adapter serves again
    assert rollout.adapter_rejected is None and rollout.num_adapters() == 1
    assert vllm_greedy(rollout, prompts) == hf_greedy(peft_model, prompts)


# --------------------------------------------------------- dummy weights, base sync
@pytest.mark.parametrize("transport", ["tmpfs", "memory"])
def test_adapter_before_base_is_refused(tiny_model_path: Path, peft_model, transport):
    with make_rollout(tiny_model_path, load_format="dummy", adapter_transport=transport) as r:
        assert r.base_loaded is False
        with pytest.raises(SyncError, match="base weights are not in the engine; send a base payload first"):
            r.apply(adapter_payload(peft_model))
        assert r.num_adapters() == 0 and not r.has_adapter


@pytest.mark.parametrize("transport", ["tmpfs", "memory"])
def test_base_sync_into_dummy_engine(tiny_model_path: Path, hf_base, peft_model, prompts, transport):
    state = torch.random.get_rng_state()
    with make_rollout(tiny_model_path, load_format="dummy", adapter_transport=transport) as r:
        assert torch.equal(torch.random.get_rng_state(), state)  # vLLM's reseed was undone
        base_greedy = hf_greedy(hf_base, prompts)
        assert vllm_greedy(r, prompts) != base_greedy

        stats = r.apply(WeightPayload.base(hf_base.state_dict().items()))
        assert stats.kind is PayloadKind.BASE and stats.num_tensors == len(hf_base.state_dict())
        assert r.base_loaded
        assert vllm_greedy(r, prompts) == base_greedy

        randomize(peft_model, seed=3)
        r.apply(adapter_payload(peft_model))
        with_adapter = hf_greedy(peft_model, prompts)
        assert vllm_greedy(r, prompts) == with_adapter

        # vLLM drops adapters when base weights are reloaded; the rollout puts its one back.
        r.apply(WeightPayload.base(hf_base.state_dict().items()))
        assert r.num_adapters() == 1
        assert vllm_greedy(r, prompts) == with_adapter


# ------------------------------------------------------------------- merged mode
@pytest.fixture(scope="module")
def merged_rollout(tiny_model_path: Path):
    # rollout.engine_kwargs: a scheduler limit below the six prompts the tests send at once.
    r = make_rollout(tiny_model_path, lora_rank=None, engine_kwargs={"max_num_seqs": 4})
    yield r
    r.shutdown()


def test_engine_kwargs_reach_vllm_and_lorarls_own_are_refused(merged_rollout, tiny_model_path):
    from lorarl.config.validate import SET_BY_LORARL
    from lorarl.contract.specs import merged
    from lorarl.errors import ConfigError

    assert merged_rollout._llm.llm_engine.vllm_config.scheduler_config.max_num_seqs == 4
    # A compilation_config mapping adds to lorarl's keys; the user's win where both set one.
    ours = {"model": "m", "compilation_config": {"cudagraph_specialize_lora": False, "mode": 0}}
    theirs = {"async_scheduling": True, "compilation_config": {"mode": 3, "cudagraph_capture_sizes": [8]}}
    assert merged(ours, theirs) == {
        "model": "m",
        "async_scheduling": True,
        "compilation_config": {"cudagraph_specialize_lora": False, "mode": 3, "cudagraph_capture_sizes": [8]},
    }

    def build(**kw):
        return engine_args.build(tiny_model_path, lora_rank=8, max_model_len=MAX_LEN, seed=0, on_cpu=True, **kw)

    with pytest.raises(ConfigError, match=r"rollout.engine_kwargs.max_lora_rank: .* set model.lora.rank instead"):
        build(engine_kwargs={"max_lora_rank": 8})
    with pytest.raises(ConfigError, match=r"rollout.engine_kwargs.logprobs_mode: lorarl fixes .*; remove it"):
        build(engine_kwargs={"logprobs_mode": "raw_logprobs"})
    # Every argument lorarl passes is one the config refuses in rollout.engine_kwargs, but
    # compilation_config: lorarl sets one key of it, and the user's keys merge in.
    assert set(build(tensor_parallel_size=2).kwargs) - {"compilation_config"} <= set(SET_BY_LORARL)


def test_merged_mode_matches_hf_peft_merged(merged_rollout, peft_model, hf_base, prompts):
    r = merged_rollout
    assert not r.lora_enabled and r.base_loaded
    assert vllm_greedy(r, prompts) == hf_greedy(hf_base, prompts)

    randomize(peft_model, seed=11)
    want = hf_greedy(peft_model, prompts)
    merged = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    stats = r.apply(WeightPayload.base(merged.items()))
    assert stats.num_tensors == len(merged) and r.num_adapters() == 0
    assert vllm_greedy(r, prompts) == want
    seq = prompts[0] + want[0]
    got = r.prompt_logprobs(seq, len(prompts[0]))
    ref = hf_logprobs(peft_model, seq, len(prompts[0]))
    assert max(abs(a - b) for a, b in zip(got, ref)) < LOGPROB_TOL


def test_merged_mode_refuses_adapters(merged_rollout, peft_model):
    with pytest.raises(SyncError, match="merged mode"):
        merged_rollout.apply(adapter_payload(peft_model))


def test_failed_base_sync_clears_base_loaded_until_a_full_one(merged_rollout, hf_base, prompts):
    r = merged_rollout
    items = list(hf_base.state_dict().items())
    bad = items[:5] + [("model.layers.0.mlp.down_proj.lora_A.weight", torch.zeros(8, 512))] + items[5:]
    with pytest.raises(SyncError, match="down_proj.lora_A.weight' is not a plain HF name"):
        r.apply(WeightPayload.base(bad))
    assert r.base_loaded is False
    with pytest.raises(SyncError, match="no module or parameter named 'nope'"):
        r.apply(WeightPayload.base([("model.nope.weight", torch.zeros(1))]))
    r.apply(WeightPayload.base(items))
    assert r.base_loaded
    assert vllm_greedy(r, prompts) == hf_greedy(hf_base, prompts)


def test_base_payload_must_cover_every_weight_vllm_serves(merged_rollout, hf_base, prompts):
    r = merged_rollout
    items = list(hf_base.state_dict().items())
    # The FSDP stream sends the tied lm_head too; Megatron's sends no copy of it: both are complete.
    assert "lm_head.weight" in dict(items) and hf_base.config.tie_word_embeddings
    assert (
        r.apply(WeightPayload.base([(n, t) for n, t in items if n != "lm_head.weight"])).num_tensors == len(items) - 1
    )
    assert r.base_loaded
    left_out = [(n, t) for n, t in items if n != "model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(
        SyncError, match=r"covered \d+ of the \d+ weights vLLM serves.*layers.1.self_attn.k_proj.weight"
    ):
        r.apply(WeightPayload.base(left_out))
    assert r.base_loaded is False
    r.apply(WeightPayload.base(items))
    assert r.base_loaded
    assert vllm_greedy(r, prompts) == hf_greedy(hf_base, prompts)


# ------------------------------------------------------------------ sleep state
def test_sleep_level_follows_the_base_state(rollout, merged_rollout, tiny_model_path: Path):
    assert rollout.sleep_level == 1  # adapter mode keeps the base
    assert merged_rollout.sleep_level == 2  # merged mode resends it each step
    dummy = make_rollout(tiny_model_path, load_format="dummy")
    try:
        assert dummy.sleep_level == 2  # random weights waiting for a base payload: nothing to keep
    finally:
        dummy.shutdown()
    with pytest.raises(ConfigError, match="enable_sleep_mode is false"):
        rollout.sleep()


def test_generation_with_a_sleeping_cache_is_refused(rollout, prompts):
    """vLLM does not refuse a generate while its KV cache sleeps: it waits forever (H200, vLLM
    0.26: the sync's probe before the cache woke). The CPU build cannot sleep, so the state a
    weights-only wake leaves is set here as `sleep` + `wake_up(["weights"])` leave it."""
    rollout._asleep = {"kv_cache"}
    try:
        for call in (lambda: rollout.sample(prompts[:1]), lambda: rollout.prompt_logprobs(prompts[0], 1)):
            with pytest.raises(SyncError, match=r"asleep \(kv_cache\); call wake_up\(\['kv_cache'\]\)"):
                call()
    finally:
        rollout._asleep = set()
    assert rollout.sample(prompts[:1]).token_ids


def test_sleep_mode_on_cpu_is_a_config_error(tiny_model_path: Path):
    with pytest.raises(ConfigError, match="enable_sleep_mode"):
        make_rollout(tiny_model_path, enable_sleep_mode=True)


def test_shut_down_rollout_says_so(tiny_model_path: Path, prompts):
    r = make_rollout(tiny_model_path, lora_rank=None)
    r.shutdown()
    r.shutdown()  # idempotent
    with pytest.raises(SyncError, match="shut down"):
        r.sample(prompts[:1])


def test_engines_overlap_and_rebuild_in_one_process(tiny_model_path: Path, hf_base, prompts):
    # vLLM's parallel groups are process-global: shutting one engine down must not
    # break another that is still serving, and a later engine must start cleanly.
    want = hf_greedy(hf_base, prompts)
    first = make_rollout(tiny_model_path, lora_rank=None)
    second = make_rollout(tiny_model_path, lora_rank=None)
    first.shutdown()
    assert vllm_greedy(second, prompts) == want
    second.shutdown()
    with make_rollout(tiny_model_path, lora_rank=None) as third:
        assert vllm_greedy(third, prompts) == want


def test_memory_transport_name_mapper_keeps_renames_and_drops_fusion():
    """The in-memory adapter path hands vLLM the model's name mapper the way vLLM's own
    directory loader does (0.32 names that variant get_rename_mapper, 0.26 get_unstacked_mapper)."""
    from vllm.model_executor.models.utils import WeightsMapper

    from lorarl.rollout.vllm.in_worker import lora_name_mapper

    full = WeightsMapper(
        orig_to_new_prefix={"model.": "language_model.model."}, orig_to_new_stacked={".q_proj": (".qkv_proj", "q")}
    )
    mapped = lora_name_mapper(full)
    assert mapped.orig_to_new_prefix == {"model.": "language_model.model."}
    assert mapped.orig_to_new_stacked == {}
    assert lora_name_mapper(None) is None
    with pytest.raises(SyncError, match="rollout.adapter_transport=tmpfs"):
        lora_name_mapper(object())


def _count_lora_index_rebuilds(worker) -> int:
    """Inside the vLLM worker: wrap the LoRA manager's index rebuild with a counter (once)."""
    manager = getattr(worker, "worker", worker).model_runner.lora_manager._adapter_manager
    if not hasattr(manager, "lorarl_rebuilds"):
        rebuild = manager._set_adapter_mapping
        manager.lorarl_rebuilds = 0

        def counted(mapping):
            manager.lorarl_rebuilds += 1
            return rebuild(mapping)

        manager._set_adapter_mapping = counted
    return manager.lorarl_rebuilds


def test_wake_makes_vllm_rebuild_its_lora_indices(tiny_model_path: Path, peft_model, prompts):
    """vLLM rebuilds its per-batch LoRA index tensors only when a batch's mapping differs from
    the last one. On GPU those tensors live in the weights memory pool, so after a level-2 sleep
    the same probe request ran on garbage indices (H200: log-prob off by 0.3-2.6 with every
    weight right). refresh_lora_mapping, run on every weights wake, forces the rebuild."""
    randomize(peft_model, seed=11)
    r = make_rollout(tiny_model_path)
    try:
        r.apply(adapter_payload(peft_model))
        seq, start = prompts[0] + [5, 6, 7, 8], len(prompts[0])
        rebuilds = lambda: r.run_in_worker(_count_lora_index_rebuilds)  # noqa: E731
        first = rebuilds()
        expected = r.prompt_logprobs(seq, start)
        after_one = rebuilds()
        assert r.prompt_logprobs(seq, start) == expected
        assert rebuilds() == after_one  # same mapping: vLLM reuses the index tensors as they are
        r.refresh_lora_mapping()
        assert r.prompt_logprobs(seq, start) == expected
        assert rebuilds() == after_one + 1 and after_one >= first
    finally:
        r.shutdown()
