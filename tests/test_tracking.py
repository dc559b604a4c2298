"""Metric sinks: jsonl rows, an offline wandb run with the resolved config, no secrets anywhere."""

from __future__ import annotations

import json
import sys

import pytest

from lorarl import metrics as keys
from lorarl.telemetry.plot import plot
from lorarl.telemetry.sweep import write_summary
from lorarl.telemetry.tracking import Tracker, read_metrics, redact


def test_jsonl_rows_and_plots(tmp_path):
    t = Tracker(["jsonl"], tmp_path, "p", "e", {"a": 1})
    for step in range(1, 4):
        t.log(
            {
                "reward/mean": step / 10,
                "actor/kl_loss": 0.01 * step,
                "sync/seconds": 0.005,
                "response_length/mean": 3.0,
                "sync/logprob_diff_max": 1e-6 * step,
            },
            step,
        )
    t.finish()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[2]["reward/mean"] == pytest.approx(0.3)
    written = {p.name for p in plot(tmp_path)}
    assert {
        "plot_reward.png",
        "plot_kl.png",
        "plot_sync_seconds.png",
        "plot_response_length.png",
        "plot_sync_parity.png",
    } <= written
    assert (tmp_path / "plot_reward.png").stat().st_size > 1000


def test_reward_plot_smooths_and_marks_validation(tmp_path):
    from lorarl.telemetry.plot import moving_average

    assert moving_average([1.0, 0.0, 1.0, 0.0], window=2) == [1.0, 0.5, 0.5, 0.5]
    assert moving_average([0.2] * 30)[-1] == pytest.approx(0.2)
    t = Tracker(["jsonl"], tmp_path, "p", "e", {})
    t.log({"val/acc": 0.1}, 0)
    for step in range(1, 21):
        t.log({"reward/mean": (step % 2) / 2 + step / 40}, step)
    t.log({"val/acc": 0.6}, 20)
    t.finish()
    written = {p.name for p in plot(tmp_path)}
    assert {"plot_reward.png", "plot_val_acc.png"} <= written


def test_plot_cli_rejects_a_folder_without_metrics(tmp_path):
    from lorarl.telemetry.plot import main

    assert main([str(tmp_path)]) == 1


def test_redact_blanks_secret_keys():
    cfg = {"trainer": {"wandb_api_key": "abc", "project_name": "p"}, "hf_token": "t", "x": [{"password": "pw"}]}
    out = redact(cfg)
    assert out["trainer"]["wandb_api_key"] == "<redacted>" and out["trainer"]["project_name"] == "p"
    assert out["hf_token"] == "<redacted>" and out["x"][0]["password"] == "<redacted>"


def test_wandb_offline_gets_config_and_metrics_but_no_secret(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "secret-wandb-key-123")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = {"model": {"path": "m", "lora": {"rank": 8}}, "trainer": {"api_key": "secret-wandb-key-123"}}
    t = Tracker(["jsonl", "wandb"], tmp_path, "lorarl-test", "offline", config)
    t.log({"reward/mean": 0.5, "sync/kind": "adapter"}, step=1)
    t.finish()
    # The record is written by wandb's service process, which may still be writing when finish()
    # returns (under load it once held only its header); teardown waits for it, as the atexit
    # hook does when a run's process exits.
    wandb.teardown()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # Offline runs keep config and history in the run's .wandb record until `wandb sync`.
    record = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert b"lora" in record and b"reward/mean" in record
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert b"secret-wandb-key-123" not in path.read_bytes(), path


def test_sweep_summary_from_job_folders(tmp_path):
    for i, reward in enumerate([0.2, 0.6]):
        job = tmp_path / f"{i}_fsdp_qwen2_tiny_r{8 * (i + 1)}"
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- model.lora.rank={8 * (i + 1)}\n")
        rows = [{"step": s, "reward/mean": reward, "timing/step": 0.5, "sync/seconds": 0.01} for s in range(1, 6)]
        rows.append({"step": 5, "val/acc": reward + 0.1})
        (job / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    md, csv_path = write_summary(tmp_path)
    text = md.read_text()
    assert "model.lora.rank=8" in text and "model.lora.rank=16" in text
    lines = csv_path.read_text().strip().splitlines()
    assert lines[0].startswith("job,overrides,steps,final_reward,val_acc")
    assert lines[2].split(",")[3:5] == ["0.6", "0.7"]


def test_drop_after_keeps_the_rows_up_to_a_resumed_step(tmp_path):
    """A resumed run drops the rows of the steps it trains again (and a line cut short by a
    kill), then appends: each step keeps one row."""
    t = Tracker(["jsonl"], tmp_path, "p", "e", {})
    for step in (0, 0, 1, 2, 3):
        t.log({"reward/mean": step / 10}, step)
    t.finish()
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 4, "rew')
    t = Tracker(["jsonl"], tmp_path, "p", "e", {})
    t.drop_after(2)
    t.log({"reward/mean": 0.31}, 3)
    t.finish()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 0, 1, 2, 3] and rows[-1]["reward/mean"] == 0.31
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_tensorboard_logger_writes_the_scalars(tmp_path):
    """trainer.logger=tensorboard after `pip install 'lorarl[tensorboard]'` (the test extra has it):
    the event file holds every numeric metric at its step, read back with tensorboard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Tracker(["tensorboard"], tmp_path, "p", "e", {})
    for step in (1, 2):
        t.log({"reward/mean": step / 4, "sync/kind": "adapter"}, step)
    t.finish()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["reward/mean"]
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5)]


@pytest.mark.parametrize("logger", ["tensorboard", "wandb"])
def test_a_logger_without_its_package_names_the_extra(logger, monkeypatch):
    """The package is made unimportable (None in sys.modules is Python's own marker for that)."""
    from lorarl.errors import ConfigError
    from lorarl.telemetry.tracking import check_loggers

    check_loggers(["console", "jsonl", logger])  # installed: no error
    monkeypatch.setitem(sys.modules, logger, None)
    with pytest.raises(ConfigError) as err:
        check_loggers(["console", "jsonl", logger])
    line = str(err.value)
    assert "\n" not in line
    assert f"trainer.logger={logger} needs the {logger} package" in line and f"pip install 'lorarl[{logger}]'" in line


def test_a_sweep_reward_panel_names_each_job_once():
    """Eight jobs of a sweep made a legend of 24 lines over the curves: a job's name now labels its
    mean alone (the title says which line is which); one run keeps all three labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lorarl.telemetry.plot import _reward_panel

    rows = [{"step": 1, keys.VAL_ACC.key: 0.5}, {"step": 2, keys.VAL_ACC.key: 0.6}]
    fig, (sweep, one) = plt.subplots(1, 2)
    for i in range(3):
        _reward_panel(sweep, [1, 2], [0.1, 0.2], rows, f"C{i}", f"{i}_job")
    _reward_panel(one, [1, 2], [0.1, 0.2], rows, "C0", None)
    assert sweep.get_legend_handles_labels()[1] == ["0_job", "1_job", "2_job"]
    assert len(one.get_legend_handles_labels()[1]) == 3
    plt.close(fig)
