"""The token-share task's prompts: seeded strings of random words, scored by lorarl.rewards.token_share.

What a response says does not matter, only which token ids it is made of, so the prompts only
need to differ from each other; every row asks for the same subset (SUBSET_SEED), so the one
adapter has one thing to learn. Rows follow verl's parquet schema, as the arithmetic task's do.
"""

from __future__ import annotations

import os
import random
import string
from pathlib import Path

DATA_SOURCE = "token_share"
# Bump when the prompts change: the data folder carries it, so stale parquet is never reused.
TASK_VERSION = 1
SUBSET_SEED = 0
N_VAL = 32
WORDS_PER_PROMPT = 4


def row(words: list[str], split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": "Continue: " + " ".join(words)}],
        "ability": "synthetic",
        "reward_model": {"style": "rule", "ground_truth": str(SUBSET_SEED)},
        "extra_info": {"split": split, "index": index},
    }


def make_rows(n: int, seed: int, split: str) -> list[dict]:
    """`n` prompts of WORDS_PER_PROMPT random lowercase words (3-6 letters), drawn with `seed`."""
    rng = random.Random(f"token_share-{seed}-{split}")
    rows = []
    for i in range(n):
        words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6))) for _ in range(WORDS_PER_PROMPT)]
        rows.append(row(words, split, i))
    return rows


def ensure_parquet(
    train_path: str | os.PathLike, val_path: str | os.PathLike, n_train: int, seed: int
) -> tuple[str, str]:
    """Write the task's parquet at the configured paths if missing: `n_train` training prompts and
    N_VAL validation prompts (other draws of the same kind)."""
    from lorarl.data.dataset import write_parquet

    train = Path(os.path.expanduser(str(train_path)))
    val = Path(os.path.expanduser(str(val_path)))
    if not train.is_file():
        write_parquet(make_rows(n_train, seed, "train"), train)
    if not val.is_file():
        write_parquet(make_rows(N_VAL, seed, "test"), val)
    return str(train), str(val)
