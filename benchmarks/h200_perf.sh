#!/usr/bin/env bash
# Issue 5 on one GPU, in one call: (A) which layer layout / XLA flags make an AR step cheapest (Qwen3-8B, prompt 512,
# batch 1, AR and ddtree-64), then (B) the grid with the winner, (C) the sharded path on a 1x1 mesh against (B).
# Usage: benchmarks/h200_perf.sh OUTDIR [TOTAL_SECONDS]    (run from the repo root; PYTHONPATH=. is set here)
# Everything is written under a work directory and packed into OUTDIR/perf.tgz at the end (a device call brings
# back few files); each phase gets what is left of TOTAL_SECONDS (default 560).
set -u
FINAL=${1:?output directory}; DEADLINE=$((SECONDS + ${2:-560}))
OUT=${PERF_WORK:-/tmp/ddtree_perf}
left() { local t=$((DEADLINE - SECONDS - $1)); echo $((t > 20 ? t : 20)); }
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
rm -rf "$OUT"; mkdir -p "$OUT/ab" "$FINAL"
BENCH="python3 -m ddtree_jax.bench models"
AB="--models ${MODEL:-qwen3-8b} --prompts 512 --batches 1 --budgets 64 --key-budgets 64 --methods ar,ddtree --no-breakdown
    --no-hlo --no-profile --no-tree-micro --repeats 3"
DSF=--xla_gpu_enable_dynamic_slice_fusion=true
variants=(
  "stacked-dsf|stacked|$DSF"
  "stacked-dsf-cublas|stacked|$DSF --xla_gpu_enable_triton_gemm=false"
  "unstacked|unstacked|"
)
# the unrolled 36-layer loop compiles for about 1.5 min (AR) to 3 min (ddtree): A/B on AR alone there
only_ar() { [ "$1" = unstacked ] && echo "--methods ar"; }
# SKIP_AB=1 skips phase A; GRID_VARIANT=NAME (one of the variants) forces phase B's configuration
for v in "${variants[@]}"; do
  [ "${SKIP_AB:-0}" = 1 ] && break
  IFS='|' read -r name layout flags <<<"$v"
  echo "=== A/B $name: --layout $layout XLA_FLAGS='$flags'"
  XLA_FLAGS="$flags" timeout 150 $BENCH $AB $(only_ar "$name") --layout "$layout" --time-budget-s 100 --out "$OUT/ab" \
    --results-name "$name.json" 2>&1 | grep -v "^WARNING" | tail -n 12
done
choice=$(python3 - "$OUT/ab" <<'PY'
import json, os, sys
best = None
for f in sorted(os.listdir(sys.argv[1])):
    if not f.endswith(".json") or f == "bench_details.json":
        continue
    recs = json.load(open(os.path.join(sys.argv[1], f)))
    ar = [r["ms_per_round"] for r in recs if r["method"] == "ar"]
    print(f[:-5], [(r["method"], r["budget"], round(r["ms_per_round"], 3)) for r in recs], file=sys.stderr)
    if ar and (best is None or ar[0] < best[1]):
        best = (f[:-5], ar[0])
print(best[0] if best else "unstacked")
PY
)
choice=${GRID_VARIANT:-$choice}
echo "=== chosen: $choice"
for v in "${variants[@]}"; do
  IFS='|' read -r name layout flags <<<"$v"; [ "$name" = "$choice" ] && break
done
echo "$name|$layout|$flags" > "$OUT/choice.txt"
mkdir -p "$OUT/grid" "$OUT/mesh"
echo "=== B grid: --layout $layout XLA_FLAGS='$flags'"
GRID_S=$(left 190)
# the tree micro-benchmarks take minutes (3.5 on the H200): TREE_MICRO=1 includes them
XLA_FLAGS="$flags" timeout $((GRID_S + 60)) $BENCH --models ${GRID_MODELS:-qwen3-8b,qwen3-4b} --layout "$layout" \
  $([ "${TREE_MICRO:-0}" = 1 ] || echo --no-tree-micro) --breakdown-first-only --compile-cache /tmp/ddtree_jit --time-budget-s "$GRID_S" --out "$OUT/grid" \
  --results-name h200.json 2>&1 | grep -v "^WARNING" | tail -n 45
echo "=== C mesh 1x1"
XLA_FLAGS="$flags" timeout $(left 15) $BENCH $AB $(only_ar "$name") --layout "$layout" --mesh 1x1 --compile-cache /tmp/ddtree_jit \
  --time-budget-s $(left 60) --out "$OUT/mesh" --results-name mesh1x1.json 2>&1 | grep -v "^WARNING" | tail -n 6
tar czf "$FINAL/perf.tgz" -C "$OUT" . && ls -la "$FINAL"
