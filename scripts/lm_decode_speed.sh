#!/usr/bin/env bash
# Time per generated token after a 1K- and a 16K-byte prompt, for the seed-0 checkpoint of every cell of
# an ablation run with checkpoints (default tables/lm_bytes, after `zoo ablate recipes/ablations/lm_bytes.yaml
# --out tables/lm_bytes`): `zoo generate` decodes through prefill then step, so a linear-state mixer
# carries a fixed-size state and attention a KV cache that grows with the prompt. Greedy, 64 new tokens,
# one thread; the prompt is Python's own help text (pydoc_data.topics, no download). Prints a Markdown table.
#
#   scripts/lm_decode_speed.sh [TABLE_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
TABLE="${1:-tables/lm_bytes}"
text() { python -c "import pydoc_data.topics as t, sys; sys.stdout.write(''.join(t.topics.values())[:$1])"; }
SHORT="$(text 1024)"
LONG="$(text 16384)"
echo "| cell | ms per token, 1K prompt | ms per token, 16K prompt | 16K / 1K |"
echo "|---|---|---|---|"
python - "$TABLE" <<'PY' | while IFS=$'\t' read -r label key; do
import json, sys
seen = set()
for cell in json.load(open(f"{sys.argv[1]}/cells.json"))["cells"]:
    if cell["label"] not in seen:
        seen.add(cell["label"])
        print(f"{cell['label']}\t{cell['key']}")
PY
  ms() { python -m zoo generate "$TABLE/checkpoints/$key" --prompt "$1" --max-new-tokens 64 --temperature 0 \
           --threads 1 2>/dev/null | sed -n 's/.*tokens\/s, \([0-9.]*\) ms per decoded token.*/\1/p'; }
  a=$(ms "$SHORT"); b=$(ms "$LONG")
  echo "| $label | $a | $b | $(python -c "print(f'{$b / $a:.2f}x')") |"
done
