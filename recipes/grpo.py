"""GRPO with LoRA: compose the config, validate it, hand it to the trainer.

python -m recipes.grpo +backend=fsdp
python -m recipes.grpo +backend=fsdp model=qwen2_5_0_5b_instruct data=gsm8k
python -m recipes.grpo -m +backend=fsdp model.lora.rank=8,32
"""

from __future__ import annotations

import signal
import sys

import hydra
from omegaconf import DictConfig

import lorarl.config.compose  # noqa: F401  (registers the schemas before Hydra composes)
from lorarl.errors import LorarlError


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT, raised in the main thread so every finally block runs: a checkpoint
    being written is removed, then vLLM, the process groups and Ray shut down in order."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum: int, frame) -> None:
    # A second signal during the shutdown ends the process at once, as a second Ctrl-C should.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    raise Interrupted(signum)


@hydra.main(version_base="1.3", config_path="../conf", config_name="grpo")
def main(cfg: DictConfig) -> float | None:
    from lorarl.driver.trainer import run
    from lorarl.telemetry.tracking import console

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        return run(cfg)
    except LorarlError as err:
        # One actionable line, no traceback: these are the user's to fix.
        console(lambda line: print(line, file=sys.stderr))(f"error: {err}")
        sys.exit(2)
    except KeyboardInterrupt as err:
        signum = err.signum if isinstance(err, Interrupted) else signal.SIGINT
        print(
            f"interrupted by {signal.Signals(signum).name}: shut down cleanly; completed checkpoints are kept "
            "(relaunch with the same hydra.run.dir to resume)",
            file=sys.stderr,
        )
        sys.exit(128 + signum)


if __name__ == "__main__":
    main()
