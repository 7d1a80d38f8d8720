#!/usr/bin/env bash
# Everything the GPU speed work needs from one CUDA machine, in one command of at most 10 minutes: the
# GPU-marked tests (our kernels; flash-linear-attention's comparisons autotune for minutes and are left to
# scripts/gpu_quick.sh), the speed targets (scripts/gpu_speed.sh) and, where TUNE_SECONDS is set, the launch
# tuning of every mixer's kernels (python -m zoo.benchmark.launch_tune, each mixer in a process of its own, its
# entries written into kernels/launch_tables/), and GKA's solve alone (scripts/gpu_ska_gka_check.py --solve-only:
# its time per token tile, warps, pieces and operand dtype at 16K, and what one 16-bit piece costs in accuracy,
# the data to choose the solve's precision and tile from; at most SOLVE_SECONDS) and, where VARIANT_SECONDS is
# set, the tiling variants of scripts/gpu_variants_ab.py side by side (the short convolution's backward walk on
# the Gated DeltaNet layer; variants-ab.json). Everything lands in one
# archive, OUTDIR/gpu-all.tgz, beside a copy of the speed run's summary.md (OUTDIR: $OUT where set, else
# results/gpu-all):
#
#   ZOO_COMMIT=<commit> scripts/gpu_all.sh     # TEST_SECONDS (120), SPEED_BUDGET (370), TUNE_SECONDS (0),
#                                              # SOLVE_SECONDS (60; the numbers so far are kept),
#                                              # VARIANT_SECONDS (0)
#   scripts/gpu_all.sh --dry-run               # the same pipeline at toy sizes on the CPU
#
# The tuning is off unless TUNE_SECONDS is set: on an H200 at 009bc4a it finished no mixer within 60 + 60 s,
# and the GPU tests, cut at 60 s, had run 45 of their 77; the speed run took 239 s of its 370.
#
# Wheels in .whl/ (the fla-core wheel: flash-linear-attention's kernels) are installed first into a private
# folder. Afterwards, on the machine that keeps the checkout: unpack the archive, copy its launch_tables/*.json
# into kernels/launch_tables/, run python -m zoo.benchmark.launch_table_check, and record bench-gpu-<card>/.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT_DIR="${OUT:-results/gpu-all}"
TEST_SECONDS="${TEST_SECONDS:-120}"
SPEED_BUDGET="${SPEED_BUDGET:-370}"
TUNE_SECONDS="${TUNE_SECONDS:-0}"
SOLVE_SECONDS="${SOLVE_SECONDS:-60}"
VARIANT_SECONDS="${VARIANT_SECONDS:-0}"
export PYTHONUNBUFFERED=1
work="$(mktemp -d)"
mkdir -p "$OUT_DIR" "$work/launch_tables"

if [ "$DRY" = 0 ]; then
    if ls .whl/*.whl > /dev/null 2>&1; then
        site="${TMPDIR:-/tmp}/zoo-gpu-all-site"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            .whl/*.whl && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1
    xdist=""
    python3 -c "import xdist" 2>/dev/null && xdist="-n 6"
    echo "+ pytest -m gpu -k 'not fla' (at most $TEST_SECONDS s)"
    timeout -s INT "$TEST_SECONDS" python3 -m pytest -v -m gpu -k "not fla" $xdist -p no:cacheprovider \
        -p no:benchmark -rfE --tb=short > "$work/gpu-tests.txt" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$work/gpu-tests.txt" | tail -15
    speed=(--budget "$SPEED_BUDGET")
    tune=(--write-table --budget "$TUNE_SECONDS")
    solve=(--solve-only --seq-lens 16384)
else
    speed=(--dry-run)
    tune=(--dry-run jordan --write-table --arch 90 --table-dir "$work/launch_tables")
    solve=(--solve-only --dry-run)
fi

echo "+ gpu_speed ${speed[*]}"
bash scripts/gpu_speed.sh "${speed[@]}" --out "$work" > "$work/gpu-speed.log" 2>&1
echo "gpu_speed: exit status $?"
grep "^gpu_speed:" "$work/gpu-speed.log" | tail -8

if [ "$DRY" = 1 ] || [ "$TUNE_SECONDS" -gt 0 ]; then
    echo "+ launch_tune ${tune[*]}"
    timeout $((TUNE_SECONDS + 60)) python3 -m zoo.benchmark.launch_tune "${tune[@]}" --json "$work/launch_tune.json" \
        > /dev/null 2> "$work/launch-tune.log"
    echo "launch_tune: exit status $?"
    grep "^launch_tune:" "$work/launch-tune.log" | tail -12
    [ "$DRY" = 0 ] && cp kernels/launch_tables/*.json "$work/launch_tables/" 2>/dev/null
else
    echo "launch_tune: not run (TUNE_SECONDS=0)"
fi

if [ "$SOLVE_SECONDS" -gt 0 ]; then
    echo "+ gpu_ska_gka_check ${solve[*]} (at most $SOLVE_SECONDS s)"
    timeout "$SOLVE_SECONDS" python3 scripts/gpu_ska_gka_check.py "${solve[@]}" --json "$work/gka-solve.json" \
        > /dev/null 2> "$work/gka-solve.log"
    echo "gka solve: exit status $? (gka-solve.json)"
fi

if [ "$DRY" = 0 ] && [ "$VARIANT_SECONDS" -gt 0 ]; then
    echo "+ gpu_variants_ab (at most $VARIANT_SECONDS s)"
    timeout $((VARIANT_SECONDS + 30)) python3 scripts/gpu_variants_ab.py --seconds "$VARIANT_SECONDS" \
        --json "$work/variants-ab.json" > "$work/variants-ab.log" 2>&1
    echo "gpu_variants_ab: exit status $?"
    tail -12 "$work/variants-ab.log"
fi

cp "$work"/bench-gpu-*/summary.md "$OUT_DIR/summary.md" 2>/dev/null
tar czf "$OUT_DIR/gpu-all.tgz" -C "$work" .
rm -rf "$work"
echo "gpu_all: wrote $OUT_DIR/gpu-all.tgz"
