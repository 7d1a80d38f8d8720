"""zoo.benchmark.launch_table_check: the committed launch tables (kernels/launch_tables) hold only entries that
match a launch their layer still makes and compile with their options; the check compiles a matching entry with
the table's options and fails an entry whose launcher has changed since it was measured.

The check compiles kernels, so it runs in a process without ``TRITON_INTERPRET``.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from tests.kernels.harness import compiler_env

ROOT = pathlib.Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
from pathlib import Path
from kernels import launch_table
from zoo.benchmark import launch_table_check

folder = Path(sys.argv[1])
measured = {"card": "test card", "commit": "0000000", "mixer": "jordan", "T": 64, "d_model": 32,
            "head_dim": 16, "dtype": "fp32", "launcher_ms": 1.0, "ms": 0.5}
first = launch_table_check.layer_launches(measured)[0]
sixteen, consts = first.config()
name = sorted(consts)[0]
stale = {**consts, name: 12345}
entries = [{"kernel": first.name, "sixteen_bit": sixteen, "constexprs": c, "num_warps": 8, "num_stages": 2,
            "measured": measured} for c in (consts, stale)]
launch_table.merge(90, entries, folder)
synthetic = launch_table_check.main(["--table-dir", str(folder), "--json", str(folder / "synthetic.json")])
committed = launch_table_check.main(["--json", str(folder / "committed.json")])
print(json.dumps({"kernel": first.name, "stale": name, "synthetic": synthetic, "committed": committed}))
"""


def test_committed_tables_hold_and_a_stale_entry_is_caught(tmp_path):
    env = compiler_env(OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    committed = json.loads((tmp_path / "committed.json").read_text())
    assert out["committed"] == 0 and committed["problems"] == [], committed["problems"]
    synthetic = json.loads((tmp_path / "synthetic.json").read_text())
    assert out["synthetic"] == 1 and synthetic["compiled"] == 1
    (problem,) = synthetic["problems"]
    assert f"{out['kernel']} (fp32 tensors;" in problem and f"{out['stale']}=12345" in problem
    assert "matches no launch of the jordan layer any more" in problem and "--write-table" in problem
    # the matching entry compiled with the table's options, not its launcher's
    assert f"{out['kernel']} w=8 s=2: ok" in proc.stderr
