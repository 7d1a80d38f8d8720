#!/usr/bin/env bash
# The short form of scripts/gpu_check.sh for a GPU held only a few minutes: the GPU-marked tests (in
# parallel, each under a time limit) and one bf16 `zoo bench` sweep of every Triton kernel next to its
# outside counterpart where one is installed (torch SDPA for attention, flash-linear-attention for the
# delta rules and GLA), written into OUTDIR (default results/gpu-quick): tests.txt, tests-fla.txt,
# bench/bench.{json,md,csv}. The speed targets (ours against flash-linear-attention and SDPA, judged, with
# launches, language models and first calls) are scripts/gpu_speed.sh's.
#
#   scripts/gpu_quick.sh [OUTDIR]   # SEQ_LENS, D_MODEL, BATCH, TEST_SECONDS, FLA_SECONDS, BENCH_SECONDS, WITH_FLA
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-results/gpu-quick}"
SEQ_LENS="${SEQ_LENS:-4096,16384,65536}"
D_MODEL="${D_MODEL:-1024}"
BATCH="${BATCH:-1}"
TEST_SECONDS="${TEST_SECONDS:-170}"
BENCH_SECONDS="${BENCH_SECONDS:-180}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
mkdir -p "$OUT_DIR/bench"

# flash-linear-attention autotunes every kernel at its first call (minutes on a fresh machine), so its
# entries are opt-in: WITH_FLA=1 adds them next to ours.
MIXERS='{attention: {backend: torch}}, {attention: {backend: triton}}, {mamba2: {backend: triton}},
        {gated_deltanet: {backend: triton}}, {deltaproduct: {backend: triton}}, {gka: {backend: triton}},
        {ska: {backend: triton}}, {deltanet: {backend: triton}}, {gla: {backend: torch}},
        {jordan: {backend: triton}}, {bdlru: {backend: triton}}, {kronecker_slots: {backend: triton}}'
[ "${WITH_FLA:-0}" = 1 ] && MIXERS="$MIXERS, {gated_deltanet: {backend: fla}}, {deltaproduct: {backend: fla}},
        {gla: {backend: fla}}"
MIXERS="[$MIXERS]"
# head dim 128 (d_model / 8) for the multi-head mixers, the size the delta-rule Triton kernels take
HEADS=""
for m in attention deltanet gated_deltanet deltaproduct gla gka; do
    HEADS="$HEADS model.mixer_options.$m.n_heads=$((D_MODEL / 128))"
done

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1

xdist=""
python3 -c "import xdist" 2>/dev/null && xdist="-n 12"
tmo=""
python3 -c "import pytest_timeout" 2>/dev/null && tmo="--timeout 150"
# our kernels first, then the outside-library comparisons (flash-linear-attention autotunes at its first
# call, minutes on a fresh machine); SIGINT at each limit, so that pytest still prints the failures of the
# tests that finished
FLA_SECONDS="${FLA_SECONDS:-$((TEST_SECONDS / 3))}"
for part in "not fla:$((TEST_SECONDS - FLA_SECONDS)):tests.txt" "fla:$FLA_SECONDS:tests-fla.txt"; do
    IFS=: read -r select seconds log <<< "$part"
    echo "+ pytest -m gpu -k '$select' $xdist $tmo (at most $seconds s)"
    timeout -s INT "$seconds" python3 -m pytest -v -m gpu -k "$select" $xdist $tmo -p no:cacheprovider \
        -p no:benchmark -rfE --tb=short 2>&1 | tee "$OUT_DIR/$log" | grep -v '^\[gw' | tail -40
done

echo "+ zoo bench d_model $D_MODEL, T = $SEQ_LENS, batch $BATCH, bf16"
timeout "$BENCH_SECONDS" python3 -m zoo bench --mixers "$MIXERS" --seq-lens "$SEQ_LENS" --batch "$BATCH" --dtype bf16 \
    --device cuda --repeats 5 --warmup 1 --time-limit 10 --no-plot --no-progress --out "$OUT_DIR/bench" \
    model.d_model="$D_MODEL" $HEADS 2>&1 | tail -80
