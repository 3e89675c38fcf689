#!/usr/bin/env bash
# glibc's default (dynamic) mmap threshold against one fixed at 128 KiB, side by side and
# alternating: seconds per training step (sft, sdpo) and per evaluation of 16 items (math, tool
# use). A fixed threshold keeps the heap from fragmenting but maps (and zeroes) every block
# above it afresh; docs/performance.md ("Memory with the diagnostics") has the numbers.
#
#   bash benchmarks/heap_threshold.sh [ROUNDS]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
for round in $(seq "${1:-2}"); do
  for mode in default fixed; do
    if [ "$mode" = fixed ]; then export MALLOC_MMAP_THRESHOLD_=131072; else unset MALLOC_MMAP_THRESHOLD_; fi
    echo "== $mode, round $round"
    "$PY" benchmarks/step_time.py --methods sft,sdpo --steps 3 --json 2>/dev/null \
      | "$PY" -c "import json, sys; [print(r['method'], 's/step', round(r['seconds_per_step'], 2)) for r in json.load(sys.stdin)]"
    "$PY" benchmarks/generation.py starter --compare cast --columns math,tool_use --n 16 \
      --repeats 1 2>/dev/null | tail -2
  done
done
