"""The embedded synthetic task: single-digit additions with exact answers.

Rows follow verl's GSM8K parquet schema so the same loader, reward registry and
validation code serve both this task and real data sets.

The 100 problems a + b (a, b in 0..9) are split once, with a fixed seed, into the pairs the
tiny model's supervised warm-up sees and held-out pairs it never sees. GRPO trains on all
100; validation asks each held-out pair once, so what it measures is what RL taught, not
what the warm-up already knew.
"""

from __future__ import annotations

import random

DATA_SOURCE = "arith"
INSTRUCTION = "Answer with the number only."
# Bump when the split or the pools below change: the data folder carries it, so stale parquet is never reused.
TASK_VERSION = 2
N_HELD_OUT = 40
POOLS = ("all", "warmup", "heldout")


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}? {INSTRUCTION}"


def pairs(pool: str = "all", max_operand: int = 9) -> list[tuple[int, int]]:
    """The (a, b) pairs of one pool: all of them, the warm-up's, or the held-out ones (disjoint)."""
    if pool not in POOLS:
        raise ValueError(f"pool={pool!r} is unknown; use one of {', '.join(POOLS)}")
    every = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if pool == "all":
        return every
    shuffled = every[:]
    random.Random("arith-heldout").shuffle(shuffled)
    held = set(shuffled[:N_HELD_OUT])
    return [p for p in every if (p in held) == (pool == "heldout")]


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
