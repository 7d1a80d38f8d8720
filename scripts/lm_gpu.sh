#!/usr/bin/env bash
# The language-model table on one GPU in one command: prepare the python-stdlib corpus, train every cell of
# recipes/ablations/lm_gpu.yaml with `zoo ablate` (each cell's row is appended to OUT/results.jsonl the moment
# it finishes; the same command again skips the finished cells), render OUT/results.{md,csv,png}, and draw the
# learning curves OUT/curves.{png,csv} (validation bits per byte against training tokens, every cell).
#
#   scripts/lm_gpu.sh [--out DIR] [--dry-run] [--keep-checkpoints] [key.path=value ...]
#
# --out: the table's folder (default tables/lm_gpu). --dry-run: the same pipeline at toy size on the CPU
# (d_model 32, heads of 16, 2 steps of 2 windows of 32 bytes, evaluated after each step and at 64 and 128
# bytes, fp32), so that it cannot rot; tests/zoo/test_lm_gpu.py runs it on a small library tree. Overrides
# go to every zoo command, after the dry run's: task.path=DIR reads another library tree, seeds=[0,1,2]
# adds seeds 1 and 2 to a table of seed 0 (its rows are kept). Each cell checkpoints in OUT/checkpoints
# (about 85 MB per cell with its optimizer state) so that a killed cell resumes; once every cell has its row
# they are removed, unless --keep-checkpoints. Where OUT is copied back from another machine:
#   timeout 570 scripts/lm_gpu.sh --out "$OUT/lm_gpu"; rm -rf "$OUT/lm_gpu/checkpoints"
# PYTHON (default python3) runs the zoo; the corpus is prepared under $ZOO_DATA_DIR (default
# ~/.cache/mixer-zoo/data) unless task.data_dir says otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
RECIPE=recipes/ablations/lm_gpu.yaml
PY="${PYTHON:-python3}"
OUT=tables/lm_gpu
DRY=0
KEEP=0
OVERRIDES=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --out=*) OUT="${1#--out=}"; shift ;;
        --dry-run) DRY=1; shift ;;
        --keep-checkpoints) KEEP=1; shift ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        -*) echo "lm_gpu.sh: unknown option $1 (options: --out DIR, --dry-run, --keep-checkpoints; then key.path=value overrides)" >&2
            exit 2 ;;
        *) OVERRIDES+=("$1"); shift ;;
    esac
done
export PYTHONUNBUFFERED=1

ARGS=()
if [ "$DRY" = 1 ]; then
    ARGS=("name=lm_gpu dry run (toy sizes on the CPU)" model.d_model=32 task.seq_len=32 task.num_test=4 "eval.seq_lens=[64,128]" eval.batch_size=4
          train.tokens=0 train.steps=2 train.warmup_steps=0 train.batch_size=2 train.eval_every=1
          train.precision=fp32 train.device=cpu train.threads=1 train.checkpoint_every=0
          model.mixer_options.attention.n_heads=2 model.mixer_options.kronecker_slots.n_heads=2
          model.mixer_options.mamba2.d_state=16 model.mixer_options.mamba2.headdim=16
          model.mixer_options.ska.n_heads=2 model.mixer_options.ska.rank=16 model.mixer_options.ska.chunk_size=16)
    for m in deltanet deltaproduct gated_deltanet gka gla; do
        ARGS+=("model.mixer_options.$m.n_heads=2" "model.mixer_options.$m.head_dim=16")
    done
    export OMP_NUM_THREADS=1
fi
ARGS+=(${OVERRIDES[@]+"${OVERRIDES[@]}"})

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "+ zoo data prepare $RECIPE"
"$PY" -m zoo data prepare "$RECIPE" --no-progress "${ARGS[@]}"
echo "+ zoo ablate $RECIPE --out $OUT"
status=0
"$PY" -m zoo ablate "$RECIPE" --out "$OUT" --no-progress "${ARGS[@]}" || status=$?
if [ -s "$OUT/results.jsonl" ]; then  # the curves of the finished cells, even when one failed
    "$PY" -m zoo.experiments.curves "$OUT"
fi
if [ "$status" = 0 ] && [ "$KEEP" = 0 ]; then  # every cell has its row: nothing left to resume
    rm -rf "$OUT/checkpoints"
fi
exit "$status"
