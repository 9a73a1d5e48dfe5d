#!/usr/bin/env bash
# Pick a drafter's depth and width by measured end-to-end speed (docs/TRAINING.md, "Depth and width"). Every
# configuration trains on the same data (the target's continuations of the same prompts) for the same number of
# steps, then each drafter is timed at batch 1 on held-out prompts (`bench pair`). Two phases, so each fits in one
# device call:
#   benchmarks/drafter_sweep.sh OUTDIR train [STEPS]     # data once, then each configuration (default 600 steps)
#   benchmarks/drafter_sweep.sh OUTDIR bench [BUDGETS]   # bench pair for every trained drafter (default 32,64)
# Configurations: CONFIGS="name:flags;..." (default below: 1, 2 and 4 layers of the target's MLP width 1536, and 2
# layers of twice that width). Needs the target like train_default_pair.sh; work in $SWEEP (default /root/sweep).
# CHECK=1 adds `bench pair --check` (outputs against AR's, every traced walk replayed on the host; about 1.5x the time).
set -u
case "${1:-}" in -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0;; esac
OUT=${1:?output directory}; PHASE=${2:?train or bench}; ARG=${3:-}
SWEEP=${SWEEP:-/root/sweep}
CONFIGS=${CONFIGS:-"l2:--layers 2;l1:--layers 1;l4:--layers 4;l2w:--layers 2 --intermediate-size 3072"}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/ddtree_jit}
mkdir -p "$OUT" "$SWEEP"
quiet() { tr '\r' '\n' | grep -v -e '^ *$' -e 'it/s\]$' -e 's/it\]$' -e '^WARNING'; }
IFS=';' read -r -a configs <<<"$CONFIGS"
for c in "${configs[@]}"; do
  name=${c%%:*}; flags=${c#*:}; work="$SWEEP/$name"
  if [ "$PHASE" = train ]; then
    mkdir -p "$work"
    first="$SWEEP/${configs[0]%%:*}/data.npz"  # one data set for all: the first configuration makes it
    [ -f "$first" ] && [ ! -f "$work/data.npz" ] && cp "$first" "$work/"
    echo "=== train $name ($flags)"
    # shellcheck disable=SC2086
    python3 -m ddtree_jax.train_draft --target default --out "$work" $flags --block-size 16 --corpus pydoc,stdlib \
      --prompts-per-passage 2 --num-prompts 3000 --self-instruct 0 --max-new-tokens 256 --seq-len 512 --gen-batch 256 \
      --batch 32 --anchors 32 --lr 6e-4 --seed 0 --steps "${ARG:-600}" --save-every 10000 --evals 0 2>&1 \
      | quiet | tail -n 4
    cp "$work/history.jsonl" "$OUT/history_$name.jsonl" 2>/dev/null
  elif [ -f "$work/drafter/model.safetensors" ]; then
    echo "=== bench $name ($flags)"
    python3 -m ddtree_jax.bench pair --draft "$work/drafter" --budgets "${ARG:-32,64}" --prompts 4 \
      --max-new-tokens 64 ${CHECK:+--check} --json "$OUT/sweep_$name.json" 2>&1 | quiet | tail -n 8
  fi
done
ls -la "$OUT"
