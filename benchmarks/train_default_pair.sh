#!/usr/bin/env bash
# Train the default pair's drafter (docs/DEFAULT_PAIR.md) on one GPU, then measure it on held-out prompts.
# Usage: benchmarks/train_default_pair.sh OUTDIR [MINUTES] [MAX_STEPS] [train_draft flags that override these]
# Needs the target: $DDTREE_JAX_CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf (or network for its download).
# Step 1 makes the data and times 20 steps; step 2 resumes to as many steps as fit in MINUTES (at most MAX_STEPS),
# so the learning-rate schedule ends where the run does, evaluating held-out acceptance every EVAL_EVERY steps
# (default 500) and exporting the best (--keep-best). The drafter is left in $WORK/drafter and copied to OUTDIR.
set -u
OUT=${1:?output directory}; MIN=${2:-4}; MAX_STEPS=${3:-6000}; shift $(($# < 3 ? $# : 3))
WORK=${WORK:-/root/smollm2}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 DDTREE_JAX_LAYOUT=${DDTREE_JAX_LAYOUT:-stacked}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/ddtree_jit}
mkdir -p "$OUT" "$WORK"
save() {  # the drafter (split: a device call returns files of 16 MiB at most), history, run and bench records
  trap - TERM INT
  cp "$WORK/drafter/config.json" "$WORK/history.jsonl" "$WORK/run.json" "$WORK/bench.json" "$OUT/" 2>/dev/null
  if [ -f "$WORK/drafter/model.safetensors" ]; then
    (cd "$OUT" && split -b 12M -d "$WORK/drafter/model.safetensors" model.safetensors.part)
    sha256sum "$WORK/drafter/model.safetensors"
  fi
}
trap 'save; exit 143' TERM INT
TRAIN=(python3 -m ddtree_jax.train_draft --target default --out "$WORK" --layers 2 --block-size 16
  --num-prompts 4000 --prompts-per-passage 4 --max-prompt-tokens 256 --max-new-tokens 320 --seq-len 576
  --gen-batch 128 --batch 32 --anchors 32 --lr 6e-4 --save-every 1000 --seed 0 "$@")
"${TRAIN[@]}" --steps 20 --eval-prompts 0 2>&1 | tee -a "$OUT/raw.log" | tr '\r' '\n' | grep -v -e '^ *$' -e 'it/s\]$' -e 's/it\]$' | tail -n 12
per_step=$(python3 -c "
import json; h = [json.loads(l) for l in open('$WORK/history.jsonl') if 'loss' in l]
print((h[-1]['elapsed_s'] - h[0]['elapsed_s']) / max(1, h[-1]['step'] - h[0]['step']))")
steps=$(python3 -c "print(max(100, min($MAX_STEPS, int(($MIN * 60 - 30) / $per_step) // 100 * 100)))")
echo "=== $per_step s/step: training to step $steps"
"${TRAIN[@]}" --steps "$steps" --time-limit "$MIN" --eval-every "${EVAL_EVERY:-500}" --keep-best --eval-prompts 8 --eval-budget 32 \
  --eval-tokens 64 --bench-budgets "${BENCH_BUDGETS:-16,32,64,128,256}" --bench-prompts 8 --bench-tokens 128 2>&1 | tee -a "$OUT/raw.log" \
  | tr '\r' '\n' | grep -v -e '^ *$' -e 'it/s\]$' -e 's/it\]$' | tail -n 25
save  # (also on SIGTERM/SIGINT, e.g. a device call's time limit: whatever exists by then comes back)
