#!/usr/bin/env bash
# Qwen2-7B-Instruct GRPO with LoRA (rank 64, alpha 32) on GSM8K with the Megatron backend
# (megatron-core + Megatron-Bridge LoRA), tensor/pipeline parallel knobs below.
# Needs: pip install -e '.[megatron,gpu]' (Python 3.12). Prepare data as for the FSDP script.
# Usage: TP=2 PP=1 bash scripts/run_qwen2_7b_grpo_lora_megatron.sh [hydra overrides...]
set -euo pipefail
source "$(dirname "$0")/_python.sh"

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2-7B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
NGPUS=${NGPUS:-2}
TP=${TP:-2}
PP=${PP:-1}
LORA_RANK=${LORA_RANK:-64}

MODEL=(model=qwen2_7b_instruct "model.path=$MODEL_PATH" "model.lora.rank=$LORA_RANK" model.lora.alpha=32)
BACKEND=("backend.tensor_model_parallel_size=$TP" "backend.pipeline_model_parallel_size=$PP" backend.transformer_impl=local)
DATA=(data=gsm8k "data.train_files=[$DATA_DIR/train.parquet]" "data.val_files=[$DATA_DIR/test.parquet]" data.train_batch_size=32)
ROLLOUT=(rollout.n=5 rollout.gpu_memory_utilization=0.4)
ACTOR=(actor.optim.lr=3e-6 actor.ppo_mini_batch_size=16 actor.ppo_micro_batch_size_per_gpu=4)
TRAINER=("trainer.n_gpus_per_node=$NGPUS" trainer.total_epochs=15 trainer.test_freq=5)

exec "$PYTHON" -m recipes.grpo +backend=megatron "${MODEL[@]}" "${BACKEND[@]}" "${DATA[@]}" "${ROLLOUT[@]}" "${ACTOR[@]}" "${TRAINER[@]}" "$@"
