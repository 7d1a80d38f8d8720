"""Running ablations and training end to end: where a cell's checkpoint lands when a worker runs in another
folder, rows appended after a line cut short, and what zoo eval says when given an ablation's folder."""
from __future__ import annotations

import json
import os
from pathlib import Path

from zoo.cli import main
from zoo.experiments.ablate import run_ablation
from zoo.experiments.executors import Outcome, SequentialExecutor, run_cell
from zoo.recipes import resolve
from zoo.rows import read_rows

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
FAST = ["train.steps=3", "train.warmup_steps=1", "task.num_test=16", "train.threads=1"]


def _grid(tmp_path: Path) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(f"extends: {TINY}\ngrid:\n  - {{label: a, train.lr: 1.0e-3}}\n  - {{label: b, train.lr: 2.0e-3}}\n")
    return path


class ElsewhereExecutor(SequentialExecutor):
    """Trains each cell from another working directory, as a Ray worker started by `ray start` elsewhere does;
    the driver goes on in its own."""

    def __init__(self, where: Path):
        super().__init__(progress=False, echo=lambda *a: None)
        self.where = where

    def finished(self):
        while self.queue:
            index, cell = self.queue.pop(0)
            here = os.getcwd()
            os.chdir(self.where)
            try:
                row = run_cell(cell, checkpoint_root=self.checkpoint_root)
            finally:
                os.chdir(here)
            yield Outcome(index, cell, row=row)


def test_cells_run_from_another_folder_checkpoint_into_the_ablations_folder(tmp_path, monkeypatch):
    recipe = resolve(_grid(tmp_path), FAST)
    driver, worker = tmp_path / "driver", tmp_path / "worker"
    driver.mkdir()
    worker.mkdir()
    monkeypatch.chdir(driver)
    out = Path("results") / "grid"  # relative, as the default --out is
    run_ablation(recipe, out, plot=False, progress=False, echo=lambda *a: None, executor=ElsewhereExecutor(worker))
    for cell in recipe.cells:
        assert (driver / out / "checkpoints" / cell.recipe.key / "checkpoint.pt").is_file(), cell.label
    assert not (worker / out).exists(), "a cell wrote its checkpoint relative to the worker's folder"


def test_a_row_appended_after_a_line_cut_short_is_kept(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(TINY), "--out", str(run), "--no-progress", *FAST]) == 0
    with open(run / "results.jsonl", "ab") as fh:
        fh.write(b'{"recipe_key": "x", "lab')  # a write cut short by a kill: no line end
    assert main(["eval", str(run), "eval.seq_lens=[32]"]) == 0
    capsys.readouterr()
    damaged = []
    rows = read_rows(run / "results.jsonl", damaged.append)
    assert [r["label"] for r in rows] == ["train", "eval eval.seq_lens=[32]"], rows
    assert len(damaged) == 1 and damaged[0].raw == b'{"recipe_key": "x", "lab\n', damaged


def test_zoo_eval_of_an_ablation_folder_names_its_cells_checkpoints(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["ablate", str(_grid(tmp_path)), "--out", str(out), "--no-plot", "--no-progress", *FAST]) == 0
    capsys.readouterr()
    layout = json.loads((out / "cells.json").read_text())
    assert main(["eval", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for cell in layout["cells"]:
        assert f"{out / 'checkpoints' / cell['key']} ({cell['label']})" in err, err
