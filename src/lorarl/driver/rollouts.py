"""A step's prompts as vLLM requests, and the samples that come back as scored GRPO groups.

Prompts are split contiguously over the rollout engines, so the n samples of a prompt, and
therefore its GRPO group, stay on one engine. Where a sweep's group trains several adapters, each
engine gets every job's share in one request, each prompt naming its job's adapter (its vLLM LoRA
slot) and that job's temperature and top_p; what comes back is split per job again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lorarl.algorithms import advantages
from lorarl.contract.messages import GenerateRequest, Rollouts


def sampling_seed(seed: int, step: int, shard: int, round_index: int = 0) -> int:
    """The rollout seed of one data-parallel shard at one step (and generation round, for
    dynamic sampling): distinct across all of them (seed + step + shard collided: shard 1 of
    step s drew what shard 0 drew at step s + 1)."""
    import numpy as np

    entropy = [seed, step, shard] + ([round_index] if round_index else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


@dataclass
class PromptGroup:
    """One prompt's rollout.n samples (its GRPO group): token ids, the sampler's log-probs, rewards
    (the reward function's scores plus the overlong penalties)."""

    item: Any
    samples: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[float]
    scores: list[float] | None = None  # the reward function's values; None: the rewards
    overlong: list[float] | None = None  # DAPO's overlong penalty per sample (0 when off)

    def has_signal(self, metric: str = "seq_final_reward") -> bool:
        """Whether the samples differ in `metric` (algorithm.filter_groups.metric, verl's names):
        acc / score read the reward function's values, seq_reward / seq_final_reward the rewards
        (no KL is ever in the reward here, so the two agree, as do acc and score)."""
        values = self.scores if metric in ("acc", "score") and self.scores is not None else self.rewards
        return max(values) != min(values)


def split(items: list, parts: int) -> list[list]:
    """`items` in `parts` contiguous runs, the first ones one longer where they do not divide."""
    size = len(items) // parts
    extra = len(items) % parts
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


@dataclass(frozen=True)
class Draw:
    """How one job's prompts are sampled: its adapter (LoRA slot), n, temperature and top_p."""

    adapter: int
    n: int
    temperature: float
    top_p: float


def requests_for(
    prompts: dict[int, list], draws: dict[int, Draw], engines: int, max_tokens: int, seed_of, for_training: bool
) -> tuple[list[list[tuple[int, list]]], list[GenerateRequest]]:
    """Each engine's share of every job's prompts (engine -> [(job, its prompts there)]) and the
    engine's request. `prompts` and `draws` are keyed by job; `seed_of(engine)` is its seed. With
    one job the request is a run's plain request (no per-prompt adapter)."""
    shares = [[(job, split(p, engines)[e]) for job, p in prompts.items()] for e in range(engines)]
    requests = []
    for e, share in enumerate(shares):
        rows = [(job, item) for job, items in share for item in items]
        first = draws[share[0][0]]
        several = len(prompts) > 1
        requests.append(
            GenerateRequest(
                prompt_ids=[item.prompt_ids for _, item in rows],
                n=first.n,
                temperature=first.temperature,
                top_p=first.top_p,
                max_tokens=max_tokens,
                seed=seed_of(e),
                for_training=for_training,
                adapters=[draws[job].adapter for job, _ in rows] if several else None,
                temperatures=[draws[job].temperature for job, _ in rows] if several else None,
                top_ps=[draws[job].top_p for job, _ in rows] if several else None,
            )
        )
    return shares, requests


def per_job(shares: list[list[tuple[int, list]]], gen: list[Rollouts]) -> dict[int, list[tuple[Any, list, list]]]:
    """What came back, per job in its prompts' order: (prompt item, samples, their log-probs)."""
    out: dict[int, list] = {}
    for share, rollouts in zip(shares, gen, strict=True):
        at = 0
        for job, items in share:
            for item in items:
                out.setdefault(job, []).append((item, rollouts.token_ids[at], rollouts.logprobs[at]))
                at += 1
    return out


def score_groups(run, rows: list[tuple[Any, list, list]], score) -> list[PromptGroup]:
    """Each prompt's samples scored by `score(item, response_ids)`, with DAPO's overlong penalty
    when `run` turns it on."""
    d, ob = run.data, run.algorithm.overlong_buffer
    buffer = (ob.len or max(1, d.max_response_length // 5)) if ob.enable else 0
    groups = []
    for item, samples, lps in rows:
        scores = [score(item, s) for s in samples]
        overlong = [
            advantages.overlong_penalty(len(s), d.max_response_length, buffer, ob.penalty_factor) if buffer else 0.0
            for s in samples
        ]
        rewards = [x + p for x, p in zip(scores, overlong)]
        groups.append(PromptGroup(item, samples, lps, rewards, scores, overlong))
    return groups
