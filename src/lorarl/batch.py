"""Padded training tensors built from (prompt, response) token lists.

Sequences are prompt + response, right-padded. Position t of the `[B, L-1]` tensors is the
log-prob of token t+1, so `response_mask` marks exactly the positions that predict a
response token; prompts and padding never enter a loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1] float
    advantages: torch.Tensor | None = None  # [B]
    old_logp: torch.Tensor | None = None  # [B, L-1]
    ref_logp: torch.Tensor | None = None  # [B, L-1]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: slice | torch.Tensor) -> TrainBatch:
        return TrainBatch(
            **{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[idx]) for f in fields(self)}
        )

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(
            **{
                f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
                for f in fields(self)
            }
        )

    def chunks(self, size: int) -> Iterator[TrainBatch]:
        for start in range(0, len(self), size):
            yield self.select(slice(start, start + size))


def build_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    advantages: list[float] | None = None,
) -> TrainBatch:
    assert len(prompts) == len(responses), "one response per prompt copy"
    seqs = [p + r for p, r in zip(prompts, responses)]
    length = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), length), dtype=torch.long)
    response_mask = torch.zeros((len(seqs), length - 1), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        n = len(p) + len(r)
        input_ids[i, :n] = torch.tensor(p + r, dtype=torch.long)
        attention_mask[i, :n] = 1
        # logits at position t predict token t+1: response tokens sit at len(p)..n-1.
        response_mask[i, len(p) - 1 : n - 1] = 1.0
    adv = None if advantages is None else torch.tensor(advantages, dtype=torch.float32)
    return TrainBatch(input_ids, attention_mask, response_mask, advantages=adv)
