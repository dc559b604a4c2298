#!/usr/bin/env bash
# CPU smoke run of the whole GRPO-LoRA loop on the embedded tiny Qwen2 and arithmetic task:
# FSDP2 over gloo with $NGPUS ranks, one vLLM CPU engine per rank, sync parity probe on.
# Usage: bash scripts/run_tiny_cpu.sh [hydra overrides...]   e.g. trainer.total_steps=2
set -euo pipefail
source "$(dirname "$0")/_python.sh"

NGPUS=${NGPUS:-2}
STEPS=${STEPS:-20}
RANK=${RANK_LORA:-16}

MODEL=(model=qwen2_tiny "model.lora.rank=$RANK")
DATA=(data=arith data.train_batch_size=8)
ROLLOUT=(rollout.n=4 rollout.temperature=1.0)
ACTOR=(actor.optim.lr=2e-3 actor.ppo_mini_batch_size=8 actor.ppo_micro_batch_size_per_gpu=8)
TRAINER=(trainer.device=cpu "trainer.n_gpus_per_node=$NGPUS" "trainer.total_steps=$STEPS" trainer.check_sync=true)

exec "$PYTHON" -m recipes.grpo +backend=fsdp "${MODEL[@]}" "${DATA[@]}" "${ROLLOUT[@]}" "${ACTOR[@]}" "${TRAINER[@]}" "$@"
