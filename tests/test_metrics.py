"""The metrics page is generated from lorarl.metrics.METRICS, and every key a run logs is in it."""

from __future__ import annotations

import ast
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


# ---- keys are written and read only as lorarl.metrics' constants -------------------------------

GROUPS = {m.key.split("/")[0] for m in METRICS if "/" in m.key}  # actor, data, init, memory, ...


def metric_shaped(text: str) -> bool:
    """Whether a string of code (an f-string's fields as `{}`) spells a logged key: a key of the
    list or a member of a family (`sync/bytes`, `val/{}/acc/mean@{}`), a first-sync key without its
    `init/` (`timing/prepare`), or a key built from a group's prefix (`actor/{}`, `val/`,
    `init/timing/`). A path or a config group that only begins like one (`reward/default`,
    `rollout/vllm/engine.py`) is not."""
    text = text.strip("\"'")
    group, slash, rest = text.partition("/")
    if not slash or group not in GROUPS or any(c.isspace() for c in text):
        return False
    filled = text.replace("{}", "x")
    return (
        describe(filled) is not None
        or describe(f"init/{filled}") is not None
        or rest.startswith("{}")
        or text.endswith("/")
    )


def strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant and f-string of a module."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            out.append((node.lineno, text))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.lineno, node.value))
    return out


def literal_keys(source: str) -> list[str]:
    return sorted({text for _, text in strings(source) if metric_shaped(text)})


def test_no_metric_key_is_a_literal_outside_the_list():
    """Writers (the trainer, the worker groups, the update, validation) and readers (tracking,
    plots, the sweep summary, the bench's report) name keys by lorarl.metrics' constants."""
    found = []
    for top in ("src", "recipes", "bench"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == ROOT / "src" / "lorarl" / "metrics.py":
                continue
            found += [
                f"{path.relative_to(ROOT)}:{line}: {text!r}"
                for line, text in strings(path.read_text())
                if metric_shaped(text)
            ]
    assert found == [], f"metric keys written as literals (use lorarl.metrics' constants): {found}"


def test_a_literal_key_is_found():
    """What the test above exists for."""
    code = 'a = "sync/bytes"\nb = f"actor/{k}"\nc = k.startswith("val/")\nd = f"val/{s}/reward/mean"\ne = "\\"timing/step\\""\n'
    assert literal_keys(code) == ['"timing/step"', "actor/", "actor/{}", "sync/bytes", "val/", "val/{}/reward/mean"]
    assert literal_keys('f = "timing/prepare"\ng = "init/timing/"\n') == ["init/timing/", "timing/prepare"]
    assert literal_keys('load_group(RewardConfig, "reward/default")\np = "rollout/vllm/engine.py"\n') == []
