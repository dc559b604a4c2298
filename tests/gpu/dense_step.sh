#!/usr/bin/env bash
# Qwen2.5-7B-shaped GRPO run whose adapter moves: random weights with the real dims (all 28 layers,
# bench.common.shaped_model), the token-share task (data=token_share: a reward a random model can
# climb), LoRA rank 64 on the seven projections synced as an adapter every step, CUDA graphs, the
# sync checks and the log-prob probe every step, 20 steps.
# On the GPU machine, from the repo root, after .vllmcarry/install.sh and install-extra.sh:
#   bash tests/gpu/dense_step.sh                                the moving-adapter run
#   TAG=qk_swap bash tests/gpu/dense_step.sh +trainer.sync_fault=qk_swap   an injected fault
# Extra Hydra overrides pass through (after the script's own). TAG names the outputs.
# BACKEND=megatron trains with the Megatron backend (TP=1; two copies of the base on the GPU).
# Off the GPU (a random tiny Qwen2, float32, 12 steps): SHAPE=tiny bash tests/gpu/dense_step.sh
# Writes to $OUT (default /tmp/dense_out): dense_step[_TAG].log and dense_step[_TAG].json (per step:
# reward mean/std, grad_norm, sync checks, the probe's three numbers, timings; then the verdict:
# reward rose, every sync check passed, adapter effect >= 10x the probe's noise;
# tests/gpu/shape_summary.py).
set -uo pipefail
OUT=${OUT:-/tmp/dense_out}; mkdir -p "$OUT"
NAME=dense_step${TAG:+_$TAG}
export PYTHONUNBUFFERED=1 LORARL_CACHE=${LORARL_CACHE:-/tmp/lcache} PYTHONPATH=$(pwd)/src:$(pwd):${PYTHONPATH:-}
PY=${PYTHON:-python3}
if [ "${SHAPE:-gpu}" = tiny ]; then
  M=$LORARL_CACHE/qwen2_tiny_random
  INFO=$M/lorarl_tiny_model.json
  $PY -c "from lorarl.models.tiny import ensure_tiny_model as e; e('$M', warmup_steps=0)" || exit 1
  ARGS=(model=qwen2_tiny data.train_batch_size=8 actor.ppo_mini_batch_size=8 data.max_response_length=16
        actor.optim.lr=${LR:-2e-3} trainer.total_steps=${STEPS:-12})
else
  M=$($PY -c "from pathlib import Path; from bench.common import shaped_model as s; print(s(Path('$LORARL_CACHE'), 'qwen2.5-7b', device='cuda', token_share=True))" | tail -1)
  [ -d "$M" ] || exit 1
  INFO=$M/bench_model.json
  # lr 1e-3: on one H100 it moved the probe's adapter effect to 1.4 nats in 20 steps against 0.04
  # of trainer-vLLM noise (at 1e-4: 0.11 against 0.05, tests/gpu_logs/dense). token_share=True:
  # without the subset's direction the reward stayed at 0.125 however far the adapter moved.
  # backend.liger_kernel=false: the run measures the sync and its checks, not the loss kernel, and
  # needs only vLLM, transformers and PEFT on the machine.
  ARGS=(model=qwen2_5_7b_instruct rollout.enforce_eager=false data.train_batch_size=${PROMPTS:-16} rollout.n=8
        actor.ppo_mini_batch_size=${PROMPTS:-16} data.max_response_length=128 actor.optim.lr=${LR:-1e-3}
        trainer.total_steps=${STEPS:-20})
fi
B=${BACKEND:-fsdp}
[ "$B" = fsdp ] && [ "${SHAPE:-gpu}" != tiny ] && ARGS+=(backend.liger_kernel=false)
RUN=/tmp/dense_run_$(date +%H%M%S)
# Under a time limit; metrics.jsonl is written every step, so a cut run keeps its steps.
timeout ${LORARL_S:-540} $PY -m recipes.grpo +backend=$B "${ARGS[@]}" model.path="$M" model.builder=null \
  data=token_share trainer.check_sync_probe_freq=1 trainer.logger=[console,jsonl] \
  trainer.val_before_train=false trainer.test_freq=-1 trainer.progress_bar=false hydra.run.dir=$RUN "$@" \
  > "$OUT/$NAME.log" 2>&1
RC=$?
echo "lorarl rc=$RC log=$OUT/$NAME.log"
$PY -m tests.gpu.shape_summary "$RUN" "$OUT/$NAME.json" --log "$OUT/$NAME.log" --rc $RC --model-info "$INFO"
exit $RC
