"""Reward for the token-share task: the share of response tokens drawn from a fixed, seeded subset of ids.

It exists to give random-weight models a learning signal. A model with real layer shapes but
random weights scores 0 on any real task, so every group's rewards are equal, the advantages
are 0 and the adapter never moves. Here a random model already scores about 1/SUBSET_SHARE and
the share differs between samples of one group. Raising it takes moving probability onto the
subset as a whole, which a small vocabulary allows; with Qwen's 152k ids the output layer must
give the subset a direction first (lorarl.data.token_share.give_subset_a_direction, which the
GPU shape models get). The subset is defined over token ids, not text: a
random-weight model with Qwen's 152k-id vocabulary and a small tokenizer mostly samples ids
the tokenizer cannot decode, so a text reward would see nearly empty strings.

Contract: the ground truth is the subset's seed (an integer); the response's token ids come in
`extra_info["response_ids"]` (lorarl.rewards.RESPONSE_IDS, which the trainer fills).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

from lorarl.errors import DataError

# One id in SUBSET_SHARE belongs to the subset, whatever the vocabulary size.
SUBSET_SHARE = 8


def parse_ground_truth(ground_truth: str) -> int:
    try:
        seed = int(str(ground_truth).strip())
    except ValueError:
        seed = -1
    if seed < 0:
        raise DataError(
            f"token_share ground_truth {ground_truth!r} is not a subset seed (an integer >= 0); "
            f"check reward_model.ground_truth in the data"
        )
    return seed


@functools.lru_cache(maxsize=1 << 20)
def in_subset(token_id: int, seed: int) -> bool:
    """Whether `token_id` is in subset `seed`: a keyed hash of the id, so membership needs no vocabulary."""
    digest = hashlib.blake2b(token_id.to_bytes(8, "little"), digest_size=8, key=seed.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little") % SUBSET_SHARE == 0


def score(token_ids: Sequence[int] | None, ground_truth: str) -> float:
    """Share of `token_ids` in the subset of seed `ground_truth`, in [0, 1]; 0 for an empty response."""
    seed = parse_ground_truth(ground_truth)
    if token_ids is None:
        raise DataError(
            "the token_share reward scores token ids: extra_info['response_ids'] is missing "
            "(the trainer passes it; a direct call must pass the response's ids there)"
        )
    if not token_ids:
        return 0.0
    return sum(in_subset(int(t), seed) for t in token_ids) / len(token_ids)
