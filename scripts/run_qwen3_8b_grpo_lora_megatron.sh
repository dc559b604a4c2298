#!/usr/bin/env bash
# Qwen3-8B GRPO with LoRA on GSM8K with the Megatron backend (Megatron-Bridge's Qwen3Bridge):
# the preset conf/experiment/qwen3_8b_gsm8k_megatron.yaml plus the environment variables below
# and any Hydra overrides after them. MODEL_PATH and DATA_DIR are required; an unset knob keeps
# the preset's value.
# Needs: pip install -e '.[megatron,gpu]' (Python 3.12). Prepare data as for the FSDP scripts (docs/gpu.md).
# Usage: [TP=2] [PP=1] [NGPUS=2] MODEL_PATH=... DATA_DIR=... [LORA_RANK=64] [LR=3e-6] \
#        bash scripts/run_qwen3_8b_grpo_lora_megatron.sh [hydra overrides...]
set -euo pipefail
source "$(dirname "$0")/_python.sh"

model_path_knob Qwen/Qwen3-8B
data_dir_knob
knob NGPUS trainer.n_gpus_per_node
knob TP backend.tensor_model_parallel_size
knob PP backend.pipeline_model_parallel_size
knob LORA_RANK model.lora.rank
knob LR actor.optim.lr

exec "$PYTHON" -m recipes.grpo +experiment=qwen3_8b_gsm8k_megatron "${KNOBS[@]}" "$@"
