"""Ablations: grids, results.jsonl rows, rendering, and resuming after SIGINT and SIGKILL."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zoo.recipes import RecipeError, expand_grid
from zoo.results import append_row, read_rows

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def test_grid_product_and_explicit_cells():
    cells = expand_grid({"model.layers": [["attention"], ["mamba2"]], "train.lr": [1e-3, 2e-3]})
    assert len(cells) == 4 and len({c[0] for c in cells}) == 4
    cells = expand_grid([{"label": "a", "seed": 1}, {"seed": 2}])
    assert cells == [("a", {"seed": 1}), ("seed=2", {"seed": 2})]
    with pytest.raises(RecipeError):
        expand_grid([{"label": "x"}, {"label": "x"}])


def test_partial_line_is_dropped_and_file_repaired(tmp_path):
    path = tmp_path / "results.jsonl"
    append_row(path, {"a": 1})
    with open(path, "ab") as fh:
        fh.write(b'{"b": 2, "trunc')
    assert read_rows(path) == [{"a": 1}]
    assert path.read_text() == '{"a": 1}\n'


def _recipe(tmp_path):
    # the first cell is quick; the later ones last seconds, so each signal lands inside a cell
    text = TINY.read_text() + """grid:
  - {label: attention, model.layers: [attention], train.steps: 10}
  - {label: mamba2, model.layers: [mamba2], train.steps: 800}
  - {label: attention+mamba2, model.layers: [attention, mamba2], train.steps: 800}
"""
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    return path


def _start(recipe, out):
    return subprocess.Popen([sys.executable, "-m", "zoo", "ablate", str(recipe), "--out", str(out), "--no-progress",
                             "--no-plot"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_rows(path, n, proc, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.read_text().count("\n") >= n:
            return
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise AssertionError(f"no {n} rows after {timeout}s")


def test_kill_and_resume(tmp_path):
    recipe, out = _recipe(tmp_path), tmp_path / "out"
    results = out / "results.jsonl"
    proc = _start(recipe, out)
    _wait_for_rows(results, 1, proc)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode != 0, "SIGINT should have interrupted a cell in flight"
    first = read_rows(results)
    assert len(first) == 1

    proc = _start(recipe, out)
    _wait_for_rows(results, len(first) + 1, proc)
    proc.kill()  # SIGKILL: no chance to clean up
    proc.wait(timeout=60)
    second = read_rows(results)
    assert len(second) == 2 and second[:1] == first, "finished cells were rewritten"

    done = subprocess.run([sys.executable, "-m", "zoo", "ablate", str(recipe), "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("done already, skipped") == len(second)
    lines = results.read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # every line is valid JSON
    assert rows[: len(second)] == second
    assert sorted(r["label"] for r in rows) == sorted({r["label"] for r in rows}), "a cell ran twice"
    assert len(rows) == 3
    table = (out / "results.md").read_text()
    for label in ("attention", "mamba2", "attention+mamba2"):
        assert sum(f"| {label} " in line for line in table.splitlines()) == 1, table
    assert (out / "results.csv").read_text().count("\n") == 4
    assert (out / "results.png").stat().st_size > 1000
    row = rows[0]
    for key in ("recipe", "metrics", "seed", "versions", "device_name"):
        assert key in row
    for key in ("test_accuracy", "params", "state_size", "wall_seconds"):
        assert key in row["metrics"]
