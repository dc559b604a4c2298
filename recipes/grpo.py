"""GRPO with LoRA: compose the config, validate it, hand it to the trainer.

    python -m recipes.grpo +backend=fsdp
    python -m recipes.grpo +backend=fsdp model=qwen2_5_0_5b_instruct data=gsm8k
    python -m recipes.grpo -m +backend=fsdp model.lora.rank=8,32
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

import lorarl.config  # noqa: F401  (registers the schemas before Hydra composes)
from lorarl.errors import LorarlError


@hydra.main(version_base="1.3", config_path="../conf", config_name="grpo")
def main(cfg: DictConfig) -> float | None:
    from lorarl.trainer import run

    try:
        return run(cfg)
    except LorarlError as err:
        # One actionable line, no traceback: these are the user's to fix.
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
