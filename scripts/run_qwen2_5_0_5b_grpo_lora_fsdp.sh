#!/usr/bin/env bash
# Qwen2.5-0.5B-Instruct GRPO with LoRA on GSM8K, FSDP2 + vLLM on GPUs: the preset
# conf/experiment/qwen2_5_0_5b_gsm8k_fsdp.yaml plus the environment variables below and any
# Hydra overrides after them. MODEL_PATH and DATA_DIR are required; an unset knob keeps the preset's value.
# Prepare data once: python scripts/prepare_gsm8k.py --out-dir "$DATA_DIR" (docs/gpu.md)
# Usage: MODEL_PATH=... DATA_DIR=... [NGPUS=2] [NNODES=1] [LORA_RANK=64] [LR=3e-5] \
#        bash scripts/run_qwen2_5_0_5b_grpo_lora_fsdp.sh [hydra overrides...]
set -euo pipefail
source "$(dirname "$0")/_python.sh"

model_path_knob Qwen/Qwen2.5-0.5B-Instruct
data_dir_knob
knob NGPUS trainer.n_gpus_per_node
knob NNODES trainer.nnodes
knob LORA_RANK model.lora.rank
knob LR actor.optim.lr

exec "$PYTHON" -m recipes.grpo +experiment=qwen2_5_0_5b_gsm8k_fsdp "${KNOBS[@]}" "$@"
