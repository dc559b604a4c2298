"""What crosses the Ray boundary between the driver (lorarl.trainer) and the workers.

One dataclass per call, so the driver's fields and the worker's reads are checked by name, not
by position. A request carries the values the worker and its engine need (temperature, n,
lengths, seed), so they never read them from the run config behind the trainer's back.
Metrics come back as flat `{"group/name": float}` dicts, as the trackers log them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenerateRequest:
    """Sample `n` responses to each prompt on one vLLM engine (every worker of it gets the same)."""

    prompt_ids: list[list[int]]
    n: int
    temperature: float
    top_p: float
    max_tokens: int
    seed: int
    # Training rollouts: the first one a worker sees sets the sync probe's sequences (lorarl.sync_session).
    for_training: bool


@dataclass
class Rollouts:
    """Per prompt, the n sampled responses and the sampler's log-prob of each of their tokens."""

    token_ids: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    seconds: float


@dataclass(frozen=True)
class Sampling:
    """How a step's samples were drawn, as the update reads it: a mini-batch is
    actor.ppo_mini_batch_size prompts x `n` sequences, log-probs are taken at `temperature`,
    seq-mean-token-sum-norm divides by `max_response_length`, and the mini-batch shuffle is
    seeded by `seed` and the step."""

    n: int
    temperature: float
    max_response_length: int
    seed: int


@dataclass(frozen=True)
class UpdateRequest:
    """One data-parallel replica's share of a step's samples."""

    step: int
    prompt_ids: list[list[int]]  # one per sequence (a prompt repeats for each of its n samples)
    response_ids: list[list[int]]
    advantages: list[float]
    rollout_logprobs: list[list[float]] | None
    sampling: Sampling


@dataclass(frozen=True)
class SyncRequest:
    """Bring every rollout up to date after the update of `step` (0: before training starts)."""

    step: int
    last: bool
