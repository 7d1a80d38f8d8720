"""scripts/gpu_variants_ab.py: its dry run takes the GPU code path through the Triton interpreter, so every
variant of the convolution's backward walk, of the slots' read tiles and of BD-LRU's gate destination runs its
kernels; the variants must compute
what the first variant computes (they change tiles and buffers, not the function), and the module constants they
patch are restored afterwards."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import kernels.blockscan.gates as gates
import kernels.shortconv.triton as conv
import kernels.slots.triton as slots
from tests.kernels.harness import needs_triton

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_variants_ab", ROOT / "scripts" / "gpu_variants_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_triton
def test_every_variant_runs_its_kernels_and_computes_the_same_function(tmp_path):
    read_rows, plan_init, empty_grad = slots.READ_ROWS, slots._ChunkPlan.__init__, gates.empty_grad
    walk = (conv._BWD_PROGRAMS, conv._UNROLL, conv._BWD_CHANNELS, conv._BWD_WARPS)
    out = tmp_path / "ab.json"
    assert _script().main(["--dry-run", "--repeats", "1", "--json", str(out), "--mixers", "all"]) == 0
    rows = json.loads(out.read_text())["rows"]
    expected = {name: len(variants) for name, variants in _script().VARIANTS.items()}
    assert {name: sum(r["mixer"] == name for r in rows) for name in expected} == expected
    for row in rows:
        assert "error" not in row, row
        assert row["gap_to_first"] < 1e-5, (row["mixer"], row["variant"], row["gap_to_first"])
        wanted = {"kronecker_slots": "_slots_read_bwd", "bdlru": "_gates_bwd", "gated_deltanet": "_conv_bwd"}[row["mixer"]]
        assert wanted in row["kernels"], sorted(row["kernels"])
    assert (slots.READ_ROWS, slots._ChunkPlan.__init__, gates.empty_grad) == (read_rows, plan_init, empty_grad)
    assert (conv._BWD_PROGRAMS, conv._UNROLL, conv._BWD_CHANNELS, conv._BWD_WARPS) == walk
