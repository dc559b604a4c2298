"""Prompt data: verl-schema parquet rows -> tokenized chat prompts -> resumable batches."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from lorarl.errors import DataError

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model.ground_truth")


def write_parquet(rows: list[dict], path: str | os.PathLike) -> Path:
    """Write rows as parquet atomically: readers never see a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _missing_columns(schema: pa.Schema) -> list[str]:
    missing = [name for name in ("data_source", "prompt") if name not in schema.names]
    if "reward_model" not in schema.names:
        missing.append("reward_model.ground_truth")
    else:
        rm_type = schema.field("reward_model").type
        if not (pa.types.is_struct(rm_type) and rm_type.get_field_index("ground_truth") >= 0):
            missing.append("reward_model.ground_truth")
    return missing


def load_rows(files: Sequence[str | os.PathLike] | str | os.PathLike) -> list[dict]:
    """All rows of the given parquet files, in order, as plain dicts."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    if not files:
        raise DataError("no data files given; set data.train_files / data.val_files")
    rows: list[dict] = []
    for file in files:
        path = Path(os.path.expanduser(str(file)))
        if not path.is_file():
            raise DataError(
                f"data file {str(path)!r} not found; run scripts/prepare_gsm8k.py "
                f"or check data.train_files / data.val_files"
            )
        try:
            table = pq.read_table(path)
        except Exception as exc:
            raise DataError(f"data file {str(path)!r} is not readable parquet ({type(exc).__name__}: {exc})") from exc
        missing = _missing_columns(table.schema)
        if missing:
            raise DataError(
                f"data file {str(path)!r} lacks column(s) {', '.join(missing)}; "
                f"expected verl's schema ({', '.join(REQUIRED_COLUMNS)})"
            )
        rows.extend(table.to_pylist())
    return rows


@dataclass
class PromptItem:
    index: int
    prompt_ids: list[int]
    data_source: str
    ground_truth: str
    extra_info: dict = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)


def _as_id_list(encoded: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True);
    # older versions return a plain list; some tokenizers hand back tensors.
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    if encoded and isinstance(encoded[0], (list, tuple)):
        if len(encoded) != 1:
            raise DataError(f"chat template returned a batch of {len(encoded)} prompts for one row")
        encoded = encoded[0]
    return [int(t) for t in encoded]


def _messages(row: dict, i: int) -> list[dict]:
    prompt = row.get("prompt")
    if isinstance(prompt, str) or not isinstance(prompt, Sequence) or not prompt:
        raise DataError(
            f"row {i}: prompt must be a non-empty list of {{'role', 'content'}} messages, got {prompt!r:.80}"
        )
    for msg in prompt:
        if not isinstance(msg, Mapping) or "role" not in msg or "content" not in msg:
            raise DataError(f"row {i}: prompt message {msg!r:.80} lacks 'role' or 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def build_prompts(
    rows: list[dict],
    tokenizer: Any,
    max_prompt_length: int,
    filter_overlong_prompts: bool,
    truncation: str = "error",
) -> tuple[list[PromptItem], int]:
    """Tokenize each row's chat prompt; returns the items and how many were filtered out.
    `max_prompt_length` and `truncation` as lorarl.config.schema.DataConfig checks them."""
    if not rows:
        raise DataError("no prompt rows to build from; check data.train_files / data.val_files")
    items: list[PromptItem] = []
    n_filtered = 0
    for i, row in enumerate(rows):
        messages = _messages(row, i)
        ids = _as_id_list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        if len(ids) > max_prompt_length:
            if filter_overlong_prompts:
                n_filtered += 1
                continue
            if truncation == "error":
                raise DataError(
                    f"row {i}: prompt has {len(ids)} tokens > data.max_prompt_length={max_prompt_length}; "
                    f"raise it, set data.filter_overlong_prompts=true, or data.truncation=left|right"
                )
            ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
        reward_model = row.get("reward_model") or {}
        truth = reward_model.get("ground_truth")
        if truth is None:
            raise DataError(f"row {i}: reward_model.ground_truth is missing")
        items.append(
            PromptItem(
                index=i,
                prompt_ids=ids,
                data_source=str(row["data_source"]),
                ground_truth=str(truth),
                extra_info=dict(row.get("extra_info") or {}),
                messages=messages,
            )
        )
    if not items:
        raise DataError(
            f"all {len(rows)} prompts are longer than data.max_prompt_length={max_prompt_length} "
            f"and data.filter_overlong_prompts dropped them; raise data.max_prompt_length"
        )
    return items, n_filtered


class PromptLoader:
    """Batches of prompts, reshuffled each epoch with seed + epoch.

    The order of an epoch depends only on (seed, epoch), so {"epoch", "batch_in_epoch"}
    is enough to resume and yield exactly the batches an uninterrupted run would.
    """

    def __init__(
        self,
        items: list[PromptItem],
        batch_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool = True,
    ) -> None:
        if batch_size > len(items):
            raise DataError(
                f"data.train_batch_size={batch_size} is larger than the {len(items)} prompts available; "
                f"lower it or add data"
            )
        self.items = items
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.batch_in_epoch = 0
        self._order = self._epoch_order(0)

    @property
    def steps_per_epoch(self) -> int:
        n = len(self.items)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.items)))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.items), generator=gen).tolist()

    def next_batch(self) -> list[PromptItem]:
        """The next batch; moves to the next epoch after the last batch of this one."""
        start = self.batch_in_epoch * self.batch_size
        batch = [self.items[j] for j in self._order[start : start + self.batch_size]]
        self.batch_in_epoch += 1
        if self.batch_in_epoch >= self.steps_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
            self._order = self._epoch_order(self.epoch)
        return batch

    def __iter__(self) -> Iterator[list[PromptItem]]:
        """The remaining batches of the current epoch."""
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        epoch, batch = int(state["epoch"]), int(state["batch_in_epoch"])
        if epoch < 0 or not 0 <= batch < self.steps_per_epoch:
            raise DataError(
                f"data loader state {dict(state)} does not fit {self.steps_per_epoch} batches per epoch; "
                f"did data.train_batch_size or the data change since the checkpoint?"
            )
        self.epoch, self.batch_in_epoch = epoch, batch
        self._order = self._epoch_order(epoch)


def ensure_arith_parquet(
    train_path: str | os.PathLike,
    val_path: str | os.PathLike,
    n_train: int,
    seed: int,
) -> tuple[str, str]:
    """Write the synthetic task's parquet at the configured paths if missing: `n_train` problems
    drawn from the training pairs, and each held-out pair once for validation; the two share no
    prompt (lorarl.data.arith).

    The config puts the size and task version in the folder name, so a changed task never reuses stale files.
    """
    from lorarl.data.arith import held_out_rows, make_rows

    train = Path(os.path.expanduser(str(train_path)))
    val = Path(os.path.expanduser(str(val_path)))
    if not train.is_file():
        write_parquet(make_rows(n_train, seed, "train", pool="train"), train)
    if not val.is_file():
        write_parquet(held_out_rows(), val)
    return str(train), str(val)
