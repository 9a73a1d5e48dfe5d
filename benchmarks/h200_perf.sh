#!/usr/bin/env bash
# The round-cost grid of both Qwen3 shapes on one GPU, in one call (the records of benchmarks/results/h200.json):
# `bench models` at prompts 512 and 2048, batches 1 and 8, ar, dflash and ddtree at every budget, under decode's
# defaults; then the sharded path on a 1x1 mesh (Qwen3-8B, prompt 512, batch 1, ar and ddtree-64) to set against it.
# Usage: benchmarks/h200_perf.sh OUTDIR [TOTAL_SECONDS [BENCH FLAGS...]]   (from the repo root; PYTHONPATH=. is set)
#   BENCH FLAGS go to every `bench models` call, e.g. --tuning add_norm=0 or --layout stacked.
#   GRID_MODELS (default qwen3-8b,qwen3-4b) picks the grid's models; TREE_MICRO=1 adds the tree micro-benchmarks
#   (minutes). Everything is written under a work directory ($PERF_WORK, default /tmp/ddtree_perf) and packed into
#   OUTDIR/perf.tgz at the end (a device call brings back few files); each phase gets what is left of TOTAL_SECONDS
#   (default 560).
set -u
if [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then sed -n '2,10p' "$0" | cut -c3-; exit 0; fi
case "${2:-560}" in *[!0-9]*) echo "error: TOTAL_SECONDS must be a number, not '$2' (see --help)" >&2; exit 2;; esac
FINAL=${1:?output directory (see --help)}; DEADLINE=$((SECONDS + ${2:-560})); shift $(($# < 2 ? $# : 2))
OUT=${PERF_WORK:-/tmp/ddtree_perf}
left() { local t=$((DEADLINE - SECONDS - $1)); echo $((t > 20 ? t : 20)); }
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
rm -rf "$OUT"; mkdir -p "$OUT/grid" "$OUT/mesh" "$FINAL"
BENCH="python3 -m ddtree_jax.bench models"
echo "=== grid $*"
GRID_S=$(left 190)
timeout $((GRID_S + 60)) $BENCH --models "${GRID_MODELS:-qwen3-8b,qwen3-4b}" \
  $([ "${TREE_MICRO:-0}" = 1 ] || echo --no-tree-micro) --breakdown-first-only --compile-cache /tmp/ddtree_jit \
  --time-budget-s "$GRID_S" --out "$OUT/grid" --results-name h200.json "$@" 2>&1 | grep -v "^WARNING" | tail -n 45
echo "=== mesh 1x1 $*"
timeout "$(left 15)" $BENCH --models qwen3-8b --prompts 512 --batches 1 --budgets 64 --key-budgets 64 \
  --methods ar,ddtree --no-breakdown --no-hlo --no-profile --no-tree-micro --repeats 3 --mesh 1x1 \
  --compile-cache /tmp/ddtree_jit --time-budget-s "$(left 60)" --out "$OUT/mesh" --results-name mesh1x1.json "$@" \
  2>&1 | grep -v "^WARNING" | tail -n 6
tar czf "$FINAL/perf.tgz" -C "$OUT" . && ls -la "$FINAL"
