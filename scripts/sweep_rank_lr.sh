#!/usr/bin/env bash
# Hydra multirun over LoRA rank x learning rate; each job gets its own folder and the sweep
# folder gets summary.md / summary.csv when it ends. Defaults to the tiny CPU setup, the points
# trained as adapters of one base (LAUNCHER=basic: one job after another; docs/gpu.md section 7).
# Usage: RANKS=8,32 LRS=1e-3,3e-3 bash scripts/sweep_rank_lr.sh [hydra overrides...]
set -euo pipefail
source "$(dirname "$0")/_python.sh"

RANKS=${RANKS:-8,32}
LRS=${LRS:-1e-3,3e-3}
STEPS=${STEPS:-10}
LAUNCHER=${LAUNCHER:-shared_base}

SWEEP=("model.lora.rank=$RANKS" "actor.optim.lr=$LRS")
TRAINER=(trainer.device=cpu "trainer.total_steps=$STEPS" "trainer.test_freq=$STEPS" trainer.progress_bar=false)

exec "$PYTHON" -m recipes.grpo hydra.mode=MULTIRUN "hydra/launcher=$LAUNCHER" +backend=fsdp "${SWEEP[@]}" "${TRAINER[@]}" "$@"
