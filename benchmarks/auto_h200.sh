#!/usr/bin/env bash
# --tree-budget auto on one GPU (docs/ADAPTIVE.md), in one call of under 9 minutes per part.
# Usage: benchmarks/auto_h200.sh OUTDIR PART        (from the repo root; PYTHONPATH=. is set here)
#   PART 8b    serve random:qwen3-8b --max-batch 32: ar, dflash (auto) and ddtree (auto) at concurrency 1,2,4,8,16,32,64
#              (2 requests a client, at least 4, 64 tokens each, prompt 128: the levels are cut to fit), each after
#              every program compiled; start-up to /health on an empty cache, and ddtree's second start on the
#              persistent compilation cache. -> OUTDIR/load_8b/summary.md (the first target table)
#   PART pair  the default pair (its converted target must be in $DDTREE_JAX_CACHE, default ~/.cache/ddtree_jax):
#              bench pair at batch 1 on 8 held-out prompts, 128 tokens, ar / dflash / ddtree 16..256 / auto;
#              serve under load on held-out prompts: ar, ddtree 16, 32, 64 and auto at concurrency 1,4,16,32;
#              the cost of a lax.switch over the forms in the round loop (benchmarks/switch_cost.py, Qwen3-8B).
#              -> OUTDIR/pair.json, OUTDIR/load_pair/summary.md, OUTDIR/switch/switch_cost.json
set -u
OUT=${1:?output directory}; PART=${2:?part: 8b or pair}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
case "$PART" in
  8b)
    python3 benchmarks/load_bench.py "$OUT/load_8b" --target random:qwen3-8b --methods ar,dflash,ddtree \
      --max-batch 32 --concurrency 1,2,4,8,16,32,64 --requests-per-client 2 --min-requests 4 --max-tokens 64 \
      --prompt-len 128 --wait-compiled 200 --restart ddtree --time-limit 400
    ;;
  pair)
    timeout 200 python3 -m ddtree_jax.bench pair --prompts 8 --max-new-tokens 128 \
      --budgets 16,32,64,128,256,auto --json "$OUT/pair.json" 2>&1 | grep -v "^WARNING" | tail -n 12
    python3 benchmarks/load_bench.py "$OUT/load_pair" --target default \
      --methods ar,ddtree:16,ddtree:32,ddtree:64,ddtree --max-batch 32 --concurrency 1,4,16,32 \
      --requests-per-client 2 --min-requests 8 --max-tokens 128 --wait-compiled 60 --time-limit 250
    timeout 90 python3 benchmarks/switch_cost.py "$OUT/switch" --shape qwen3-8b --forms ar,chain,16,64,256 \
      --form 64 --batch 1 --prompt-len 512 2>&1 | tail -n 3
    ;;
  *) echo "unknown part $PART (8b or pair)" >&2; exit 2 ;;
esac
