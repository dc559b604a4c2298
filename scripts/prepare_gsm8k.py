"""Write GSM8K as verl-schema parquet: <out-dir>/train.parquet and <out-dir>/test.parquet.

Online:   python scripts/prepare_gsm8k.py --out-dir ~/data/gsm8k   (needs `pip install datasets` and network)
Offline:  python scripts/prepare_gsm8k.py --jsonl-dir DIR --out-dir ~/data/gsm8k
          DIR holds train.jsonl and test.jsonl, one {"question": ..., "answer": ...} object per line,
          as in GSM8K's own release (the answer ends with a '#### N' line).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lorarl.data.dataset import write_parquet
from lorarl.errors import DataError, LorarlError
from lorarl.rewards.gsm8k import extract_answer

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")


def to_row(question: str, answer: str, split: str, index: int) -> dict:
    truth = extract_answer(answer, "strict")
    if truth is None:
        raise DataError(f"gsm8k {split} example {index}: answer has no '#### N' line: {answer[-80:]!r}")
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise DataError(f"{str(path)!r} not found; --jsonl-dir must hold train.jsonl and test.jsonl")
    examples = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ex = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc})") from exc
            if not isinstance(ex, dict) or "question" not in ex or "answer" not in ex:
                raise DataError(f"{path}:{lineno}: needs fields 'question' and 'answer'")
            examples.append(ex)
    return examples


def load_hub() -> dict[str, list[dict]]:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "the 'datasets' package is not installed; pip install datasets, "
            "or pass --jsonl-dir DIR holding train.jsonl and test.jsonl"
        ) from None
    try:
        ds = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as exc:
        raise DataError(
            f"could not download openai/gsm8k ({type(exc).__name__}: {exc}); "
            f"offline? pass --jsonl-dir DIR holding train.jsonl and test.jsonl"
        ) from exc
    return {split: list(ds[split]) for split in SPLITS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--jsonl-dir",
        type=Path,
        default=None,
        help="read DIR/train.jsonl and DIR/test.jsonl instead of the Hugging Face hub",
    )
    parser.add_argument("--out-dir", type=Path, default=Path("~/data/gsm8k"))
    args = parser.parse_args(argv)
    try:
        if args.jsonl_dir is not None:
            raw = {split: read_jsonl(args.jsonl_dir.expanduser() / f"{split}.jsonl") for split in SPLITS}
        else:
            raw = load_hub()
        out_dir = args.out_dir.expanduser()
        for split in SPLITS:
            rows = [to_row(ex["question"], ex["answer"], split, i) for i, ex in enumerate(raw[split])]
            path = write_parquet(rows, out_dir / f"{split}.parquet")
            print(f"wrote {len(rows)} rows to {path}")
    except LorarlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
