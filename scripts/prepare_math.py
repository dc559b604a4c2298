"""Write MATH-style data as verl-schema parquet: <out-dir>/train.parquet and <out-dir>/test.parquet.

Two input styles, each a .jsonl or .parquet file per split:
  math  rows with "problem" and "solution"; the reference answer is the solution's last \\boxed{...}
        (MATH, MATH-500, and files in their shape).
  dapo  rows with "prompt" (the problem text, or a list of chat messages whose last user message is
        the problem) and "answer" (DAPO-Math and files in its shape).

Each prompt is the problem followed by an instruction to put the final answer in \\boxed{}; rows are
tagged with a data_source that routes them to the boxed-answer math reward.

  python scripts/prepare_math.py --style math --train train.jsonl --test test.jsonl --out-dir ~/data/math
  python scripts/prepare_math.py --style dapo --train dapo_math_17k.parquet --test aime.jsonl --out-dir ~/data/dapo
  python scripts/prepare_math.py --style math --train tests/data/math_sample/train.jsonl \\
      --test tests/data/math_sample/test.jsonl --out-dir ~/data/math_sample       # the shipped sample
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path

import pyarrow.parquet as pq

from lorarl.data.dataset import write_parquet
from lorarl.errors import DataError, LorarlError
from lorarl.rewards import MATH_SOURCES
from lorarl.rewards.math_answer import extract_boxed

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
# data_source written per style; both route to the boxed-answer reward (lorarl.rewards.MATH_SOURCES).
DATA_SOURCES = {"math": "math", "dapo": "math_dapo"}
FIELDS = {"math": ("problem", "solution"), "dapo": ("prompt", "answer")}


def read_rows(path: Path) -> list[dict]:
    """The records of a .jsonl or .parquet file, each checked to be an object."""
    if not path.is_file():
        raise DataError(f"{str(path)!r} not found; pass an existing .jsonl or .parquet file")
    if path.suffix == ".parquet":
        try:
            return pq.read_table(path).to_pylist()
        except Exception as exc:
            raise DataError(f"{path}: not readable parquet ({type(exc).__name__}: {exc})") from exc
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc})") from exc
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: each line must be a JSON object")
            rows.append(row)
    return rows


def _problem_text(prompt, where: str) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list | tuple):
        users = [m["content"] for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    raise DataError(f"{where}: 'prompt' must be a string or a list of chat messages with a user message")


def to_row(raw: dict, style: str, split: str, index: int, where: str, data_source: str, instruction: str) -> dict:
    question_key, answer_key = FIELDS[style]
    missing = [k for k in (question_key, answer_key) if k not in raw]
    if missing:
        raise DataError(f"{where}: needs field(s) {', '.join(missing)} for --style {style}")
    if style == "math":
        problem = raw["problem"]
        truth = extract_boxed(str(raw["solution"]))
        if not truth:
            raise DataError(f"{where}: the solution has no complete \\boxed{{...}} answer: {raw['solution'][-80:]!r}")
    else:
        problem = _problem_text(raw["prompt"], where)
        truth = str(raw["answer"]).strip()
        if not truth:
            raise DataError(f"{where}: 'answer' is empty")
    content = f"{problem} {instruction}" if instruction else problem
    extra = {"split": split, "index": index, "question": problem}
    if style == "math":
        extra["solution"] = raw["solution"]
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": extra,
    }


def convert(path: Path, style: str, split: str, data_source: str, instruction: str) -> list[dict]:
    return [
        to_row(raw, style, split, i, f"{path} row {i}", data_source, instruction)
        for i, raw in enumerate(read_rows(path))
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--style", choices=sorted(FIELDS), required=True, help="input shape (see above)")
    parser.add_argument("--train", type=Path, required=True, help="training problems (.jsonl or .parquet)")
    parser.add_argument("--test", type=Path, required=True, help="validation problems (.jsonl or .parquet)")
    parser.add_argument("--out-dir", type=Path, default=Path("~/data/math"))
    parser.add_argument(
        "--data-source",
        default=None,
        help=f"data_source of every row (default: math for --style math, math_dapo for dapo); one of {', '.join(MATH_SOURCES)}",
    )
    parser.add_argument("--instruction", default=INSTRUCTION, help="text appended to each problem ('' for none)")
    args = parser.parse_args(argv)
    data_source = args.data_source or DATA_SOURCES[args.style]
    if data_source not in MATH_SOURCES:
        print(
            f"error: --data-source {data_source!r} has no math reward; use one of {', '.join(MATH_SOURCES)}",
            file=sys.stderr,
        )
        return 1
    try:
        # Convert both splits before writing either, so a bad row leaves nothing behind.
        splits = {
            split: convert(path.expanduser(), args.style, split, data_source, args.instruction)
            for split, path in (("train", args.train), ("test", args.test))
        }
        out_dir = args.out_dir.expanduser()
        for split, rows in splits.items():
            if not rows:
                raise DataError(f"--{split} {str(getattr(args, split))!r} holds no rows")
        for split, rows in splits.items():
            path = write_parquet(rows, out_dir / f"{split}.parquet")
            print(f"wrote {len(rows)} rows to {path}")
    except LorarlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
