#!/usr/bin/env bash
# Qwen3-30B-A3B-shaped GRPO run whose adapter moves: random weights with the real layer dims, the
# token-share task (data=token_share: a reward a random model can climb), expert + attention LoRA
# synced as an adapter in memory every step, CUDA graphs, the sync checks and the log-prob probe
# every step, 20 steps. Then, optionally (TRL=1), TRL's GRPOTrainer on the same model (arith data).
# On the GPU machine, from the repo root, after .vllmcarry/install.sh and install-extra.sh:
#   bash tests/gpu/moe_step.sh                                  the moving-adapter run
#   TAG=expert_swap bash tests/gpu/moe_step.sh +trainer.sync_fault=expert_swap   an injected fault
# Extra Hydra overrides pass through (after the script's own). TAG names the outputs.
# BACKEND=megatron trains with the Megatron backend (EP=1; two copies of the base: fewer LAYERS).
# Off the GPU (the same script at CPU size, merged sync, 12 steps): SHAPE=tiny bash tests/gpu/moe_step.sh
# Layers: all 48 by default, with one copy of the base (backend.share_base=auto: the trainer's
# weights are views of vLLM's). The bf16 model is 61 GB (57 GiB), so it is written to MODEL_ROOT
# (default /dev/shm, 128 GiB on the GPU machines; their disk has 62 GB free) and vLLM holds it once at
# GPU_UTIL=0.5 (69.9 GiB of an H200: 59.6 GiB of weights and LoRA slots, 6.1 GiB for its profile's
# forward, the rest KV cache), leaving ~65 GiB for the LoRA state (0.2 GiB per layer at rank 16:
# 13.4M LoRA parameters in fp32 with gradients and Adam) and the update's activations. Not yet run at
# 48 layers on an H200. On an H100 (80 GB) all 48 layers trained at rank 8 (tests/gpu_logs/moe/README.md):
#   LAYERS=48 GPU_UTIL=0.80 STEPS=10 bash tests/gpu/moe_step.sh backend.liger_kernel=false rollout.free_cache_engine=false \
#     actor.ppo_max_token_len_per_gpu=2048 actor.log_prob_max_token_len_per_gpu=2048 \
#     +rollout.engine_kwargs.max_num_batched_tokens=2048 model.lora.rank=8
# With two copies (backend.share_base=false) use LAYERS=32
# GPU_UTIL=0.4 (2 x 38.3 GiB of weights, ~35 GiB for the update). On an H100 LAYERS=24 GPU_UTIL=0.55
# ran (33.4 GiB free beside the engine, the update peaked at 7.3 GiB).
# If model build + run exceed one call, build first (it is reused while the machine stays up):
#   python -c "from pathlib import Path; from bench.common import shaped_model as s; s(Path('/dev/shm'), 'qwen3-30b-a3b', device='cuda', token_share=True)"
# Writes to $OUT (default /tmp/moe_out): moe_step[_TAG].log and moe_step[_TAG].json (per step: reward
# mean/std, grad_norm, sync checks, the probe's three numbers, timings; then the verdict: reward
# rose, every sync check passed, adapter effect >= 10x the probe's noise; tests/gpu/shape_summary.py).
set -uo pipefail
OUT=${OUT:-/tmp/moe_out}; mkdir -p "$OUT"
NAME=moe_step${TAG:+_$TAG}
export PYTHONUNBUFFERED=1 LORARL_CACHE=${LORARL_CACHE:-/tmp/lcache} PYTHONPATH=$(pwd)/src:$(pwd):${PYTHONPATH:-}
PY=${PYTHON:-python3}
# The model: bench.common.shaped_model (built once, reused while the machine stays up).
shaped() { $PY -c "from pathlib import Path; from bench.common import shaped_model as s; print(s(Path('$1'), '$2', $3, device='$4', token_share=True))" | tail -1; }
if [ "${SHAPE:-gpu}" = tiny ]; then
  M=$(shaped "$LORARL_CACHE" qwen3-moe-tiny 2 cpu)
  [ -d "$M" ] || exit 1
  # vLLM's CPU build serves no LoRA on MoE layers: merged sync there (docs/moe.md).
  ARGS=(model.dtype=float32 model.lora.merge=true data.train_batch_size=8 rollout.n=8 actor.ppo_mini_batch_size=8
        actor.ppo_micro_batch_size_per_gpu=64 actor.use_dynamic_bsz=false model.enable_gradient_checkpointing=false
        data.max_response_length=16 actor.optim.lr=${LR:-2e-3} trainer.total_steps=${STEPS:-12})
else
  M=$(shaped "${MODEL_ROOT:-/dev/shm}" qwen3-30b-a3b "${LAYERS:-48}" cuda)
  [ -d "$M" ] || exit 1
  # lr 5e-4: on one H100 (24 layers) it moved the probe's adapter effect to 0.99 nats in 14 steps
  # against 0.008 of trainer-vLLM noise (tests/gpu_logs/moe).
  ARGS=(model.lora.merge=false rollout.enforce_eager=false rollout.gpu_memory_utilization=${GPU_UTIL:-0.5}
        data.train_batch_size=${PROMPTS:-16} rollout.n=8 actor.ppo_mini_batch_size=${PROMPTS:-16}
        data.max_response_length=128 actor.optim.lr=${LR:-5e-4} trainer.total_steps=${STEPS:-20})
fi
RUN=/tmp/moe_run_$(date +%H%M%S)
# Under a time limit; metrics.jsonl is written every step, so a cut run keeps its steps.
timeout ${LORARL_S:-540} $PY -m recipes.grpo +backend=${BACKEND:-fsdp} model=qwen3_30b_a3b model.path="$M" model.builder=null \
  data=token_share "${ARGS[@]}" trainer.check_sync_probe_freq=1 trainer.logger=[console,jsonl] \
  trainer.val_before_train=false trainer.test_freq=-1 trainer.progress_bar=false hydra.run.dir=$RUN "$@" \
  > "$OUT/$NAME.log" 2>&1
RC=$?
echo "lorarl rc=$RC log=$OUT/$NAME.log"
$PY -m tests.gpu.shape_summary "$RUN" "$OUT/$NAME.json" --log "$OUT/$NAME.log" --rc $RC --model-info "$M/bench_model.json"
if [ "${SHAPE:-gpu}" != tiny ] && [ "${TRL:-0}" = 1 ]; then
  DATA=$LORARL_CACHE/data/arith_v2_n1024
  $PY -c "from lorarl.data.dataset import ensure_arith_parquet as e; e('$DATA/train.parquet', '$DATA/val.parquet', 1024, 0)"
  timeout ${TRL_S:-140} $PY -m torch.distributed.run --standalone --nproc_per_node=1 -m bench.trl_grpo_worker \
    --model "$M" --train-parquet "$DATA/train.parquet" --steps ${TRL_STEPS:-4} --prompts ${PROMPTS:-16} --samples 8 --max-tokens 128 --device cuda --dtype bfloat16 \
    --rank 16 --alpha 32 --target-modules q_proj,k_proj,v_proj,o_proj --target-parameters mlp.experts.gate_up_proj,mlp.experts.down_proj --lr 1e-5 --beta 0 --micro-batch 32 --vllm-gpu-memory-utilization ${GPU_UTIL:-0.4} \
    --max-model-len 512 --out "$OUT/trl_moe.json" > "$OUT/trl_moe.log" 2>&1
  echo "trl rc=$? log=$OUT/trl_moe.log"
fi
exit $RC
