"""The embedded synthetic task: single-digit additions with exact answers.

Rows follow verl's GSM8K parquet schema so the same loader, reward registry and
validation code serve both this task and real data sets.
"""

from __future__ import annotations

import random

DATA_SOURCE = "arith"
INSTRUCTION = "Answer with the number only."


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}? {INSTRUCTION}"


def make_rows(n: int, seed: int, split: str, max_operand: int = 9) -> list[dict]:
    """`n` addition problems drawn with `seed`; operands in [0, max_operand]."""
    rng = random.Random(f"{seed}-{split}")
    rows = []
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": question(a, b)}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": i, "answer": str(a + b)},
            }
        )
    return rows


def corpus(max_operand: int = 9) -> list[str]:
    """Every question and answer of the task: the text a tiny tokenizer is trained on."""
    texts = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            texts.append(question(a, b))
            texts.append(str(a + b))
    return texts
