"""scripts/prepare_math.py on the shipped sample and on bad input."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lorarl.rewards import get_reward_fn

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "prepare_math.py"
SAMPLE = ROOT / "tests" / "data" / "math_sample"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


_spec = importlib.util.spec_from_file_location("prepare_math", SCRIPT)
prepare_math = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare_math)


@pytest.fixture
def run(capsys):
    """The script's main() in-process (its command line is argv), with what it printed."""

    def call(*args):
        rc = prepare_math.main(list(args))
        out = capsys.readouterr()
        return SimpleNamespace(returncode=rc, stdout=out.out, stderr=out.err)

    return call


def test_math_style_sample(run, tmp_path):
    res = run(
        "--style",
        "math",
        "--train",
        str(SAMPLE / "train.jsonl"),
        "--test",
        str(SAMPLE / "test.jsonl"),
        "--out-dir",
        str(tmp_path),
    )
    assert res.returncode == 0, res.stderr
    train = pq.read_table(tmp_path / "train.parquet").to_pylist()
    test = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert (len(train), len(test)) == (30, 8)
    # read off the sample by hand: the last \boxed{} of each solution, nested braces kept
    assert [r["reward_model"]["ground_truth"] for r in train[:5]] == [
        "17",
        r"\frac{3}{4}",
        r"5\sqrt{2}",
        "-3",
        r"28\text{ cm}",
    ]
    assert test[-1]["reward_model"]["ground_truth"] == "10{,}000"
    first = json.loads((SAMPLE / "train.jsonl").read_text().splitlines()[0])
    assert train[0] == {
        "data_source": "math",
        "prompt": [{"role": "user", "content": f"{first['problem']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "17"},
        "extra_info": {"split": "train", "index": 0, "question": first["problem"], "solution": first["solution"]},
    }
    # every reference answer, boxed, earns the full math reward
    for row in train + test:
        truth = row["reward_model"]["ground_truth"]
        assert get_reward_fn(row["data_source"])(f"\\boxed{{{truth}}}", truth, None) == 1.0


def test_dapo_style_from_jsonl_and_parquet(run, tmp_path):
    chat = tmp_path / "chat.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}], "answer": 4}]
        ),
        chat,
    )
    res = run(
        "--style",
        "dapo",
        "--train",
        str(SAMPLE / "dapo.jsonl"),
        "--test",
        str(chat),
        "--out-dir",
        str(tmp_path / "out"),
        "--instruction",
        "",
    )
    assert res.returncode == 0, res.stderr
    train = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    test = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert len(train) == 6 and {r["data_source"] for r in train} == {"math_dapo"}
    assert [r["reward_model"]["ground_truth"] for r in train[:3]] == ["42", r"\frac{3}{4}", r"6\sqrt{2}"]
    assert train[0]["prompt"] == [{"role": "user", "content": "What is $6 \\cdot 7$?"}]
    assert test[0]["prompt"] == [{"role": "user", "content": "2+2?"}] and test[0]["reward_model"]["ground_truth"] == "4"


def test_solution_without_box_names_the_row_and_writes_nothing(run, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "p", "solution": "it is 4"}) + "\n")
    res = run(
        "--style",
        "math",
        "--train",
        str(SAMPLE / "train.jsonl"),
        "--test",
        str(bad),
        "--out-dir",
        str(tmp_path / "out"),
    )
    assert res.returncode == 1
    assert "bad.jsonl row 0" in res.stderr and "boxed" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "out").exists()


def test_wrong_fields_missing_file_and_unknown_source(run, tmp_path):
    res = run(
        "--style",
        "dapo",
        "--train",
        str(SAMPLE / "train.jsonl"),
        "--test",
        str(SAMPLE / "test.jsonl"),
        "--out-dir",
        str(tmp_path / "o"),
    )
    assert res.returncode == 1 and "prompt, answer" in res.stderr and "--style dapo" in res.stderr
    res = run(
        "--style",
        "math",
        "--train",
        str(tmp_path / "nope.jsonl"),
        "--test",
        str(SAMPLE / "test.jsonl"),
        "--out-dir",
        str(tmp_path / "o"),
    )
    assert res.returncode == 1 and "nope.jsonl" in res.stderr and "not found" in res.stderr
    res = run(
        "--style",
        "math",
        "--train",
        str(SAMPLE / "train.jsonl"),
        "--test",
        str(SAMPLE / "test.jsonl"),
        "--data-source",
        "mine",
        "--out-dir",
        str(tmp_path / "o"),
    )
    assert res.returncode == 1 and "'mine' has no math reward" in res.stderr
    assert not (tmp_path / "o").exists()
