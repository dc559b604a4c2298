"""Validation metrics from decoded responses: reward and accuracy per data source.

For every data source `S` of the validation prompts, with n = rollout.val_kwargs.n samples each:

- `val/S/reward/mean`: the training reward (configured scorer, or data.reward_fn) over all samples.
- `val/S/acc/mean@n`: the share of samples that earn the full score, averaged per prompt then over
  prompts. The unbiased mean@k equals mean@n for every k (each sample counts the same), so it is
  logged once, at k = n.
- `val/S/acc/pass@k`, k = 1, 2, 4, ... and n: the chance that at least one of k samples drawn
  without replacement from the n is right, by the unbiased estimator 1 - C(n-c, k) / C(n, k)
  (c right out of n), averaged over prompts. pass@1 equals mean@n.
- GSM8K sources also log `acc_flexible` (the configured scorer reading the last number anywhere),
  and `acc_verl` / `acc_verl_flexible` (verl's published scorer, strict and flexible), whatever the
  configured scorer is, so any run can be put beside verl's table.
- `val/acc`: `val/S/acc/mean@n` averaged over sources.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lorarl import metrics as keys
from lorarl.rewards import GSM8K_SOURCES, RESPONSE_IDS, get_reward_fn, gsm8k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from c right answers among n samples: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i), a product of terms in [0, 1) with no big numbers.
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def accuracy(scores: Sequence[Sequence[float]], source: str, scorer: str) -> dict[str, float]:
    """mean@n and pass@k (k from k_values(n)) of per-prompt sample scores, keyed as one data
    source's scorer logs them; a sample is right when it earns the full score of 1 (format-only
    credit is not)."""
    if not scores:
        raise ValueError("accuracy needs at least one prompt")
    n = len(scores[0])
    if any(len(row) != n for row in scores):
        raise ValueError(f"every prompt needs the same number of samples ({n}) for pass@k")
    right = [sum(1 for s in row if s >= 1.0) for row in scores]
    mean_n = keys.VAL_SOURCE_SCORER_MEAN_N.format(source=source, scorer=scorer, n=n)
    out = {mean_n: sum(c / n for c in right) / len(right)}
    for k in k_values(n):
        pass_k = keys.VAL_SOURCE_SCORER_PASS_K.format(source=source, scorer=scorer, k=k)
        out[pass_k] = sum(pass_at_k(n, c, k) for c in right) / len(right)
    return out


Scorer = Callable[[str, str, "dict | None"], float]


def _verl_scorer(method: str) -> Scorer:
    def fn(text: str, ground_truth: str, extra_info: dict | None = None) -> float:
        return gsm8k.score_verl(text, ground_truth, method=method)

    return fn


def _lenient_or_verl(reward: Any, method: str) -> Scorer:
    score = gsm8k.score_verl if reward.gsm8k.scoring == "verl" else gsm8k.score

    def fn(text: str, ground_truth: str, extra_info: dict | None = None) -> float:
        return score(text, ground_truth, method=method)

    return fn


def validation_metrics(
    items: Sequence[Any],
    texts: Sequence[Sequence[str]],
    reward: Any,
    custom: str | None = None,
    token_ids: Sequence[Sequence[list[int]]] | None = None,
    custom_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """All validation metrics for prompts `items` (PromptItem: data_source, ground_truth, extra_info)
    and their decoded samples `texts` (one list of n strings per item); `reward` is the config's
    reward section, `custom` data.reward_fn if any (called with `custom_kwargs`, data.reward_kwargs).
    `token_ids`, shaped as `texts`, reach the scorers under extra_info[RESPONSE_IDS], as in training."""
    if len(items) != len(texts):
        raise ValueError(f"{len(items)} prompts but {len(texts)} lists of responses")
    if token_ids is not None and [len(t) for t in token_ids] != [len(t) for t in texts]:
        raise ValueError("token_ids must hold one list of ids per response in texts")
    # Per source, per scorer name: one row of sample scores per prompt.
    table: dict[str, dict[str, list[list[float]]]] = {}
    for k, (item, samples) in enumerate(zip(items, texts)):
        ids = token_ids[k] if token_ids is not None else [None] * len(samples)
        infos = [item.extra_info if i is None else {**item.extra_info, RESPONSE_IDS: i} for i in ids]
        source = item.data_source
        scorers: dict[str, Scorer] = {"acc": get_reward_fn(source, custom, reward, custom_kwargs)}
        if source in GSM8K_SOURCES:
            scorers["acc_flexible"] = _lenient_or_verl(reward, "flexible")
            scorers["acc_verl"] = _verl_scorer("strict")
            scorers["acc_verl_flexible"] = _verl_scorer("flexible")
        rows = table.setdefault(source, {})
        for name, fn in scorers.items():
            rows.setdefault(name, []).append([float(fn(t, item.ground_truth, info)) for t, info in zip(samples, infos)])
    out: dict[str, float] = {}
    accs = []
    for source, rows in table.items():
        flat = [s for row in rows["acc"] for s in row]
        out[keys.VAL_SOURCE_REWARD_MEAN.format(source=source)] = sum(flat) / len(flat)
        for name, scores in rows.items():
            out.update(accuracy(scores, source, name))
        accs.append(out[keys.VAL_SOURCE_SCORER_MEAN_N.format(source=source, scorer="acc", n=len(rows["acc"][0]))])
    if accs:
        out[keys.VAL_ACC.key] = sum(accs) / len(accs)
    return out


__all__ = ["accuracy", "k_values", "pass_at_k", "validation_metrics"]
