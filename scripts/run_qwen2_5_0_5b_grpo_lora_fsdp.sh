#!/usr/bin/env bash
# Qwen2.5-0.5B-Instruct GRPO with LoRA on GSM8K, FSDP2 + vLLM on GPUs: the preset
# conf/experiment/qwen2_5_0_5b_gsm8k_fsdp.yaml plus the environment knobs below (unset: the
# preset's value) and any Hydra overrides after them.
# Prepare data once: python scripts/prepare_gsm8k.py --jsonl-dir ../shared/data/gsm8k
# Usage: [MODEL_PATH=...] [DATA_DIR=...] [NGPUS=2] [NNODES=1] [LORA_RANK=64] [LR=3e-5] \
#        bash scripts/run_qwen2_5_0_5b_grpo_lora_fsdp.sh [hydra overrides...]
set -euo pipefail
source "$(dirname "$0")/_python.sh"

knob MODEL_PATH model.path
data_dir_knob
knob NGPUS trainer.n_gpus_per_node
knob NNODES trainer.nnodes
knob LORA_RANK model.lora.rank
knob LR actor.optim.lr

exec "$PYTHON" -m recipes.grpo +experiment=qwen2_5_0_5b_gsm8k_fsdp "${KNOBS[@]}" "$@"
