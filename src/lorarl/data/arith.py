"""The embedded synthetic task: single-digit additions with exact answers.

Rows follow verl's GSM8K parquet schema so the same loader, reward registry and
validation code serve both this task and real data sets.

The 100 problems a + b (a, b in 0..9) are split once, with a fixed seed, into 40 held-out
problems and the 60 others. A held-out problem is a + b with a != b whose mirror b + a is not
held out: the tiny model's supervised warm-up and GRPO see only the 60 others, and validation
asks each held-out problem once. No validation prompt is ever trained on; what validation
measures is whether what GRPO teaches on b + a carries over to the unseen a + b.
"""

from __future__ import annotations

import random

DATA_SOURCE = "arith"
INSTRUCTION = "Answer with the number only."
# Bump when the split or the pools below change: the data folder carries it, so stale parquet is never reused.
TASK_VERSION = 3
N_HELD_OUT = 40
HELD_OUT_SEED = "mirror"
POOLS = ("all", "warmup", "train", "heldout")


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}? {INSTRUCTION}"


def pairs(pool: str = "all", max_operand: int = 9) -> list[tuple[int, int]]:
    """The (a, b) pairs of one pool: all of them, the warm-up's, GRPO's training pairs (the same
    pairs: every one that is not held out), or the held-out ones (disjoint from both)."""
    if pool not in POOLS:
        raise ValueError(f"pool={pool!r} is unknown; use one of {', '.join(POOLS)}")
    every = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if pool == "all":
        return every
    held = _held_out(max_operand)
    return [p for p in every if (p in held) == (pool == "heldout")]


def _held_out(max_operand: int) -> set[tuple[int, int]]:
    """N_HELD_OUT unordered pairs {a, b}, a != b, each held out in one order picked at random."""
    rng = random.Random(HELD_OUT_SEED)
    unordered = [(a, b) for a in range(max_operand + 1) for b in range(a + 1, max_operand + 1)]
    rng.shuffle(unordered)
    return {(a, b) if rng.random() < 0.5 else (b, a) for a, b in unordered[:N_HELD_OUT]}


def row(a: int, b: int, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question(a, b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "answer": str(a + b)},
    }


def make_rows(n: int, seed: int, split: str, max_operand: int = 9, pool: str = "all") -> list[dict]:
    """`n` addition problems drawn with `seed` from `pool` (operands in [0, max_operand])."""
    rng = random.Random(f"{seed}-{split}")
    if pool == "all":
        # Kept as first written, so every caller drawing from all pairs sees the same rows as before.
        draws = [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(n)]
    else:
        choices = pairs(pool, max_operand)
        draws = [choices[rng.randrange(len(choices))] for _ in range(n)]
    return [row(a, b, split, i) for i, (a, b) in enumerate(draws)]


def held_out_rows(max_operand: int = 9) -> list[dict]:
    """Each held-out pair once: the validation set."""
    return [row(a, b, "test", i) for i, (a, b) in enumerate(pairs("heldout", max_operand))]


def corpus(max_operand: int = 9) -> list[str]:
    """Every question and answer of the task: the text a tiny tokenizer is trained on."""
    texts = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            texts.append(question(a, b))
            texts.append(str(a + b))
    return texts
