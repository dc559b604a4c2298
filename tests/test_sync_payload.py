"""WeightPayload: names from real PEFT and HF models, checked against vLLM's own parser."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch

from lorarl.config.schema import VLLM_LORA_RANKS, vllm_lora_rank
from lorarl.contract.messages import SyncReport
from lorarl.contract.payload import PayloadKind, SyncStats, WeightPayload
from lorarl.errors import ConfigError, SyncError

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def hf_state(tiny_model_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()


@pytest.fixture(scope="module")
def peft_parts(tiny_model_path: Path):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS))
    return get_peft_model_state_dict(model), model.peft_config["default"].to_dict(), model


def test_every_real_peft_name_is_accepted_by_vllm(peft_parts):
    from vllm.lora.utils import parse_fine_tuned_lora_name

    state, config, _ = peft_parts
    assert len(state) == 2 * 2 * len(PROJECTIONS)  # layers x (A, B) x projections
    modules = set()
    for name in state:
        module, is_a = parse_fine_tuned_lora_name(name)
        assert is_a == name.endswith("lora_A.weight")
        modules.add(module.rsplit(".", 1)[-1])
    assert modules == set(PROJECTIONS)
    payload = WeightPayload.adapter(state, config)
    assert payload.kind is PayloadKind.ADAPTER
    assert [n for n, _ in payload.tensors] == list(state)
    assert payload.adapter_config["target_modules"] == sorted(PROJECTIONS)  # set -> JSON list
    assert payload.max_rank == 8


def test_full_state_dict_sent_as_adapter_is_rejected_before_vllm(hf_state, peft_parts):
    """The seed bug: base weights down the adapter path."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    _, config, _ = peft_parts
    with pytest.raises(ValueError, match="unsupported LoRA weight"):
        parse_fine_tuned_lora_name("model.embed_tokens.weight")  # what vLLM said in the seed run
    with pytest.raises(SyncError, match="base weight 'model.embed_tokens.weight'.*WeightPayload.base"):
        WeightPayload.adapter(hf_state, config)


def test_peft_model_with_base_mixed_in_is_rejected(peft_parts):
    _, config, model = peft_parts
    # The raw module state dict holds base_layer weights and adapter-named keys.
    with pytest.raises(SyncError):
        WeightPayload.adapter(model.state_dict(), config)


def test_adapter_names_must_be_peft_saved_form(peft_parts):
    state, config, _ = peft_parts
    name, tensor = next(iter(state.items()))
    named = name.replace("lora_A.weight", "lora_A.default.weight")  # named_parameters form
    with pytest.raises(SyncError, match="PEFT saved form"):
        WeightPayload.adapter({named: tensor}, config)


def test_adapter_needs_pairs_and_consistent_rank(peft_parts):
    state, config, _ = peft_parts
    only_a = {k: v for k, v in state.items() if k.endswith("lora_A.weight")}
    with pytest.raises(SyncError, match="no matching .*lora_B.weight"):
        WeightPayload.adapter(only_a, config)
    with pytest.raises(SyncError, match="r=4"):
        WeightPayload.adapter(state, {**config, "r": 4})
    with pytest.raises(SyncError, match="twice"):
        WeightPayload.adapter(list(state.items()) + list(state.items())[:1], config)


def test_adapter_config_must_be_a_complete_plain_dict(peft_parts):
    from peft import LoraConfig

    state, config, _ = peft_parts
    for key in ("r", "lora_alpha", "target_modules"):
        broken = {k: v for k, v in config.items() if k != key}
        with pytest.raises(SyncError, match=key):
            WeightPayload.adapter(state, broken)
    with pytest.raises(SyncError, match="plain dict"):
        WeightPayload.adapter(state, LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS))
    with pytest.raises(SyncError, match="bias"):
        WeightPayload.adapter(state, {**config, "bias": "all"})
    with pytest.raises(SyncError, match="JSON"):
        WeightPayload.adapter(state, {**config, "extra": object()})


def test_base_payload_streams_and_checks_names_lazily(hf_state):
    seen = []

    def stream():
        for name, tensor in hf_state.items():
            seen.append(name)
            yield name, tensor

    payload = WeightPayload.base(stream())
    assert payload.kind is PayloadKind.BASE and payload.adapter_config is None
    assert seen == []  # nothing read until the consumer iterates
    assert [n for n, _ in payload.tensors] == list(hf_state)


@pytest.mark.parametrize(
    "bad",
    [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "model.layers.0.self_attn.q_proj.lora_B.weight",
        "model.layers.0.self_attn.q_proj.base_layer.weight",
        "base_model.model.model.norm.weight",
    ],
)
def test_base_payload_rejects_peft_names(hf_state, bad):
    items = list(hf_state.items())
    payload = WeightPayload.base(items[:3] + [(bad, torch.zeros(2, 2))] + items[3:])
    it = iter(payload.tensors)
    for _ in range(3):
        next(it)  # the good ones before it pass
    with pytest.raises(SyncError, match=f"'{bad}' is not a plain HF name"):
        next(it)


def test_base_payload_rejects_an_adapter_config(hf_state, peft_parts):
    with pytest.raises(SyncError, match="adapter_config"):
        WeightPayload(PayloadKind.BASE, hf_state, peft_parts[1])


def test_kind_must_be_known(hf_state):
    with pytest.raises(SyncError, match="neither 'base' nor 'adapter'"):
        WeightPayload("lora", hf_state)


def test_rank_table_matches_vllm():
    from vllm.config.lora import MaxLoRARanks

    assert VLLM_LORA_RANKS == tuple(typing.get_args(MaxLoRARanks))


@pytest.mark.parametrize(
    "rank,expected",
    [(1, 1), (2, 8), (8, 8), (9, 16), (16, 16), (33, 64), (64, 64), (257, 320), (320, 320), (321, 512), (512, 512)],
)
def test_rank_rounds_up(rank, expected):
    assert vllm_lora_rank(rank) == expected


@pytest.mark.parametrize("rank", [0, -8, 513, 1024, 8.0, True, "8"])
def test_bad_rank_is_a_config_error(rank):
    with pytest.raises(ConfigError, match="model.lora.rank"):
        vllm_lora_rank(rank)


def test_sync_stats_total():
    s = SyncStats(PayloadKind.ADAPTER, num_tensors=4, bytes=100, gather_s=0.5, transfer_s=0.25, load_s=0.125)
    assert s.seconds == 0.875
    base = SyncStats(PayloadKind.BASE, num_tensors=2, bytes=50, gather_s=1.0)
    report = SyncReport.of([base, s], num_adapters=1)
    assert report.kind == "base+adapter" and report.bytes == 150
    assert report.seconds == 1.875 and report.gather_seconds == 1.5
    assert list(report.metrics()) == [
        "sync/kind",
        "sync/num_tensors",
        "sync/bytes",
        "sync/gather_seconds",
        "sync/transfer_seconds",
        "sync/load_seconds",
        "sync/seconds",
        "sync/num_adapters",
    ]


def test_sync_reports_merge_to_the_worst_probe():
    """Over workers: the first worker's report, with the probe's worst token and mean and the
    adapter count taken over all of them; the checks that ran are logged, the rest are not."""
    one = SyncReport.of([SyncStats(PayloadKind.ADAPTER, 4, 100)], num_adapters=1)
    one.adapter_match, one.adapter_check_seconds = 1.0, 0.01
    one.logprob_diff_max, one.logprob_diff_mean, one.logprob_ref_diff_mean, one.probe_seconds = 0.1, 0.01, 0.5, 0.2
    two = SyncReport.of([SyncStats(PayloadKind.ADAPTER, 4, 100)], num_adapters=0)
    two.logprob_diff_max, two.logprob_diff_mean, two.logprob_ref_diff_mean, two.probe_seconds = 0.3, 0.005, 0.9, 0.4
    merged = SyncReport.merge([one, two]).metrics()
    assert merged["sync/logprob_diff_max"] == 0.3 and merged["sync/logprob_diff_mean"] == 0.01
    assert merged["sync/logprob_ref_diff_mean"] == 0.5 and merged["sync/num_adapters"] == 1
    assert "sync/weights_match" not in merged and "timing/wake" not in merged
    assert one.logprob_diff_max == 0.1  # the workers' own reports stay as they were


def test_base_names_get_base_layer_exactly_where_the_live_engine_wraps():
    """vLLM 0.26 on GPU: LoRA wrappers keep the wrapped weight under `.base_layer` and load no
    plain names; which modules are wrapped depends on the model (Qwen3's embed_tokens is, as
    the Qwen3-0.6B GPU run's level-2 resend showed; Qwen2's is not). The live names decide."""
    from lorarl.rollout.vllm.names import resolve_base_name

    live_qwen3 = frozenset(
        {
            "model.embed_tokens.base_layer.weight",
            "model.layers.0.self_attn.qkv_proj.base_layer.weight",
            "model.layers.0.mlp.gate_up_proj.base_layer.weight",
            "model.layers.0.mlp.down_proj.base_layer.weight",
        }
    )
    want = {
        "model.embed_tokens.weight": "model.embed_tokens.base_layer.weight",
        "model.layers.0.self_attn.k_proj.weight": "model.layers.0.self_attn.k_proj.base_layer.weight",
        "model.layers.0.mlp.up_proj.weight": "model.layers.0.mlp.up_proj.base_layer.weight",
        "model.layers.0.mlp.down_proj.weight": "model.layers.0.mlp.down_proj.base_layer.weight",
        # Not wrapped in this engine: plain names.
        "model.layers.0.self_attn.o_proj.weight": "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.q_norm.weight": "model.layers.0.self_attn.q_norm.weight",
        "model.norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    assert {name: resolve_base_name(name, live_qwen3) for name in want} == want
    # An engine whose wrappers load plain names themselves (vLLM 0.32) lists nothing: no renames.
    assert all(resolve_base_name(name, frozenset()) == name for name in want)


def test_expert_stacks_hold_every_expert_at_the_adapters_rank():
    """An expert stack (PEFT's ParamWrapper factors) holds r rows per expert; the payload names its
    stacks, and a stack of the wrong height or one the tensors lack is refused by name."""
    from lorarl.contract.payload import ExpertWrapper

    stem = "base_model.model.model.layers.0.mlp.experts.base_layer"
    stacks = {stem: ExpertWrapper(stem, "gate_up_proj", 4)}
    config = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    tensors = {f"{stem}.lora_A.weight": torch.zeros(8, 16), f"{stem}.lora_B.weight": torch.zeros(12, 8)}
    assert WeightPayload.adapter(tensors, config, stacks).experts == stacks
    with pytest.raises(SyncError, match=r"has 2 rows but adapter_config r=2 \(4 experts of rank r\)"):
        short = {f"{stem}.lora_A.weight": torch.zeros(2, 16), f"{stem}.lora_B.weight": torch.zeros(12, 2)}
        WeightPayload.adapter(short, config, stacks)
    other = "base_model.model.model.layers.1.mlp.experts"
    with pytest.raises(SyncError, match=f"expert stack '{other}'"):
        WeightPayload.adapter(tensors, config, {**stacks, other: ExpertWrapper(other, "down_proj", 4)})
