#!/usr/bin/env bash
# CPU smoke run of the whole GRPO-LoRA loop on the embedded tiny Qwen2 and arithmetic task: the
# preset conf/experiment/tiny_cpu_smoke.yaml (FSDP2 over gloo with 2 ranks, one vLLM CPU engine
# per rank, parity probe on, 4 steps) plus the environment knobs below (unset: the preset's
# value) and any Hydra overrides after them.
# Usage: [NGPUS=2] [STEPS=4] [LORA_RANK=16] bash scripts/run_tiny_cpu.sh [hydra overrides...]
set -euo pipefail
source "$(dirname "$0")/_python.sh"

knob NGPUS trainer.n_gpus_per_node
knob STEPS trainer.total_steps
knob LORA_RANK model.lora.rank

exec "$PYTHON" -m recipes.grpo +experiment=tiny_cpu_smoke "${KNOBS[@]}" "$@"
