#!/usr/bin/env bash
# --tree-budget auto on one GPU (docs/ADAPTIVE.md), in one call of under 9 minutes per part.
# Usage: benchmarks/auto_h200.sh OUTDIR PART [LOAD_BENCH_FLAGS...]   (from the repo root; PYTHONPATH=. is set here;
#        the flags go to load_bench.py in the parts that run it, e.g. --py-spy 1,32)
#   PART 8b    serve random:qwen3-8b --max-batch 32: ar and ddtree (auto) at concurrency 1,2,4,8,16,32,64
#              (4 requests a client, at least 8, 64 tokens each, prompt 128: the levels are cut to fit), both
#              servers up at once (--interleave: each level on each in turn, so a GPU's drift between servers run
#              minutes apart stays out of the ratios), after every program compiled; start-up to /health on an
#              empty cache (both servers starting at once); then ddtree's second start, alone, on the persistent
#              compilation cache the first filled. Two Qwen3-8B servers need an H200: on an H100 80GB each one's
#              0.45 of the memory (load_bench --interleave) runs out while it starts (2026-12-08).
#              -> OUTDIR/load_8b/summary.md (the issue's first target table), OUTDIR/load_8b/restart/run.json
#   PART 8b-dflash  the same for ar and dflash (auto), without the second start -> OUTDIR/load_8b_dflash/summary.md
#   PART pair  the default pair (its converted target must be in $DDTREE_JAX_CACHE, default ~/.cache/ddtree_jax):
#              bench pair at batch 1 on 8 held-out prompts, 128 tokens, ar / dflash / ddtree 16..256 / auto (on a
#              fresh machine mostly compilation: about 4 minutes); the cost of a lax.switch over the forms in the
#              round loop (benchmarks/switch_cost.py, Qwen3-8B). -> OUTDIR/pair.json, OUTDIR/switch/switch_cost.json
#   PART pair-load  serve the default pair under load on held-out prompts: ar, ddtree 16 and 32 at concurrency
#              1,4,16,32 (32 requests a client: levels of several seconds, past the first steps' transients), each
#              after every program compiled and timed, each server's steps logged (CONFIG.steps.jsonl:
#              benchmarks/step_summary.py) -> OUTDIR/load_pair/summary.md (about 7 minutes on an H100)
#   PART pair-load-auto  the same for ddtree --tree-budget auto alone, whose 33 programs take about 3.5 minutes to
#              compile and time on an H100 (too long to share pair-load's call): run it next, on the same machine
#              -> OUTDIR/load_pair_auto/summary.md
#   PART calls what a device call of generate's auto loop costs (benchmarks/auto_overhead.py, random weights of the
#              default pair's shape, a tree of 32, 256 tokens): auto in groups of 8 rounds and in growing groups, each
#              at the switch interval auto sets (autorun.HANDOFF_S) and at CPython's 5 ms, against the fixed budget's
#              one call -> OUTDIR/calls.json (about 3 minutes)
# The parts that start servers (8b, 8b-dflash, pair-load, pair-load-auto) need the server's packages (starlette, uvicorn,
# sse-starlette: pip install -e .); a machine without them stops at once with one line naming them.
set -u
OUT=${1:?output directory}; PART=${2:?part: 8b, 8b-dflash, pair, pair-load, pair-load-auto or calls}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
case "$PART" in
  8b|8b-dflash)
    if [ "$PART" = 8b ]; then methods=ar,ddtree; dir=load_8b; else methods=ar,dflash; dir=load_8b_dflash; fi
    python3 benchmarks/load_bench.py "$OUT/$dir" --target random:qwen3-8b --methods $methods \
      --max-batch 32 --concurrency 1,2,4,8,16,32,64 --requests-per-client 4 --min-requests 8 --max-tokens 64 \
      --prompt-len 128 --wait-compiled 250 --interleave --time-limit 430 "${@:3}"
    if [ "$PART" = 8b ]; then  # a second start: every program from the compilation cache the run above filled
      python3 benchmarks/load_bench.py "$OUT/$dir/restart" --target random:qwen3-8b --methods ddtree \
        --max-batch 32 --concurrency 1 --max-tokens 64 --prompt-len 128 --cache-dir "$OUT/$dir/cache" \
        --wait-compiled 60 --time-limit 100
    fi
    rm -rf "$OUT/$dir/cache/jit"  # the compilation cache: too many files to bring back from a device call
    ;;
  pair)
    timeout 360 python3 -m ddtree_jax.bench pair --prompts 8 --max-new-tokens 128 \
      --budgets 16,32,64,128,256,auto --json "$OUT/pair.json" 2>&1 | grep -v "^WARNING" | tail -n 12
    timeout 120 python3 benchmarks/switch_cost.py "$OUT/switch" --shape qwen3-8b --forms ar,chain,16,64,256 \
      --form 64 --batch 1 --prompt-len 512 2>&1 | tail -n 3
    ;;
  pair-load|pair-load-auto)
    if [ "$PART" = pair-load ]; then methods=ar,ddtree:16,ddtree:32; dir=load_pair; else methods=ddtree; dir=load_pair_auto; fi
    python3 benchmarks/load_bench.py "$OUT/$dir" --target default \
      --methods $methods --max-batch 32 --concurrency 1,4,16,32 \
      --requests-per-client 32 --min-requests 32 --max-tokens 128 --wait-compiled 300 --time-limit 540 --step-logs \
      "${@:3}"
    rm -rf "$OUT/$dir/cache/jit"  # the compilation cache: too many files to bring back from a device call
    ;;
  calls)
    timeout 230 python3 benchmarks/auto_overhead.py --model smollm2-135m --budget 32 --tokens 256 --reps 2 \
      --variant g8:forms=32,max=8 --variant g8-5ms:forms=32,max=8,si=0.005 --variant grow:forms=32 \
      --variant grow-5ms:forms=32,si=0.005 --json "$OUT/calls.json" 2>&1 | grep -Ev '^(W|I|E)[0-9]' | tail -n 5
    ;;
  *) echo "unknown part $PART (8b, 8b-dflash, pair, pair-load, pair-load-auto or calls)" >&2; exit 2 ;;
esac
