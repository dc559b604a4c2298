"""The metrics page is generated from lorarl.metrics.METRICS, and every key a run logs is in it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorarl.metrics import METRICS, checked, describe, markdown

ROOT = Path(__file__).resolve().parents[1]
HOW_TO_ADD = (
    "define NAME = M(key, meaning, unit, side, when=...) for each in src/lorarl/metrics.py, "
    "then run: python -m lorarl.metrics > docs/metrics.md"
)


def undescribed(keys) -> list[str]:
    """The keys the metrics page does not describe."""
    return sorted({k for k in keys if describe(k) is None})


def logged_keys(path: Path) -> set[str]:
    return {k for line in path.read_text().splitlines() for k in json.loads(line)}


def assert_described(keys: set[str], where: str) -> None:
    missing = undescribed(keys)
    assert not missing, f"{where} logs {missing}, which the metrics page does not describe: {HOW_TO_ADD}"


def unlogged(keys: set[str]) -> list[str]:
    """The list's entries without a condition (`when`) that none of `keys` belongs to."""
    matched = {describe(k).key for k in keys if describe(k) is not None}
    return sorted(m.key for m in METRICS if not m.when and m.key not in matched and f"init/{m.key}" not in matched)


def assert_list_logged(keys: set[str], where: str) -> None:
    """Every entry of the list is logged by `where`, or says the condition it needs (`when`)."""
    missing = unlogged(keys)
    assert not missing, (
        f"{where} does not log {missing}: give each its condition (Metric.when) in src/lorarl/metrics.py"
    )


def test_metrics_page_is_generated_from_the_list():
    page = (ROOT / "docs" / "metrics.md").read_text()
    assert page == markdown(), "docs/metrics.md is stale: run python -m lorarl.metrics > docs/metrics.md"
    assert len({m.key for m in METRICS}) == len(METRICS), "METRICS lists a key twice"


@pytest.mark.parametrize(
    "key, family",
    [
        ("val/openai/gsm8k/acc_verl/pass@4", "val/{source}/{scorer}/pass@{k}"),
        ("val/arith/acc/mean@1", "val/{source}/{scorer}/mean@{n}"),
        ("init/sync/bytes", "sync/bytes"),
        ("init/timing/wake", "timing/wake"),
        ("init/num_nodes", "init/num_nodes"),
    ],
)
def test_families_and_the_first_sync_prefix(key, family):
    assert describe(key).key == family


def test_unknown_keys_are_reported():
    assert undescribed(["reward/mean", "reward/median", "sync/nonsense"]) == ["reward/median", "sync/nonsense"]


def test_a_key_outside_the_list_cannot_be_logged():
    """The update and the trainer pass every key through `checked` (a loss's own actor/* names,
    the rollout correction's); one the list lacks is refused, naming it."""
    assert checked("actor/pg_loss") == "actor/pg_loss" and checked("init/sync/bytes") == "init/sync/bytes"
    with pytest.raises(KeyError, match="actor/pg_loss_typo"):
        checked("actor/pg_loss_typo")


def test_an_entry_nobody_logs_is_found():
    """The check the default run's keys go through (test_grpo_e2e): an unconditional entry that
    no key belongs to is named; a conditional one is not."""
    logged = {m.key for m in METRICS if not m.when and "{" not in m.key}
    families = {"val/arith/reward/mean", "val/arith/acc/mean@1", "val/arith/acc/pass@1"}
    assert unlogged(logged | families) == []
    assert unlogged((logged | families) - {"sync/bytes"}) == ["sync/bytes"]


def test_keys_of_the_recorded_gpu_runs_are_described():
    """The GPU recipe runs (FSDP and Megatron on 2 GPUs) log memory/* and timing/wake, which CPU runs do not."""
    logs = sorted((ROOT / "tests" / "gpu_logs").rglob("metrics.jsonl"))
    assert logs, "no recorded GPU metrics.jsonl under tests/gpu_logs"
    for log in logs:
        assert_described(logged_keys(log), str(log.relative_to(ROOT)))
