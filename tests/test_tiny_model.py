"""The embedded default model: built once, cached, a normal HF directory, partly right."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lorarl.data import arith
from lorarl.models import tiny


def build_info(path: str | Path) -> dict:
    """What the builder recorded (recipe, warm-up loss and greedy accuracy, seconds)."""
    return json.loads((Path(path) / tiny.MARKER).read_text())


def test_builds_a_normal_hf_model_dir(tiny_model_path: Path, lorarl_cache: Path):
    assert tiny_model_path.parent == lorarl_cache
    names = {p.name for p in tiny_model_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", tiny.MARKER} <= names
    assert not any(n.endswith((".bin", ".pt")) for n in names)
    config = json.loads((tiny_model_path / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vLLM CPU attention
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] % 64 == 0


def test_saved_tokenizer_matches_the_trained_one(tiny_tokenizer):
    # transformers rebuilds qwen2 tokenizers with its own pre-tokenizer on load; the
    # builder trains with that same pipeline, so ids agree (they did not at first).
    trained = tiny.build_tokenizer()
    assert type(tiny_tokenizer).__name__ == "Qwen2Tokenizer"
    for text in arith.corpus() + ["What is 12 + 7?", "<|im_start|>user\nhi<|im_end|>"]:
        assert tiny_tokenizer.encode(text) == trained.encode(text), text


def test_chat_template_and_special_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    messages = [{"role": "user", "content": arith.question(3, 4)}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == f"<|im_start|>user\n{arith.question(3, 4)}<|im_end|>\n<|im_start|>assistant\n"
    ids = tiny.prompt_ids(tok, messages)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids) == text  # byte-level BPE round-trips exactly
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id


def test_second_call_reuses_the_cache(tiny_model_path: Path):
    marker = tiny_model_path / tiny.MARKER
    before = marker.stat().st_mtime_ns
    start = time.perf_counter()
    again = tiny.ensure_tiny_model(tiny_model_path)
    assert again == tiny_model_path
    assert time.perf_counter() - start < 1.0
    assert marker.stat().st_mtime_ns == before


def test_changed_recipe_rebuilds(tmp_path: Path):
    path = tmp_path / "m"
    tiny.ensure_tiny_model(path, seed=0, warmup_steps=0)
    assert build_info(path)["warmup_steps"] == 0
    # A marker from an older builder version is not trusted either.
    info = build_info(path)
    (path / tiny.MARKER).write_text(json.dumps({**info, "builder_version": -1}))
    tiny.ensure_tiny_model(path, seed=0, warmup_steps=0)
    assert build_info(path)["builder_version"] == tiny.BUILDER_VERSION
    tiny.ensure_tiny_model(path, seed=0, warmup_steps=2)
    assert build_info(path)["warmup_steps"] == 2
    assert not list(tmp_path.glob(".m.tmp-*"))  # no build left half-way


def test_never_replaces_a_folder_it_did_not_build(tmp_path: Path):
    from lorarl.errors import ModelError

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ModelError, match="not a lorarl tiny model"):
        tiny.ensure_tiny_model(mine, warmup_steps=0)
    assert (mine / "notes.txt").read_text() == "keep me"


def test_concurrent_builders_share_one_result(tmp_path: Path):
    path = tmp_path / "shared"
    script = textwrap.dedent(
        f"""
        import json
        from pathlib import Path
        from lorarl.models.tiny import MARKER, ensure_tiny_model
        p = ensure_tiny_model({str(path)!r}, seed=3, warmup_steps=0)
        print(json.dumps(json.loads((Path(p) / MARKER).read_text())))
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (_out, err) in zip(procs, results):
        assert proc.returncode == 0, err[-2000:]
    infos = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    # The second process waited on the lock and reused the first one's model.
    assert infos[0] == infos[1]
    assert not list(tmp_path.glob(".shared.tmp-*"))


@pytest.fixture(scope="module")
def hf_model(tiny_model_path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


def seen_rows() -> list[dict]:
    return [arith.row(a, b, "train", i) for i, (a, b) in enumerate(arith.pairs("warmup"))]


def test_warmup_makes_the_policy_partly_right(hf_model, tiny_tokenizer, tiny_model_path: Path):
    # Measured for 60 warm-up steps (seed 0, greedy): 17% of the 60 pairs the warm-up saw, 15% of
    # the 40 held-out ones (each the mirror of a seen pair). GRPO needs groups neither all right nor
    # all wrong, and room above the start: the default run takes the held-out pairs to 0.425-0.525.
    acc = tiny.greedy_accuracy(hf_model, tiny_tokenizer, seen_rows())
    held_out = tiny.greedy_accuracy(hf_model, tiny_tokenizer, arith.held_out_rows())
    assert 0.1 <= acc <= 0.7, acc
    assert 0.05 <= held_out <= 0.3, held_out
    info = build_info(tiny_model_path)
    assert info["greedy_accuracy_warmup_pairs"] == pytest.approx(acc, abs=0.03)
    assert info["greedy_accuracy_held_out"] == pytest.approx(held_out, abs=0.03)


def test_without_warmup_the_model_is_not_right(tmp_path: Path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    path = tiny.ensure_tiny_model(tmp_path / "cold", seed=0, warmup_steps=0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    acc = tiny.greedy_accuracy(model, tiny_tokenizer, arith.make_rows(100, seed=0, split="test"))
    assert acc < 0.1


def test_weights_are_safetensors_in_float32(tiny_model_path: Path):
    from safetensors import safe_open

    with safe_open(str(tiny_model_path / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert "model.embed_tokens.weight" in keys
        assert all(f.get_tensor(k).dtype == torch.float32 for k in keys)


# ---------------------------------------------------------------------------------------------
# the embedded Qwen3 (model=qwen3_tiny)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_path(lorarl_cache: Path) -> Path:
    return tiny.ensure_tiny_model(tiny.default_tiny_model_path(arch="qwen3"), arch="qwen3")


def test_qwen3_is_a_real_qwen3_layout(qwen3_path: Path, tiny_model_path: Path):
    from safetensors import safe_open

    config = json.loads((qwen3_path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["head_dim"] == 64 and config["attention_bias"] is False
    assert build_info(qwen3_path)["arch"] == "qwen3"
    with safe_open(str(qwen3_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.q_norm.weight").shape == (64,)  # per head
        assert all(f.get_tensor(k).dtype == torch.float32 for k in keys)
    assert {f"model.layers.{i}.self_attn.{n}_norm.weight" for i in (0, 1) for n in "qk"} <= keys
    assert not any(k.endswith("_proj.bias") for k in keys)
    # Same tokenizer as the Qwen2 one: prompts and rewards mean the same on both.
    assert (qwen3_path / "tokenizer.json").read_text() == (tiny_model_path / "tokenizer.json").read_text()


def test_qwen3_warmup_makes_the_policy_partly_right(qwen3_path: Path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen3_path).eval()
    acc = tiny.greedy_accuracy(model, tiny_tokenizer, seen_rows())
    assert 0.2 <= acc <= 0.8, acc
    assert build_info(qwen3_path)["greedy_accuracy_warmup_pairs"] == pytest.approx(acc, abs=0.03)


def test_qwen3_qk_norms_are_refused_as_lora_targets(qwen3_path: Path):
    """FSDP/PEFT side of "q_norm/k_norm are base weights": the preflight names the module type."""
    from transformers import AutoConfig

    from lorarl.driver.preflight import check_lora_targets
    from lorarl.errors import ModelError

    cfg = AutoConfig.from_pretrained(qwen3_path)
    check_lora_targets(str(qwen3_path), cfg, ["q_proj", "k_proj", "v_proj", "o_proj"])
    with pytest.raises(ModelError, match=r"'q_norm' names Qwen3RMSNorm modules, not linear layers"):
        check_lora_targets(str(qwen3_path), cfg, ["q_proj", "q_norm"])


def test_builder_names_are_checked(tmp_path: Path):
    from lorarl.errors import ModelError

    # model.builder itself is checked by the config (tests/test_config.py).
    with pytest.raises(ModelError, match="no embedded 'llama' model"):
        tiny.ensure_tiny_model(tmp_path / "m", arch="llama")
    assert not (tmp_path / "m").exists()


def test_a_cached_model_of_the_other_arch_is_rebuilt(tmp_path: Path):
    path = tmp_path / "m"
    tiny.ensure_tiny_model(path, warmup_steps=0, arch="qwen2")
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen2"
    tiny.ensure_tiny_model(path, warmup_steps=0, arch="qwen3")
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3"
    assert build_info(path)["arch"] == "qwen3"
