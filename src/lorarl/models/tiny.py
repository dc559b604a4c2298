"""The embedded models: a tiny Qwen2 (the default) or Qwen3 with a tokenizer trained on the task text.

A fresh machine has no weights and no network, so the default run builds its own
model. A random model almost never earns a reward and GRPO learns nothing from
all-zero groups, so the builder warms the model up with a few seconds of supervised
steps until it is sometimes right, like an instruct model at the start of RL.

Both architectures share the tokenizer, sizes and warm-up; the Qwen3 one differs the way
the real families do (per-head RMSNorm on queries and keys, `q_norm`/`k_norm`, and no
q/k/v bias), so everything downstream of the builder meets a real Qwen3 layout.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from lorarl.config.schema import MODEL_BUILDERS, cache_dir
from lorarl.data import arith
from lorarl.errors import ModelError

# Bump when anything below changes what gets built: a cached model with another
# version is rebuilt rather than silently reused.
BUILDER_VERSION = 3
MARKER = "lorarl_tiny_model.json"

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Qwen's chat layout without the default system turn: prompts stay short.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, LAYERS = 256, 4, 2, 512, 2
MAX_POSITIONS = 512
BPE_VOCAB = 512
WARMUP_BATCH = 32
# Measured on seeds 0-2 (greedy, tokenizer as reloaded from disk): without LR warm-up and
# clipping AdamW stalled at loss ~1.4 on some seeds. The warm-up sees only the 60 pairs of the
# task that are not held out (lorarl.data.arith). With 100 steps GRPO started at reward 0.47 and
# plateaued near 0.6 within 20 steps (little left to learn); after 60 it climbs for the whole
# default run, so 60 is the default. At 60 steps (seed 0) greedy accuracy is 17% on the warm-up
# pairs and 15% on the held-out ones, whose mirrors the warm-up saw.
WARMUP_LR = 1e-3
WARMUP_LR_RAMP = 20
WARMUP_CLIP = 1.0
DEFAULT_WARMUP_STEPS = 60


# model.builder value -> architecture built by it (the config checks the name).
ARCHS = MODEL_BUILDERS

# The MoE one (Qwen3-30B-A3B's layout in small): every layer sparse, top-2 of 8 experts with the
# routing weights renormalised (norm_topk_prob), each expert as wide as a quarter of the dense MLP
# so the active width per token (2 x 128) is half the dense tiny model's, as 30B-A3B's 8 x 768 is
# well under a dense model's MLP.
EXPERTS, EXPERTS_PER_TOKEN, EXPERT_INTERMEDIATE = 8, 2, 128


def default_tiny_model_path(seed: int = 0, warmup_steps: int = DEFAULT_WARMUP_STEPS, arch: str = "qwen2") -> Path:
    return Path(cache_dir()) / f"tiny-{arch}-v{BUILDER_VERSION}-s{seed}-w{warmup_steps}"


def ensure_tiny_model(
    path: str | Path, seed: int = 0, warmup_steps: int = DEFAULT_WARMUP_STEPS, arch: str = "qwen2"
) -> Path:
    """Return `path` holding the tiny `arch` model (qwen2 | qwen3 | qwen3_moe), building it first unless a
    complete one with the same recipe is there."""
    if arch not in ARCHS.values():
        raise ModelError(f"no embedded {arch!r} model; the builder makes {', '.join(ARCHS.values())}")
    path = Path(path).expanduser().absolute()
    recipe = _recipe(seed, warmup_steps, arch)
    if _is_complete(path, recipe):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(path.parent / f".{path.name}.lock"):
        # Another process may have finished the build while this one waited.
        if _is_complete(path, recipe):
            return path
        if path.exists() and not (path / MARKER).is_file() and any(path.iterdir()):
            # Only ever replace what this builder made: never delete a user's folder.
            raise ModelError(f"{path} exists and is not a lorarl tiny model; point the model path at a new folder")
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the model is meant to be shared
        try:
            info = _build(tmp, seed, warmup_steps, arch)
            (tmp / MARKER).write_text(json.dumps({**recipe, **info}, indent=2))
            if path.exists():
                shutil.rmtree(path)  # a tiny model from another recipe or builder version
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def ensure_built(builder: str, path: str | Path, seed: int = 0) -> Path:
    """Build the embedded model `model.builder` names at `path` unless it is there already."""
    return ensure_tiny_model(path, seed=seed, arch=ARCHS[builder])


def _recipe(seed: int, warmup_steps: int, arch: str) -> dict:
    return {"builder_version": BUILDER_VERSION, "arch": arch, "seed": seed, "warmup_steps": warmup_steps}


def _is_complete(path: Path, recipe: dict) -> bool:
    from lorarl.files.jsonio import read_json_if_valid

    info = read_json_if_valid(path / MARKER)
    return info is not None and all(info.get(k) == v for k, v in recipe.items())


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# Qwen2's pre-tokenizer (transformers' Qwen2Tokenizer): digits split one by one.
# transformers >= 5 rebuilds any model_type=qwen2 tokenizer with this pipeline on
# load, so training with anything else would give merges that never apply after
# save + reload (seen: a model 44% right in memory, 9% right after reloading).
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def build_tokenizer(seed_texts: list[str] | None = None):
    """Byte-level BPE trained on the task text with Qwen2's pipeline, as a HF fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = list(seed_texts) if seed_texts is not None else arith.corpus()
    # Chat scaffolding so role names and newlines get their own merges.
    texts += [f"{IM_START}user\n{t}{IM_END}\n{IM_START}assistant\n" for t in texts[:20]]
    texts += ["user", "assistant", "system", "\n"]

    tok = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix=""))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def build_config(tokenizer, arch: str = "qwen2"):
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    vocab = -(-len(tokenizer) // 64) * 64
    # Qwen3Config defaults already match the family: attention_bias=False, q_norm/k_norm built in.
    config_cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[arch]
    moe = (
        {
            "num_experts": EXPERTS,
            "num_experts_per_tok": EXPERTS_PER_TOKEN,
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
        }
        if arch == "qwen3_moe"
        else {}
    )
    return config_cls(
        **moe,
        vocab_size=vocab,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS,  # 64: vLLM's CPU attention rejects smaller heads
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def _warmup_batches(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(tokens, loss mask) per row: chat prompt, then answer + <|im_end|> with loss on."""
    out = []
    for row in rows:
        p = prompt_ids(tokenizer, row["prompt"])
        a = tokenizer.encode(row["reward_model"]["ground_truth"], add_special_tokens=False)
        a.append(tokenizer.eos_token_id)
        out.append((p + a, [0] * len(p) + [1] * len(a)))
    return out


def _warmup(model, tokenizer, seed: int, steps: int) -> float:
    rows = arith.make_rows(steps * WARMUP_BATCH, seed=seed, split="train", pool="warmup")
    samples = _warmup_batches(tokenizer, rows)
    opt = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP_LR_RAMP))
    model.train()
    loss_val = float("nan")
    for step in range(steps):
        batch = samples[step * WARMUP_BATCH : (step + 1) * WARMUP_BATCH]
        width = max(len(t) for t, _ in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        for i, (toks, lmask) in enumerate(batch):
            n = len(toks)
            ids[i, :n] = torch.tensor(toks)
            mask[i, :n] = 1
            labels[i, :n] = torch.where(torch.tensor(lmask) == 1, torch.tensor(toks), -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), WARMUP_CLIP)
        opt.step()
        sched.step()
        loss_val = loss.item()
    model.eval()
    return loss_val


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int = 4) -> float:
    """Share of rows whose greedy answer (special tokens dropped, stripped) is exact."""
    prompts = [prompt_ids(tokenizer, r["prompt"]) for r in rows]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
    )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    right = sum(t.strip() == r["reward_model"]["ground_truth"] for t, r in zip(texts, rows))
    return right / len(rows)


def _build(out_dir: Path, seed: int, warmup_steps: int, arch: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    start = time.perf_counter()
    build_tokenizer().save_pretrained(out_dir)
    # Train and measure with the tokenizer every consumer will load, not the in-memory one.
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    config = build_config(tokenizer, arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    loss = _warmup(model, tokenizer, seed, warmup_steps) if warmup_steps > 0 else float("nan")
    train_s = time.perf_counter() - start
    seen = [arith.row(a, b, "train", i) for i, (a, b) in enumerate(arith.pairs("warmup"))]
    acc_seen = greedy_accuracy(model, tokenizer, seen)
    acc_held_out = greedy_accuracy(model, tokenizer, arith.held_out_rows())
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=config.bos_token_id,
    )
    model.save_pretrained(out_dir)
    return {
        "warmup_final_loss": round(loss, 4),
        "greedy_accuracy_warmup_pairs": acc_seen,
        "greedy_accuracy_held_out": acc_held_out,
        "build_seconds": round(time.perf_counter() - start, 2),
        "warmup_seconds": round(train_s, 2),
    }
