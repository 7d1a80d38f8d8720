#!/usr/bin/env bash
# One command for the owner of a CUDA machine: what runs where, the GPU-marked tests, and a side-by-side
# `zoo bench` of our Triton kernels against flash-attn / mamba-ssm / flash-linear-attention (bf16,
# d_model 1024 and 2048, T = 1K..32K), whose tables are written into BENCHMARKS.md between the
# gpu-bench markers. Install first:  pip install -e ".[test,gpu]"  (a CUDA build of torch).
#
#   scripts/gpu_check.sh              # on a CUDA machine: tests, benchmarks, BENCHMARKS.md
#   scripts/gpu_check.sh --dry-run    # anywhere: print the commands, run zoo doctor, and run the same
#                                     # benchmark pipeline at toy sizes on the CPU into a temporary folder
#                                     # (BENCHMARKS.md is not touched)
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

# ours next to theirs: each pair is the same mixer with two backend values
MIXERS='[{attention: {backend: triton}}, {attention: {backend: flash_attn}},
         {mamba2: {backend: triton}}, {mamba2: {backend: mamba_ssm}},
         {gated_deltanet: {backend: triton}}, {gated_deltanet: {backend: fla}},
         {deltaproduct: {backend: triton}}, {deltaproduct: {backend: fla}},
         {gla: {backend: torch}}, {gla: {backend: fla}},
         {ska: {backend: triton}}, {gka: {backend: triton}}, {jordan: {backend: triton}}]'
SEQ_LENS=1024,4096,16384,32768
D_MODELS="1024 2048"
OUT=results/gpu-check

run() { echo "+ $*"; if [ "$DRY" = 0 ]; then "$@"; fi; }

python -m zoo doctor
if [ "$DRY" = 0 ]; then
    python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device; use --dry-run')"
fi
run python -m pytest -q -m gpu
# (the rest of the suite is the CPU check: Triton through the interpreter on CPU tensors; on this machine
# it runs with CUDA_VISIBLE_DEVICES= python -m pytest)
for d in $D_MODELS; do
    # head dim 128 for the multi-head mixers (the delta-rule Triton kernels take at most 128)
    heads=$(for m in attention deltanet gated_deltanet deltaproduct gla gka; do
                echo -n "model.mixer_options.$m.n_heads=$((d / 128)) "; done)
    run python -m zoo bench --mixers "$MIXERS" --seq-lens "$SEQ_LENS" --batch 1 --dtype bf16 --device cuda \
        --time-limit 60 --no-progress --out "$OUT/d$d" model.d_model="$d" $heads
done

write_table() {  # write_table FILE DIR... : the bench.md of each DIR into FILE's gpu-bench block
    python - "$@" <<'PY'
import pathlib
import sys

from zoo.benchmark.marked_block import write_block
target, dirs = sys.argv[1], sys.argv[2:]
parts = []
for d in dirs:
    body = [line for line in (pathlib.Path(d) / "bench.md").read_text().splitlines() if not line.startswith("# ")]
    parts.append(f"### d_model {pathlib.Path(d).name[1:]}\n" + "\n".join(body))
text = ("Written by `scripts/gpu_check.sh` (zoo bench, bf16, ours next to flash-attn / mamba-ssm / "
        "flash-linear-attention).\n\n" + "\n\n".join(parts))
write_block(target, text, "<!-- gpu-bench:begin -->", "<!-- gpu-bench:end -->")
print(f"wrote the gpu-bench block of {target}")
PY
}

if [ "$DRY" = 0 ]; then
    write_table BENCHMARKS.md $(for d in $D_MODELS; do echo "$OUT/d$d"; done)
else
    # the same pipeline at toy sizes on the CPU (every mixer with its default backend), into a temporary copy
    tmp=$(mktemp -d)
    python -m zoo bench --mixers attention,mamba2,gated_deltanet,deltaproduct,gla,ska,gka,jordan --seq-lens 32 \
        --device cpu --threads 1 --repeats 1 --warmup 0 --no-decode --no-plot --no-progress --out "$tmp/d64" \
        model.d_model=64 > /dev/null
    cp BENCHMARKS.md "$tmp/BENCHMARKS.md"
    write_table "$tmp/BENCHMARKS.md" "$tmp/d64"
    grep -c "^| " "$tmp/BENCHMARKS.md" > /dev/null
    echo "dry run ok: the pipeline wrote a table into $tmp/BENCHMARKS.md"
fi
