#!/usr/bin/env bash
# Qwen3-30B-A3B-shaped GRPO steps with expert LoRA synced in memory, CUDA graphs on, the fingerprint
# and the parity probe every step; then TRL's GRPOTrainer on the same model and batch.
# On the GPU machine, from the repo root, after .vllmcarry/install.sh and install-extra.sh:
#   bash tests/gpu/moe_step.sh        (LAYERS=16 STEPS=10 by default; fits one 9-minute call with TRL after it)
# Off the GPU (the same script at CPU size, merged sync, no TRL): SHAPE=tiny bash tests/gpu/moe_step.sh
# Writes to $OUT (default /tmp/moe_out): moe_step.log, moe_step.json (per step: timings and sync
# metrics), and with TRL trl_moe.log, trl_moe.json. Extra Hydra overrides pass through.
set -uo pipefail
OUT=${OUT:-/tmp/moe_out}; mkdir -p "$OUT"
export LORARL_CACHE=${LORARL_CACHE:-/tmp/lcache} PYTHONPATH=$(pwd)/src:$(pwd):${PYTHONPATH:-}
PY=${PYTHON:-python3}
if [ "${SHAPE:-gpu}" = tiny ]; then
  M=$LORARL_CACHE/qwen3_moe_shape_tiny
  $PY -m tests.gpu.moe_shaped_model --tiny --layers 2 --out "$M" || exit 1
  ARGS=(model.dtype=float32 model.lora.merge=true data.train_batch_size=4 rollout.n=4 actor.ppo_mini_batch_size=4
        actor.ppo_micro_batch_size_per_gpu=16 actor.use_dynamic_bsz=false data.max_response_length=8
        model.enable_gradient_checkpointing=false trainer.total_steps=${STEPS:-2})
else
  M=$LORARL_CACHE/qwen3_30b_a3b_l${LAYERS:-16}
  $PY -m tests.gpu.moe_shaped_model --layers "${LAYERS:-16}" --device cuda --out "$M" || exit 1
  ARGS=(model.lora.merge=false rollout.enforce_eager=false rollout.gpu_memory_utilization=0.35
        data.train_batch_size=${PROMPTS:-16} rollout.n=8 actor.ppo_mini_batch_size=${PROMPTS:-16}
        data.max_response_length=128 trainer.total_steps=${STEPS:-10})
fi
RUN=/tmp/moe_run_$(date +%H%M%S)
# Each part under its own time limit (metrics.jsonl is written every step, so a cut run keeps its steps).
timeout ${LORARL_S:-330} $PY -m recipes.grpo +backend=fsdp model=qwen3_30b_a3b model.path="$M" data=arith "${ARGS[@]}" \
  trainer.check_sync_probe_freq=1 trainer.logger=[console,jsonl] trainer.val_before_train=false \
  trainer.test_freq=-1 hydra.run.dir=$RUN "$@" > "$OUT/moe_step.log" 2>&1
RC=$?
echo "lorarl rc=$RC log=$OUT/moe_step.log"
$PY - "$RUN/metrics.jsonl" "$OUT/moe_step.json" "$M" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
keep = ("step", "timing/", "sync/", "perf/", "reward/")
steps = [{k: v for k, v in r.items() if k.startswith(keep)} for r in rows if "sync/kind" in r]
info = json.load(open(sys.argv[3] + "/shaped_model.json"))
# Step 0 is the validation row before training: no sync happened there.
match = [s.get("sync/adapter_match", s.get("sync/weights_match")) for s in steps if s.get("step", 0) >= 1]
json.dump({"model": info, "steps": steps, "all_synced_matched": bool(steps) and all(m == 1.0 for m in match)},
          open(sys.argv[2], "w"), indent=1)
for s in steps:
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()
           if k in ("step", "timing/step", "timing/gen", "timing/train", "timing/sync", "sync/adapter_match",
                    "sync/weights_match", "sync/logprob_diff_max", "sync/seconds")})
PY
if [ "${SHAPE:-gpu}" != tiny ] && [ "${TRL:-1}" = 1 ]; then
  DATA=$(ls "$LORARL_CACHE"/data/arith_*/train.parquet | head -1)
  timeout ${TRL_S:-140} $PY -m torch.distributed.run --standalone --nproc_per_node=1 -m tests.gpu.moe_trl_peer \
    --model "$M" --train-parquet "$DATA" --steps ${TRL_STEPS:-4} --prompts ${PROMPTS:-16} --samples 8 --max-tokens 128 --device cuda --dtype bfloat16 \
    --rank 16 --alpha 32 --lr 1e-5 --beta 0 --micro-batch 32 --vllm-gpu-memory-utilization 0.35 \
    --max-model-len 512 --out "$OUT/trl_moe.json" > "$OUT/trl_moe.log" 2>&1
  echo "trl rc=$? log=$OUT/trl_moe.log"
fi
exit $RC
