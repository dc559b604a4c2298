#!/usr/bin/env bash
# Qwen2.5-0.5B-Instruct GRPO with LoRA (rank 64, alpha 32) on GSM8K, FSDP2 + vLLM on GPUs,
# 5 samples per prompt, adapter gathered one FSDP unit at a time (base read from disk by vLLM).
# Prepare data once: python scripts/prepare_gsm8k.py --jsonl-dir ../shared/data/gsm8k
# Usage: bash scripts/run_qwen2_5_0_5b_grpo_lora_fsdp.sh [hydra overrides...]
set -euo pipefail
source "$(dirname "$0")/_python.sh"

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
NGPUS=${NGPUS:-2}
NNODES=${NNODES:-1}
LORA_RANK=${LORA_RANK:-64}
LR=${LR:-3e-5}

MODEL=(model=qwen2_5_0_5b_instruct "model.path=$MODEL_PATH" "model.lora.rank=$LORA_RANK" model.lora.alpha=32
       model.enable_gradient_checkpointing=true)
DATA=(data=gsm8k "data.train_files=[$DATA_DIR/train.parquet]" "data.val_files=[$DATA_DIR/test.parquet]"
      data.train_batch_size=64 data.max_prompt_length=512 data.max_response_length=1024)
ROLLOUT=(rollout.n=5 rollout.load_format=auto rollout.layered_summon=true rollout.gpu_memory_utilization=0.4)
ACTOR=("actor.optim.lr=$LR" actor.ppo_mini_batch_size=16 actor.ppo_micro_batch_size_per_gpu=8
       actor.use_kl_loss=true actor.kl_loss_coef=0.001 actor.kl_loss_type=low_var_kl)
TRAINER=("trainer.n_gpus_per_node=$NGPUS" "trainer.nnodes=$NNODES" trainer.total_epochs=15
         trainer.test_freq=5 trainer.save_freq=20 "trainer.logger=[console,jsonl]")

exec "$PYTHON" -m recipes.grpo +backend=fsdp "${MODEL[@]}" "${DATA[@]}" "${ROLLOUT[@]}" "${ACTOR[@]}" "${TRAINER[@]}" "$@"
