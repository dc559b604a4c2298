"""GRPO with LoRA: compose the config, validate it, hand it to the trainer.

python -m recipes.grpo +backend=fsdp
python -m recipes.grpo +backend=fsdp model=qwen2_5_0_5b_instruct data=gsm8k
python -m recipes.grpo -m +backend=fsdp model.lora.rank=8,32
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

import lorarl.config.compose  # noqa: F401  (registers the schemas before Hydra composes)
from lorarl.driver.entry import as_command


@hydra.main(version_base="1.3", config_path="../conf", config_name="grpo")
def main(cfg: DictConfig) -> float | None:
    from lorarl.driver.trainer import run

    with as_command():
        return run(cfg)


if __name__ == "__main__":
    main()
