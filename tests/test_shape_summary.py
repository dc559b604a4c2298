"""The verdict of the GPU shape runs' summary (tests/gpu/shape_summary.py) on hand-made step rows."""

from __future__ import annotations

import json
import math

from tests.gpu.shape_summary import main, step_rows, summarise


def rows(rewards, std=0.1, match=1.0, ref=0.5, noise=0.01, key="sync/adapter_match", meaning="sync/adapter_meaning"):
    return [
        {
            "step": i + 1,
            "reward/mean": r,
            "reward/std": std,
            "actor/grad_norm": 0.3,
            "sync/kind": "adapter",
            key: match,
            meaning: 1.0,
            "sync/logprob_diff_max": 4 * noise,
            "sync/logprob_diff_mean": noise,
            "sync/logprob_ref_diff_mean": ref,
        }
        for i, r in enumerate(rewards)
    ]


RISING = [0.10, 0.11, 0.12, 0.14, 0.16, 0.18, 0.20, 0.22]


def test_a_moving_adapter_passes_all_three():
    out = summarise(rows(RISING), samples_per_step=128, rc=0)
    v = out["verdict"]
    # 3 standard errors of (mean of 3 steps - mean of 3 steps), each step's mean 0.1 / sqrt(128).
    assert math.isclose(v["reward_rose"]["needed"], 3 * math.sqrt(6 * 0.01 / 128) / 3)
    assert math.isclose(v["reward_rose"]["rise"], (0.18 + 0.20 + 0.22 - 0.10 - 0.11 - 0.12) / 3)
    assert v["adapter_effect_over_probe_noise"]["ratio"] == 50.0
    assert out["passed"] and out["steps"][0]["checks"] == {"sync/adapter_match": 1.0, "sync/adapter_meaning": 1.0}
    assert out["steps"][-1]["probe"] == {
        "logprob_diff_max": 0.04,
        "logprob_diff_mean": 0.01,
        "logprob_ref_diff_mean": 0.5,
    }


def test_each_fault_fails_its_part():
    flat = summarise(rows([0.1, 0.11, 0.1, 0.1, 0.1, 0.11, 0.1, 0.11]), 128, 0)
    assert not flat["verdict"]["reward_rose"]["passed"] and not flat["passed"]
    assert not summarise(rows(RISING[:5]), 128, 0)["verdict"]["reward_rose"]["passed"]  # too few steps
    bad = rows(RISING)
    bad[4]["sync/adapter_match"] = 0.0
    assert not summarise(bad, 128, 0)["verdict"]["sync_checks_passed"]["passed"]
    assert not summarise(rows(RISING), 128, rc=2)["verdict"]["sync_checks_passed"]["passed"]
    unchecked = rows(RISING)
    del unchecked[2]["sync/adapter_meaning"]  # a step without the semantic check is unchecked
    assert summarise(unchecked, 128, 0)["verdict"]["sync_checks_passed"]["steps_without_check"] == [3]
    wrong = rows(RISING)
    wrong[6]["sync/adapter_meaning"] = 0.0
    assert not summarise(wrong, 128, 0)["verdict"]["sync_checks_passed"]["passed"]
    still = summarise(rows(RISING, ref=0.09, noise=0.01), 128, 0)  # effect 9x the noise
    assert not still["verdict"]["adapter_effect_over_probe_noise"]["passed"]
    no_probe = rows(RISING)
    no_probe[-1]["sync/logprob_ref_diff_mean"] = None
    assert not summarise(no_probe, 128, 0)["verdict"]["adapter_effect_over_probe_noise"]["passed"]


def test_the_command_reads_a_run_folder_and_its_error_line(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("data:\n  train_batch_size: 16\nrollout:\n  n: 8\n")
    lines = [
        {"step": 0, "init/timing/prepare": 1.0},
        *rows(RISING, key="sync/weights_match", meaning="sync/merged_meaning"),
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    assert [r["step"] for r in step_rows(run / "metrics.jsonl")] == list(range(1, 9))
    log = tmp_path / "run.log"
    log.write_text("step 1 ...\nerror: step 9: the check failed at layer 3\n")
    out = tmp_path / "summary.json"
    monkeypatch.setattr("sys.argv", ["shape_summary", str(run), str(out), "--log", str(log), "--rc", "2"])
    main()
    summary = json.loads(out.read_text())
    assert summary["error"] == "error: step 9: the check failed at layer 3"
    assert summary["verdict"]["reward_rose"]["passed"] and not summary["passed"]  # rc 2 fails the checks part
