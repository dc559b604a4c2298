"""The typed run config: one field per config group, as the trainer gets it.

Plain dataclasses (picklable). Made by lorarl.config.compose.to_run_config, which runs
lorarl.config.validate on it first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from lorarl.config.backends import FSDPBackendConfig, MegatronBackendConfig
from lorarl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    DataConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)


@dataclass
class RunConfig:
    """The validated, typed config handed to the trainer (plain dataclasses, picklable)."""

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    actor: ActorConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    backend: FSDPBackendConfig | MegatronBackendConfig
    reward: RewardConfig

    @property
    def world_size(self) -> int:
        return self.trainer.world_size

    def to_dict(self) -> dict:
        return asdict(self)


GROUPS = ("model", "data", "rollout", "actor", "algorithm", "trainer", "backend", "reward")


def steps_for(run: RunConfig, steps_per_epoch: int) -> int:
    """Total optimizer steps: trainer.total_steps if set, else epochs x batches per epoch."""
    if run.trainer.total_steps is not None:
        return run.trainer.total_steps
    return run.trainer.total_epochs * steps_per_epoch
