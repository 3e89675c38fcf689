#!/usr/bin/env bash
# The GPU check, in four phases (all by default):
#   smoke    every built-in method through the smoke suite on the GPU (plumbing, tiny model);
#   engine   the decode loop against the static-cache engine (`model.generation: static`,
#            transformers' generate with its decoding step compiled into CUDA graphs) on the
#            embedded model: evaluation of the starter's task columns and one step's rollouts;
#            then evaluation under the run's eval_weights / eval_batching against master weights
#            in the protocol's batches, with prompt-lookup drafts (eval_drafts 4) against none,
#            and batches prefilled in groups of rows against one prefill per batch;
#   steps    seconds per step of each method on the embedded model: bf16 autocast over fp32
#            weights (the default), bf16 weights, fp32;
#   signal   `clbench signal` of each method on the embedded model at the start of each
#            starter stage (SIGNAL_STAGES, default "1 2 3"; SIGNAL_BATCHES batches, default 8):
#            is its update aligned with the way to right answers on validation items, before
#            any grid is run;
#   starter  the starter grid (5 methods x 2 seeds) as one `clbench sweep --jobs`, runs sharing
#            the GPU, then the comparison table. A small model on a big GPU is bound by kernel
#            launches, so runs side by side use the GPU far better than one after another.
#
#   benchmarks/gpu_check.sh OUT_DIR [smoke,engine,steps,signal,starter]
#
# Environment: PYTHON (default python3), DEVICE (default cuda), STARTER_SUITE (default starter),
# STARTER_TIMEOUT (seconds for the whole grid, default 3600), STARTER_SEEDS (default "0 1"), STARTER_SETS
# (extra --set overrides for the starter runs, default below), JOBS (runs at once, default 5),
# METHODS (default "sft grpo sdpo sdpo-cot stable-sdpo"; the sweep starts runs in this order, so
# put the slowest first when the time limit is short), STEP_PRECISIONS (the steps phase's
# precisions, comma-separated, default "bfloat16,bfloat16 --no-mixed,float32").
set -uo pipefail
OUT=${1:-runs/gpu-check}
PHASES=${2:-smoke,engine,steps,signal,starter}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
read -r -a METHODS <<<"${METHODS:-sft grpo sdpo sdpo-cot stable-sdpo}"
# fp32 without autocast, as docs/results-starter.md was measured (the default on a GPU is bf16
# autocast over fp32 weights). Evaluation batch 100: one generate call per column.
STARTER_SETS=${STARTER_SETS:-"model.dtype=float32 protocol.decoding.batch_size=100"}
mkdir -p "$OUT"
export COLUMNS=${COLUMNS:-200}  # wide tables in logs
# a private base-row cache: a repeated check evaluates row 0 again instead of reusing an old one
export CLBENCH_BASE_ROWS=${CLBENCH_BASE_ROWS:-$OUT/base-rows}

clbench() { "$PY" -m clbench.cli "$@"; }

status_of() {  # status and wall time of a run directory, from its results.json
    "$PY" - "$1" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1] + "/results.json"))
    c = r["compute"]
    print(r["status"], f"{c['wall_time_s']:.0f}s", f"peak {c.get('peak_memory_bytes') or 0:.3g}B",
          r.get("error") or "")
except FileNotFoundError:
    print("no results")
EOF
}

"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
torch.cuda.get_device_name() if torch.cuda.is_available() else '')"

if [[ $PHASES == *smoke* ]]; then
    echo "== smoke suite on $DEVICE, every method"
    for m in "${METHODS[@]}"; do
        OMP_NUM_THREADS=1 clbench run --suite smoke --method "$m" --device "$DEVICE" \
            --out "$OUT/smoke/$m" >"$OUT/smoke-$m.log" 2>&1 &
    done
    wait
    for m in "${METHODS[@]}"; do echo "smoke $m: $(status_of "$OUT/smoke/$m")"; done
fi

if [[ $PHASES == *engine* ]]; then
    echo "== decode loop against the static-cache engine on $DEVICE"
    "$PY" benchmarks/generation.py "${STARTER_SUITE:-starter}" --compare engine \
        --device "$DEVICE" --columns math,science,tool_use --n 100 | tee "$OUT/engine.md"
    echo "== evaluation settings (eval_weights, eval_batching) and prompt-lookup drafts on $DEVICE"
    "$PY" benchmarks/generation.py "${STARTER_SUITE:-starter}" --compare settings \
        --device "$DEVICE" --columns math,science,tool_use --n 100 --repeats 2 \
        | tee "$OUT/eval-settings.md"
    "$PY" benchmarks/generation.py "${STARTER_SUITE:-starter}" --compare drafts \
        --device "$DEVICE" --columns math,science,tool_use --n 100 --repeats 2 \
        | tee "$OUT/eval-drafts.md"
    echo "== prefill in groups of rows (decoding.PREFILL_TOKENS, chosen on a CPU) on $DEVICE"
    "$PY" benchmarks/generation.py "${STARTER_SUITE:-starter}" --compare prefill \
        --device "$DEVICE" --columns math,science,tool_use --n 100 --repeats 2 \
        | tee "$OUT/eval-prefill.md"
fi

if [[ $PHASES == *steps* ]]; then
    IFS=, read -r -a precisions <<<"${STEP_PRECISIONS:-bfloat16,bfloat16 --no-mixed,float32}"
    for precision in "${precisions[@]}"; do
        echo "== seconds per step, embedded model, --dtype $precision on $DEVICE"
        # shellcheck disable=SC2086  # "bfloat16 --no-mixed" is two words on purpose
        "$PY" benchmarks/step_time.py --device "$DEVICE" --dtype $precision --steps 3 \
            | tee "$OUT/steps-${precision// /}.md"
    done
fi

if [[ $PHASES == *signal* ]]; then
    for stage in ${SIGNAL_STAGES:-1 2 3}; do
        for m in "${METHODS[@]}"; do
            echo "== signal of $m at the start of starter stage $stage on $DEVICE"
            OMP_NUM_THREADS=1 clbench signal --suite "${STARTER_SUITE:-starter}" --method "$m" \
                --stage "$stage" --batches "${SIGNAL_BATCHES:-8}" --device "$DEVICE" --json \
                >"$OUT/signal-$m-stage$stage.json" 2>"$OUT/signal-$m-stage$stage.log"
            "$PY" - "$OUT/signal-$m-stage$stage.json" <<'EOF'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    print("  failed: see the .log beside it"); sys.exit()
show = lambda k: f"{r[k]['mean']:+.3f} [{r[k]['low']:+.3f}, {r[k]['high']:+.3f}]"
print("  alignment", show("alignment"), " adam", show("adam_alignment"),
      " consistency", show("consistency"),
      " forgetting", {k: round(v["mean"], 3) for k, v in r["forgetting_alignment"].items()})
EOF
        done
    done
fi

if [[ $PHASES == *starter* ]]; then
    echo "== starter grid on $DEVICE (${STARTER_SETS})"
    sets=()
    for s in $STARTER_SETS; do sets+=(--set "$s"); done
    started=$(date +%s)
    # Ten runs at once overflowed 140 GB (each process caches 12-23 GB) and three runs died of
    # out-of-memory errors; five at a time, with expandable segments against fragmentation.
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    # One sweep, JOBS runs at once (each a `clbench run` child with its log in starter/logs/).
    # At the time limit `timeout` sends SIGTERM: every run stops cleanly with its completed
    # stages saved, and running this phase again resumes the grid where it stopped.
    methods=$(IFS=,; echo "${METHODS[*]}")
    seeds=$(echo ${STARTER_SEEDS:-0 1} | tr ' ' ,)
    OMP_NUM_THREADS=1 timeout --signal=TERM "${STARTER_TIMEOUT:-3600}" "$PY" -m clbench.cli \
        sweep --suite "${STARTER_SUITE:-starter}" --methods "$methods" --seeds "$seeds" \
        --jobs "${JOBS:-5}" --device "$DEVICE" "${sets[@]}" --out "$OUT/starter" \
        >"$OUT/starter-sweep.log" 2>&1
    echo "sweep exit status $?"
    echo "grid wall time: $(( $(date +%s) - started ))s"
    for d in "$OUT"/starter/*/s*/; do echo "${d%/}: $(status_of "${d%/}")"; done
    clbench report "$OUT/starter" | tee "$OUT/starter-report.txt"
    clbench report --json "$OUT/starter" >"$OUT/starter-report.json"
fi
