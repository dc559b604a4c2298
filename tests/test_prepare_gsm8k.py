import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "prepare_gsm8k.py"
SHARED = Path("/work/shared/data/gsm8k")
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

needs_shared = pytest.mark.skipif(not (SHARED / "train.jsonl").is_file(), reason="shared gsm8k jsonl absent")


def run(*args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def _subset(tmp_path):
    lines = (SHARED / "train.jsonl").read_text().splitlines()
    # the first 15 plus 5 whose answers use thousands separators ("#### 1,080")
    with_commas = [line for line in lines if "," in json.loads(line)["answer"].split("####")[-1]][:5]
    chosen = lines[:15] + with_commas
    src = tmp_path / "jsonl"
    src.mkdir()
    (src / "train.jsonl").write_text("\n".join(chosen) + "\n")
    (src / "test.jsonl").write_text("\n".join(lines[15:18]) + "\n")
    return src, [json.loads(line) for line in chosen]


@needs_shared
def test_prepare_subset_schema_and_ground_truths(tmp_path):
    src, examples = _subset(tmp_path)
    out = tmp_path / "out"
    res = run("--jsonl-dir", str(src), "--out-dir", str(out))
    assert res.returncode == 0, res.stderr
    rows = pq.read_table(out / "train.parquet").to_pylist()
    assert len(rows) == 20 and pq.read_table(out / "test.parquet").num_rows == 3
    # first three GSM8K training answers, read off the data by hand
    assert [r["reward_model"]["ground_truth"] for r in rows[:3]] == ["72", "10", "5"]
    for i, (row, ex) in enumerate(zip(rows, examples)):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == "openai/gsm8k"
        assert row["ability"] == "math"
        assert row["prompt"] == [{"role": "user", "content": ex["question"] + " " + INSTRUCTION}]
        assert row["reward_model"] == {
            "style": "rule",
            "ground_truth": ex["answer"].split("####")[-1].strip().replace(",", ""),
        }
        assert row["extra_info"] == {"split": "train", "index": i, "answer": ex["answer"], "question": ex["question"]}
    assert "1080" in [r["reward_model"]["ground_truth"] for r in rows[15:]]
    assert pq.read_table(out / "test.parquet").to_pylist()[0]["extra_info"]["split"] == "test"


def test_prepare_missing_jsonl_is_one_clear_line(tmp_path):
    res = run("--jsonl-dir", str(tmp_path / "empty"), "--out-dir", str(tmp_path / "out"))
    assert res.returncode == 1
    assert "train.jsonl" in res.stderr and "--jsonl-dir" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()


def test_prepare_rejects_answer_without_marker(tmp_path):
    src = tmp_path / "jsonl"
    src.mkdir()
    (src / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "just 4"}) + "\n")
    (src / "test.jsonl").write_text("")
    res = run("--jsonl-dir", str(src), "--out-dir", str(tmp_path / "out"))
    assert res.returncode == 1 and "####" in res.stderr


@needs_shared
def test_prepare_full_shared_dir(tmp_path):
    start = time.monotonic()
    res = run("--jsonl-dir", str(SHARED), "--out-dir", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    assert time.monotonic() - start < 20
    train = pq.read_table(tmp_path / "out" / "train.parquet")
    test = pq.read_table(tmp_path / "out" / "test.parquet")
    assert (train.num_rows, test.num_rows) == (7473, 1319)
    truths = [r["ground_truth"] for r in train.column("reward_model").to_pylist()]
    assert all(t.lstrip("-").isdigit() for t in truths)


def test_prepare_without_jsonl_dir_and_without_datasets_says_what_to_do(tmp_path):
    import importlib.util

    if importlib.util.find_spec("datasets") is not None:
        pytest.skip("datasets is installed; this checks the message given when it is not")
    res = run("--out-dir", str(tmp_path / "out"))
    assert res.returncode == 1
    assert "pip install datasets" in res.stderr and "--jsonl-dir" in res.stderr
