"""The token-share task's prompts: seeded strings of random words, scored by lorarl.rewards.token_share.

What a response says does not matter, only which token ids it is made of, so the prompts only
need to differ from each other; every row asks for the same subset (SUBSET_SEED), so the one
adapter has one thing to learn. Rows follow verl's parquet schema, as the arithmetic task's do.
`give_subset_a_direction` readies a random-weight model with a full-size vocabulary for the task.
"""

from __future__ import annotations

import os
import random
import string
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

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


def give_subset_a_direction(output_embedding: torch.Tensor, seed: int = SUBSET_SEED, strength: float = 1.0) -> None:
    """Add one shared vector to the output-embedding rows of subset `seed`'s ids, in place: a
    seeded unit direction times `strength` x the rows' mean norm.

    Why: in a random output layer with Qwen's 152k ids, the subset's 19k rows share no direction,
    so no change of the last hidden state moves probability onto the subset as a whole, and the
    reward stays at 1/8 however far the adapter moves. Measured on CPU (random Qwen2, 4 layers,
    hidden 256, vocabulary 151936, 8 prompts x 8 x 32 tokens, lr 1e-3, 16 steps): 0.12 -> 0.11
    without it, 0.13 -> 0.95 with it; on one H100 the 7B and 30B-A3B shapes without it stayed at
    0.125 over 20 and 14 steps while their adapters moved log-probs by 1.4 and 1.0 nats
    (tests/gpu_logs). A trained model's token classes have such directions; a random one is given
    one. The hidden state's projection on the direction starts random, so the step-1 reward stays
    near 1/8 (0.13 in that run)."""
    import torch

    from lorarl.rewards.token_share import in_subset

    rows, width = output_embedding.shape
    direction = torch.randn(width, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    direction /= direction.norm()
    ids = torch.tensor([i for i in range(rows) if in_subset(i, seed)], device=output_embedding.device)
    with torch.no_grad():
        scale = torch.linalg.vector_norm(output_embedding, dim=1, dtype=torch.float32).mean()
        output_embedding[ids] += (strength * scale * direction.to(scale.device)).to(output_embedding.dtype)
