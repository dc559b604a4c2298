#!/usr/bin/env bash
# Qwen3-1.7B with DAPO and LoRA on GSM8K, FSDP2 + vLLM on GPUs: the preset
# conf/experiment/qwen3_1_7b_gsm8k_dapo.yaml plus the environment knobs below (unset: the
# preset's value) and any Hydra overrides after them.
# Prepare data once: python scripts/prepare_gsm8k.py --jsonl-dir ../shared/data/gsm8k
# Usage: [MODEL_PATH=...] [DATA_DIR=...] [NGPUS=2] [NNODES=1] [LORA_RANK=64] [LR=3e-5] \
#        bash scripts/run_qwen3_1_7b_dapo_lora_fsdp.sh [hydra overrides...]
set -euo pipefail
source "$(dirname "$0")/_python.sh"

knob MODEL_PATH model.path
data_dir_knob
knob NGPUS trainer.n_gpus_per_node
knob NNODES trainer.nnodes
knob LORA_RANK model.lora.rank
knob LR actor.optim.lr

exec "$PYTHON" -m recipes.grpo +experiment=qwen3_1_7b_gsm8k_dapo "${KNOBS[@]}" "$@"
