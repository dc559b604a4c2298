#!/usr/bin/env bash
# The sync checks against each injected export fault, through the recipe, on the embedded tiny
# models: a clean run first (every sync checked by transport and meaning, two steps), then each fault,
# which must stop the first sync with exit 2 and one line naming the module (docs/sync.md lists the
# faults). Dense faults on the tiny Qwen2, expert_swap on the tiny Qwen3-MoE (adapter sync on a GPU).
# On the GPU machine, from the repo root, after .vllmcarry/install.sh and install-extra.sh (and the
# Megatron wheels for BACKEND=megatron):
#   BACKEND=megatron bash tests/gpu/sync_faults_step.sh          Megatron-Bridge's export, checked
#   bash tests/gpu/sync_faults_step.sh                           FSDP's
# Extra Hydra overrides pass through. Writes $OUT/sync_faults_<backend>.txt (default OUT=/tmp/faults_out):
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
  local dir=/tmp/faults_${B}_$tag t0=$(date +%s)
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
one clean qwen2_tiny null "$@"
for f in gate_up_swap qk_swap scale_x2 missing_module transpose; do one $f qwen2_tiny $f "$@"; done
one moe_clean qwen3_moe_tiny null model.lora.merge=false "$@"
one expert_swap qwen3_moe_tiny expert_swap model.lora.merge=false "$@"
cat "$S"
