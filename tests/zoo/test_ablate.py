"""Ablations: grids, results.jsonl rows, rendering, and resuming after SIGINT and SIGKILL."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zoo.errors import UserError
from zoo.recipes.grids import expand_grid
from zoo.rows import read_rows

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def test_grid_product_and_explicit_cells():
    cells = expand_grid({"model.layers": [["attention"], ["mamba2"]], "train.lr": [1e-3, 2e-3]})
    assert len(cells) == 4 and len({c[0] for c in cells}) == 4
    cells = expand_grid([{"label": "a", "seed": 1}, {"seed": 2}])
    assert cells == [("a", {"seed": 1}), ("seed=2", {"seed": 2})]
    with pytest.raises(UserError):
        expand_grid([{"label": "x"}, {"label": "x"}])


def _recipe(tmp_path):
    # the first cell is quick; the later ones wait inside the cell (test hook) until their release file
    # exists, so each signal lands inside a cell
    text = TINY.read_text() + f"""imports: [tests.zoo.ray_hooks]
grid:
  - {{label: attention, model.layers: [attention], train.steps: 10}}
  - {{label: mamba2, model.layers: [mamba2], train.steps: 10, description: 'wait-for:{tmp_path / "release2"}'}}
  - {{label: attention+mamba2, model.layers: [attention, mamba2], train.steps: 10,
     description: 'wait-for:{tmp_path / "release3"}'}}
"""
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    return path


def _start(recipe, out):
    # SIGINT back to its default in the child: a test run started in the background (`pytest &`) ignores
    # SIGINT, the child would inherit that, and Python would then not turn SIGINT into KeyboardInterrupt
    return subprocess.Popen([sys.executable, "-m", "zoo", "ablate", str(recipe), "--out", str(out), "--no-progress",
                             "--no-plot"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


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
    (tmp_path / "release2").touch()
    _wait_for_rows(results, len(first) + 1, proc)
    proc.kill()  # SIGKILL: no chance to clean up (the last cell is waiting for its release)
    proc.wait(timeout=60)
    second = read_rows(results)
    assert len(second) == 2 and second[:1] == first, "finished cells were rewritten"

    (tmp_path / "release3").touch()
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


# --------------------------------------------------------------------------------------- executors, locks, stale rows
from zoo.cli import main  # noqa: E402


def _grid(tmp_path, cells, base_text=None, name="grid.yaml"):
    """A copy of tiny.yaml as ``base.yaml`` (editable) and a recipe extending it with explicit ``cells``."""
    base = tmp_path / "base.yaml"
    if not base.exists() or base_text is not None:
        base.write_text(base_text or TINY.read_text())
    path = tmp_path / name
    path.write_text("extends: base.yaml\nimports: [tests.zoo.ray_hooks]\ngrid:\n"
                    + "".join(f"  - {cell}\n" for cell in cells))
    return path


def _one_line_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("zoo: error: "), err
    return lines[0]


def test_changed_override_or_base_recipe_is_never_answered_with_old_rows(tmp_path, capsys):
    recipe = _grid(tmp_path, ["{label: a, train.steps: 2}", "{label: b, train.steps: 3}"])
    out = tmp_path / "out"
    assert main(["ablate", str(recipe), "--out", str(out), "--no-plot", "--no-progress"]) == 0
    capsys.readouterr()
    # a command-line override changes every cell: refused, with the difference named
    assert main(["ablate", str(recipe), "train.lr=1e-3", "--out", str(out), "--no-plot", "--no-progress"]) == 2
    captured = capsys.readouterr()
    line = _one_line_error(captured.err)
    assert "done already" not in captured.out
    assert "train.lr: 0.003 -> 0.001" in line and "another --out" in line, line
    # editing the base recipe file likewise
    _grid(tmp_path, ["{label: a, train.steps: 2}", "{label: b, train.steps: 3}"],
          base_text=TINY.read_text().replace("batch_size: 16", "batch_size: 8"))
    assert main(["ablate", str(recipe), "--out", str(out), "--no-plot", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "train.batch_size: 16 -> 8" in _one_line_error(captured.err)
    assert "done already" not in captured.out
    assert len(read_rows(out / "results.jsonl")) == 2  # nothing appended by the refused runs
    # the unchanged recipe still resumes
    _grid(tmp_path, ["{label: a, train.steps: 2}", "{label: b, train.steps: 3}"], base_text=TINY.read_text())
    assert main(["ablate", str(recipe), "--out", str(out), "--no-plot", "--no-progress"]) == 0
    assert capsys.readouterr().out.count("done already, skipped") == 2


def test_failing_cell_sequential_is_reported_others_kept(tmp_path, capsys):
    recipe = _grid(tmp_path, ["{label: ok1, train.steps: 2}",
                              "{label: bad, train.steps: 2, seed: 4, description: 'fail-always:'}",
                              "{label: ok2, train.steps: 3}"])
    out = tmp_path / "out"
    code = main(["ablate", str(recipe), "--out", str(out), "--no-plot", "--no-progress", "--retries", "1"])
    captured = capsys.readouterr()
    assert code == 1
    assert "zoo: cell 'bad' failed after 2 attempts: ValueError: this cell always fails (test hook)" in captured.err
    assert "bad: attempt 1 failed" in captured.out
    assert [r["label"] for r in read_rows(out / "results.jsonl")] == ["ok1", "ok2"]
    table = (out / "results.md").read_text()
    assert "| ok1 " in table and "| ok2 " in table and "| bad " not in table


def test_executor_flags_are_checked(tmp_path, capsys, monkeypatch):
    recipe = _grid(tmp_path, ["{label: a, train.steps: 2}"])
    assert main(["ablate", str(recipe), "--out", str(tmp_path / "o"), "--address", "auto"]) == 2
    assert "only apply to --executor ray" in _one_line_error(capsys.readouterr().err)
    monkeypatch.setitem(sys.modules, "ray", None)  # Ray not installed: `import ray` raises ImportError
    assert main(["ablate", str(recipe), "--out", str(tmp_path / "o"), "--executor", "ray"]) == 2
    assert 'pip install -e ".[ray]"' in _one_line_error(capsys.readouterr().err)
    assert not (tmp_path / "o" / "results.jsonl").exists()


def test_two_processes_on_one_folder_neither_duplicate_nor_corrupt(tmp_path):
    release = tmp_path / "release"
    recipe = _grid(tmp_path, ["{label: quick, train.steps: 5}",
                              f"{{label: held, train.steps: 5, seed: 4, description: 'wait-for:{release}'}}"])
    out = tmp_path / "out"
    first = _start(recipe, out)
    _wait_for_rows(out / "results.jsonl", 1, first)  # the first process holds the lock, waiting inside cell 2
    assert (out / ".lock").read_text() == str(first.pid)
    second = subprocess.run([sys.executable, "-m", "zoo", "ablate", str(recipe), "--out", str(out), "--no-progress",
                             "--no-plot"], capture_output=True, text=True, timeout=120)
    assert first.poll() is None
    release.touch()
    assert second.returncode == 2
    line = _one_line_error(second.stderr)
    assert f"another zoo ablate (pid {first.pid}) is writing here" in line, line
    assert first.wait(timeout=240) == 0, first.stdout.read()
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["label"] for r in rows) == ["held", "quick"]
