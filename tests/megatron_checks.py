"""The Megatron checks as a run gets them, for tests that vary one LoRA or backend setting: each
group's own (lorarl.config.schema, lorarl.config.backends), the cross-group ones (lorarl.config.validate)
and the model's shape (lorarl.config.validate.check_model_shape)."""

from __future__ import annotations

import dataclasses

from lorarl.config.backends import MegatronBackendConfig
from lorarl.config.compose import compose, load_group
from lorarl.config.schema import LoraConfig
from lorarl.config.validate import check_model_shape, validate

LORA = {
    "rank": 8,
    "alpha": 16,
    "dropout": 0.05,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "target_parameters": [],
    "type": "lora",
    "init_A": "kaiming",
    "merge": False,
}


def lora_config(**kw) -> LoraConfig:
    return LoraConfig(**{**LORA, **kw})


def backend_config(**kw) -> MegatronBackendConfig:
    return dataclasses.replace(load_group(MegatronBackendConfig, "backend/megatron"), **kw)


def check_megatron(
    lora_cfg: LoraConfig,
    backend_cfg: MegatronBackendConfig,
    *,
    num_layers: int | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    vocab_size: int | None = None,
    world_size: int | None = None,
    num_experts: int | None = None,
) -> None:
    # Batch sizes that divide over any device count the tests use (the batch split is not what they check).
    base = compose(["+backend=megatron", "data.train_batch_size=24", "actor.ppo_mini_batch_size=24"])
    devices = world_size or max(1, backend_cfg.model_parallel_size())
    run = dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, lora=lora_cfg),
        backend=backend_cfg,
        trainer=dataclasses.replace(base.trainer, n_gpus_per_node=devices),
        actor=dataclasses.replace(base.actor, ppo_micro_batch_size_per_gpu=1),
    )
    validate(run)
    if num_attention_heads or num_key_value_heads or num_layers or vocab_size or num_experts is not None:
        heads = num_attention_heads or 16
        check_model_shape(
            run,
            heads,
            num_key_value_heads or heads,
            num_layers=num_layers,
            vocab_size=vocab_size,
            num_experts=num_experts,
        )
