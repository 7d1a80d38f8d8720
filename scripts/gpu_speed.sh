#!/usr/bin/env bash
# The GPU speed targets in one run (python -m zoo.benchmark.gpu_speed; its docstring says what is measured):
# ours next to flash-linear-attention and SDPA, bf16, 420 s of measuring by default, written into
# <parent>/bench-gpu-<card>/ (parent: --out, else $OUT where set, else tables/). Exit status 0 all targets
# met, 1 one missed, 3 some not measured, 2 no CUDA device.
#
#   scripts/gpu_speed.sh [--budget S] [--stages first_call,kernel,layers,lm,fla]   # on a CUDA machine
#   scripts/gpu_speed.sh --dry-run [--out DIR]      # the same pipeline at toy sizes on the CPU (the tests run it)
#   scripts/gpu_speed.sh --check DIR                # the verdicts of a finished folder again
#
# Wheels carried in .whl/ (flash-linear-attention's kernels: the fla-core wheel) are installed first into a
# private folder; ZOO_COMMIT names the commit where the tree travels without its git history.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
case " $* " in
    *" --dry-run "*|*" --check "*) ;;
    *) if ls .whl/*.whl > /dev/null 2>&1; then
           site="${TMPDIR:-/tmp}/zoo-gpu-speed-site"
           "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
               .whl/*.whl && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
       fi ;;
esac
export PYTHONUNBUFFERED=1
exec "$PYTHON" -m zoo.benchmark.gpu_speed "$@"
