"""zoo.benchmark.layer_resources: the blocks a multiprocessor holds follow from registers, shared memory and warps
(hand-worked cases), and the command compiles every distinct launch of a layer at the speed run's sizes into its
markdown block (a real compile, so in a process without ``TRITON_INTERPRET``)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.kernels.harness import compiler_env
from zoo.benchmark.layer_resources import BEGIN, END, blocks_per_sm

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("registers,warps,shared,arch,want", [
    (121, 8, 24 * 1024, 90, (2, "registers")),                     # 128 a thread x 256 threads: two of 65536
    (129, 8, 24 * 1024, 90, (1, "registers")),                     # 136 a thread: one block
    (169, 4, 0, 90, (2, "registers")),                             # 176 a thread (169 unrounded would fit 3)
    (136, 8, 185 * 1024, 90, (1, "registers + shared")),           # 186 KB of 228 with the reserved 1 KB
    (32, 4, 0, 90, (16, "registers + warps")),                     # 16 x 4 warps = 64
    (40, 4, 80 * 1024, 80, (2, "shared")),                         # 164 KB // 81 KB
    (16, 1, 0, 90, (32, "blocks")),
])
def test_blocks_per_sm_worked_cases(registers, warps, shared, arch, want):
    assert blocks_per_sm(registers, warps, shared, arch) == want


_SCRIPT = """
import json, sys
from zoo.benchmark import layer_resources
from zoo.benchmark.launch_table_check import layer_launches
status = layer_resources.main(["jordan", "--T", "256", "--markdown", sys.argv[1]])
measured = {"mixer": "jordan", "T": 256, "d_model": 1024, "head_dim": 128, "dtype": "bf16"}
keys = {launch.on_arch(90).key() for launch in layer_launches(measured)}
print(json.dumps({"status": status, "distinct": len(keys), "names": sorted({k[0] for k in keys})}))
"""


def test_a_layers_kernels_are_compiled_into_the_markdown_block(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"# notes\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    env = compiler_env(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(doc)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["status"] == 0
    text = doc.read_text()
    assert text.startswith("# notes") and text.rstrip().endswith("after") and "\nold\n" not in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| jordan |")]
    assert len(rows) == out["distinct"] > 0
    assert {row[1] for row in rows} == set(out["names"])
    for row in rows:
        warps, registers, shared_kb, blocks = int(row[3]), int(row[4]), float(row[6]), row[7]
        assert registers > 0 and row[-1].rstrip(" |") == "ok"
        # the table's blocks are those of its own columns (shared rounded to 0.1 KB: either side of it)
        options = {blocks_per_sm(registers, warps, int(shared_kb * 1024) + d, 90) for d in (-51, 0, 51)}
        assert any(blocks == f"{n} ({limit})" for n, limit in options), (row, options)
