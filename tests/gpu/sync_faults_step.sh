#!/usr/bin/env bash
# The sync checks against each injected export fault, through the recipe, on the embedded tiny
# models: a clean run first (every sync checked by transport and meaning, two steps), then each fault,
# which must stop the first sync with exit 2 and one line naming the module (docs/sync.md lists the
# faults). Dense faults on the tiny Qwen2, expert_swap on the tiny Qwen3-MoE (adapter sync on a GPU).
# On the GPU machine, from the repo root, after .vllmcarry/install.sh and install-extra.sh (and the
# Megatron wheels for BACKEND=megatron):
#   BACKEND=megatron bash tests/gpu/sync_faults_step.sh          Megatron-Bridge's export, checked
#   bash tests/gpu/sync_faults_step.sh                           FSDP's
# Extra Hydra overrides pass through (PARALLEL=1 runs them all at once: then give each engine a share
# of the card, e.g. rollout.gpu_memory_utilization=0.1). Writes $OUT/sync_faults_<backend>.txt (default OUT=/tmp/faults_out):
# per run its exit code, its error line, and each step's semantic and transport checks, probe and reward.
set -uo pipefail
OUT=${OUT:-/tmp/faults_out}; mkdir -p "$OUT"
B=${BACKEND:-fsdp}
export PYTHONUNBUFFERED=1 LORARL_CACHE=${LORARL_CACHE:-/tmp/lcache} PYTHONPATH=$(pwd)/src:$(pwd):${PYTHONPATH:-}
PY=${PYTHON:-python3}
S=$OUT/sync_faults_$B.txt; : > "$S"
COMMON=(+backend=$B trainer.total_steps=2 trainer.val_before_train=false trainer.test_freq=-1 trainer.progress_bar=false
        rollout.enforce_eager=true trainer.check_sync_probe_freq=1 trainer.logger=[console,jsonl])
one() {  # tag model fault [overrides...]
  local tag=$1 model=$2 fault=$3; shift 3
  local dir=/tmp/faults_${B}_$tag t0=$(date +%s) S=$S.$tag
  timeout ${RUN_S:-240} $PY -m recipes.grpo "${COMMON[@]}" model=$model trainer.sync_fault=$fault hydra.run.dir=$dir "$@" \
    > "$dir.log" 2>&1
  local rc=$?
  echo "== $tag model=$model fault=$fault rc=$rc $(( $(date +%s) - t0 ))s" >> "$S"
  echo "   $(grep -m1 '^error:' "$dir.log" | cut -c1-400)" >> "$S"
  $PY - "$dir/metrics.jsonl" >> "$S" <<'PYEOF'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if os.path.exists(sys.argv[1]) else []
for r in rows:
    get = lambda k: r.get(k, r.get("init/" + k))
    print("   step", r.get("step"), "meaning", get("sync/adapter_meaning"), "match", get("sync/adapter_match"),
          "probe", r.get("sync/logprob_diff_max"), "reward", r.get("reward/mean"))
PYEOF
  if { [ $rc -ne 2 ] && [ "$fault" != null ]; } || { [ $rc -ne 0 ] && [ "$fault" = null ]; }; then tail -40 "$dir.log" >> "$S"; fi
}
runs=(clean:qwen2_tiny:null gate_up_swap:qwen2_tiny:gate_up_swap qk_swap:qwen2_tiny:qk_swap scale_x2:qwen2_tiny:scale_x2
      missing_module:qwen2_tiny:missing_module transpose:qwen2_tiny:transpose moe_clean:qwen3_moe_tiny:null
      expert_swap:qwen3_moe_tiny:expert_swap)
for r in "${runs[@]}"; do
  IFS=: read -r tag model fault <<< "$r"
  extra=(); [ "$model" = qwen3_moe_tiny ] && extra=(model.lora.merge=false)
  if [ "${PARALLEL:-0}" = 1 ]; then one "$tag" "$model" "$fault" "${extra[@]}" "$@" & sleep "${STAGGER_S:-5}"
  else one "$tag" "$model" "$fault" "${extra[@]}" "$@"; fi
done
wait
for r in "${runs[@]}"; do cat "$S.${r%%:*}" >> "$S" && rm -f "$S.${r%%:*}"; done
cat "$S"
