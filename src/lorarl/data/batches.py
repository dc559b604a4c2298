"""The trainer's prompt batches from its config: one place, so tools that must feed a run the
same prompts in the same order (the GPU step bench's peer runs) read them through this."""

from __future__ import annotations

from typing import Any

from lorarl.data.dataset import PromptItem, PromptLoader, build_prompts, load_rows


def prompt_batches(
    data: Any, tokenizer: Any, seed: int, validation: bool
) -> tuple[PromptLoader, list[PromptItem], int]:
    """(train loader, validation items, prompts dropped as overlong from the train files).

    `data` is the run's `data` config (files already resolved by `trainer.prepare_data`); the
    loader yields one generation round's prompts (`data.gen_batch_size`, DAPO's oversampling, or
    `data.train_batch_size`), reshuffled each epoch from `seed`.
    Validation items are built only when `validation` is set and `data.val_files` names files."""

    def items(files: list[str]) -> tuple[list[PromptItem], int]:
        return build_prompts(
            load_rows(files), tokenizer, data.max_prompt_length, data.filter_overlong_prompts, data.truncation
        )

    train, dropped = items(data.train_files)
    val = items(data.val_files)[0] if validation and data.val_files else []
    return (
        PromptLoader(train, data.gen_batch_size or data.train_batch_size, shuffle=data.shuffle, seed=seed),
        val,
        dropped,
    )
