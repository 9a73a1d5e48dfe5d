#!/usr/bin/env bash
# Train the default pair's drafter (SmolLM2-135M-Instruct) on one GPU in one device call, and bring back its record.
#
# Usage: OUT=DIR benchmarks/train_default_pair.sh [train_draft flags, e.g. --init DRAFTER_DIR]
#        benchmarks/train_default_pair.sh --help        (this text)
#
# One `python -m ddtree_jax.train_draft` run, boxed to $MINUTES (default 8.75) from its start: the target converted
# from $DDTREE_JAX_CACHE/gguf/SmolLM2-135M-Instruct.Q4_1.gguf (place it there: no network is needed), curated prompts
# (about 58% Python passages, the rest self-instruct turns) and the target's responses (three quarters greedy, the
# rest sampled) for up to $DATA_MINUTES (default 3.3), training with KL to the target's distribution and anchors
# weighted to the start of each response (half-life 128 tokens) to the time left (the learning-rate schedule planned
# to end with it), held-out evaluations with the real decode loop, export.
# $OUT then holds (6 files, about 17 MB): config.json + model.safetensors.part00, part01 (the drafter, joined by
# `training.export.load` or `cat`), history.jsonl, run.json (data counts, generation and training tokens/s, steps,
# times, evaluations), log.txt (the run's messages, progress bars left out).
# SIGTERM/SIGINT: the run stops at its next step and writes what exists. Extra flags override the recipe's; pass
# --init DIR (a previous $OUT or any drafter directory) to continue from an earlier session's drafter (with --lr 3e-4
# --warmup 30 its first steps on new data lose less ground than at the recipe's 6e-4: docs/TRAINING.md). Work files
# (data, checkpoints, the compilation cache) stay in $WORK (default /tmp/ddtree_train): a second call on the same
# machine resumes from them.
set -u
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
OUT=${OUT:-$PWD/out}; WORK=${WORK:-/tmp/ddtree_train}; MINUTES=${MINUTES:-8.75}; DATA_MINUTES=${DATA_MINUTES:-3.3}
mkdir -p "$OUT" "$WORK"
cd "$(dirname "$0")/.." || exit 1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$WORK/jit}
PY=${PYTHON:-python3}
"$PY" -m ddtree_jax.train_draft --target default --out "$WORK" --results "$OUT" --time-limit "$MINUTES" \
  --data-minutes "$DATA_MINUTES" --corpus pydoc,stdlib,packages --self-instruct 12000 --max-prompt-tokens 256 \
  --max-new-tokens 1024 --greedy-share 0.75 --temperatures 0.7,1.0 --gen-batch 1024 --loss kl \
  --layers 2 --block-size 16 --steps 20000 --batch 16 --seq-len 2048 --anchors 512 --anchor-group 32 \
  --anchor-half-life 128 --lr 6e-4 --warmup 100 --evals 4 --eval-budget 64 --eval-tokens 128 --save-every 500 "$@" \
  > >(tr '\r' '\n' | grep --line-buffered -v -E -e '\[[0-9:]+(<[0-9:?]+)?, .*\]$' -e '^ *$' > "$OUT/log.txt") 2>&1 &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null' TERM INT
wait "$pid"; rc=$?
while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done  # a trapped signal ends the first wait early
sleep 1  # the log filter's last lines
tail -n 25 "$OUT/log.txt"
exit "$rc"
