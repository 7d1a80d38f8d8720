"""An ablation's folder holds its grid's cells only: eval rows, rows of zoo train and rows of an earlier,
different grid are listed apart and never counted as seeds; zoo train refuses the folder, zoo eval takes its
lock; a refused zoo ablate writes nothing; the closing message names only the files written."""
from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
from pathlib import Path

import pytest

from zoo import cli
from zoo.cli import main
from zoo.errors import UserError
from zoo.experiments.ablate import cells_of, completed_rows, exclusive
from zoo.experiments.results import LAYOUT_NAME, OTHER_ROWS_HEADING, mean_std, render_folder
from zoo.recipes import resolve
from zoo.rows import append_row, read_rows

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"
STEPS = ["train.steps=3", "train.warmup_steps=1", "task.num_test=16"]
FAST = [*STEPS, "--no-plot", "--no-progress"]


def _grid(tmp_path: Path, lrs=(1e-3, 2e-3)) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(f"extends: {TINY}\ngrid:\n" + "".join(f"  - {{label: c{i}, train.lr: {lr}}}\n"
                                                           for i, lr in enumerate(lrs)))
    return path


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def _sections(out: Path) -> tuple[str, str]:
    """results.md before and after the heading of the other rows ("" when there is none)."""
    text = (out / "results.md").read_text()
    main_part, _, other = text.partition(f"## {OTHER_ROWS_HEADING}")
    return main_part, other


def _table_labels(text: str) -> list[str]:
    """The first column of every body line of the markdown tables in ``text``."""
    lines = [line for line in text.splitlines() if line.startswith("|") and not line.startswith("|--")]
    return [line.split("|")[1].strip() for line in lines if line.split("|")[1].strip() != "cell"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished two-cell ablation with its checkpoints (its folder is copied by each test)."""
    tmp = tmp_path_factory.mktemp("finished")
    recipe = _grid(tmp)
    assert main(["ablate", str(recipe), "--out", str(tmp / "out"), *FAST]) == 0
    return recipe, tmp / "out"


def _copy(finished, tmp_path) -> tuple[Path, Path, dict]:
    recipe, done = finished
    out = tmp_path / "out"
    shutil.copytree(done, out)
    labels = {c["key"]: c["label"] for c in json.loads((out / LAYOUT_NAME).read_text())["cells"]}
    return recipe, out, labels


def test_eval_rows_are_listed_apart_under_the_cell_they_evaluate_never_as_its_seeds(finished, tmp_path, capsys):
    recipe, out, labels = _copy(finished, tmp_path)
    key = random.choice(sorted(labels))
    cell = labels[key]
    trained = read_rows(out / "results.jsonl")
    assert main(["eval", str(out / "checkpoints" / key), "--out", str(out)]) == 0  # its recipe_key is the cell's
    assert main(["eval", str(out / "checkpoints" / key), "eval.seq_lens=[24]", "--out", str(out)]) == 0
    rows = read_rows(out / "results.jsonl")
    assert rows[0]["recipe_key"] in labels and rows[2]["recipe_key"] == key == rows[2]["trained_recipe_key"]
    assert [r["label"] for r in rows[2:]] == [f"{cell} eval", f"{cell} eval eval.seq_lens=[24]"]
    capsys.readouterr()
    assert main(["table", str(out), "--no-plot"]) == 0
    grid_part, other = _sections(out)
    assert "Mean ± sample standard deviation" not in grid_part  # one row per cell: no seed summary
    assert sorted(_table_labels(grid_part)) == sorted(labels.values())
    assert _table_labels(other) == [f"{cell} eval", f"{cell} eval eval.seq_lens=[24]"]
    assert other.count(f"cell {cell!r}") == 2  # the evaluates column names the cell
    csv = (out / "results.csv").read_text().splitlines()
    assert len(csv) == 1 + len(labels) and not any(" eval" in line for line in csv)
    # the cell's own row is the training row, whatever the eval rows measured
    acc = float(next(line for line in grid_part.splitlines() if line.startswith(f"| {cell} ")).split("|")[3])
    assert acc == pytest.approx(next(r for r in trained if r["recipe_key"] == key)["metrics"]["test_accuracy"],
                                abs=1e-4)
    # zoo ablate of the same grid still finds every cell done, and writes the same tables as zoo table
    written = {n: (out / n).read_bytes() for n in ("results.md", "results.csv")}
    assert main(["ablate", str(recipe), "--out", str(out), *FAST]) == 0
    assert capsys.readouterr().out.count("done already, skipped") == len(labels)
    assert {n: (out / n).read_bytes() for n in written} == written


def test_an_eval_row_never_finishes_a_cell():
    recipe = resolve(TINY, [f"seed={random.randrange(100)}"])
    cells = cells_of(recipe)
    eval_row = {"recipe_key": recipe.key, "trained_recipe_key": recipe.key, "label": "eval",
                "recipe": recipe.plain, "seed": recipe.seed, "metrics": {"test_accuracy": random.random()}}
    assert completed_rows([eval_row], cells) == {}
    train_row = {**eval_row, "label": "base"}
    del train_row["trained_recipe_key"]
    later = {**train_row, "metrics": {"test_accuracy": random.random()}}
    assert completed_rows([eval_row, train_row, later], cells) == {recipe.key: train_row}


def _row(key: str, seed: int, label: str = "x", **extra) -> dict:
    return {"recipe_key": key, "label": label, "seed": seed, **extra,
            "recipe": {"seed": seed, "model": {"layers": ["attention"]}, "task": {"seq_len": 16}},
            "metrics": {"test_accuracy": random.random(), "params": 100, "state_size": 10, "steps": 3,
                        "train_seconds": random.random()}}


def test_only_the_grids_first_training_row_of_each_cell_is_a_seed(tmp_path):
    keys = [f"{random.getrandbits(64):016x}" for _ in range(4)]
    a0, a1, b, foreign = keys
    layout = {"title": "t", "cells": [{"key": b, "label": "b"}, {"key": a0, "label": "a"},
                                      {"key": a1, "label": "a"}]}
    (tmp_path / LAYOUT_NAME).write_text(json.dumps(layout))
    rows = [_row(a0, 0), _row(b, 5, "train"), _row(a0, 0, "eval", trained_recipe_key=a0), _row(a1, 1),
            _row(foreign, 2, "base"), _row(b, 5, "train"), _row(a1, 1, "eval seed=1", trained_recipe_key=a0)]
    for row in rows:
        append_row(tmp_path / "results.jsonl", row)
    text = render_folder(tmp_path, plot=False)
    summary = next(line for line in text.splitlines() if line.startswith("| a "))
    mean, std = mean_std([rows[0]["metrics"]["test_accuracy"], rows[3]["metrics"]["test_accuracy"]])
    assert "| 2 (0, 1) " in summary and f"{mean:.4f} ± {std:.4f}" in summary, summary
    grid_part, other = _sections(tmp_path)
    assert "| b " in grid_part and "| 1 (5) " in grid_part
    assert _table_labels(other) == ["eval", "base", "train", "eval seed=1"]  # file order
    assert (tmp_path / "results.csv").read_text().count("\n") == 1 + 3  # the three grid rows
    assert OTHER_ROWS_HEADING in text  # zoo table prints it too


def test_a_different_recipe_in_the_same_folder_is_listed_apart(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["ablate", str(TINY), "--out", str(out), *FAST, "train.batch_size=8"]) == 0  # one cell: base
    first = read_rows(out / "results.jsonl")
    grid = _grid(tmp_path, lrs=(random.choice([1e-3, 4e-3]), 2e-3))
    assert main(["ablate", str(grid), "--out", str(out), *FAST]) == 0
    grid_part, other = _sections(out)
    assert sorted(_table_labels(grid_part)) == ["c0", "c1"]
    assert _table_labels(other) == ["base"] and first[0]["recipe_key"] in other
    assert (out / "results.csv").read_text().count("\n") == 1 + 2


def test_zoo_train_refuses_an_ablation_folder(finished, tmp_path, capsys):
    recipe, out, _labels = _copy(finished, tmp_path)
    before = (out / "results.jsonl").read_bytes()
    assert main(["train", str(recipe), "--out", str(out), *STEPS, "--no-progress"]) == 2
    line = _one_line(capsys)
    assert "holds an ablation (cells.json)" in line and "another --out" in line and "zoo ablate" in line, line
    assert (out / "results.jsonl").read_bytes() == before and not (out / "checkpoint.pt").exists()
    # another folder trains as before
    assert main(["train", str(recipe), "--out", str(tmp_path / "run"), *STEPS, "--no-progress"]) == 0
    assert [r["label"] for r in read_rows(tmp_path / "run" / "results.jsonl")] == ["train"]


def test_zoo_eval_into_an_ablation_folder_holds_its_lock(finished, tmp_path, capsys, monkeypatch):
    _recipe, out, labels = _copy(finished, tmp_path)
    key = random.choice(sorted(labels))
    before = (out / "results.jsonl").read_bytes()
    with exclusive(out):  # a zoo ablate writing there: refused at once
        assert main(["eval", str(out / "checkpoints" / key), "--out", str(out)]) == 2
    line = _one_line(capsys)
    assert f"another zoo ablate (pid {os.getpid()}) is writing here" in line, line
    assert (out / "results.jsonl").read_bytes() == before

    real_append = cli.append_row
    seen = []

    def append_under_lock(path, row):  # while zoo eval appends, the folder is locked to anyone else
        fd = os.open(out / ".lock", os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        with pytest.raises(UserError, match=f"another zoo eval \\(pid {os.getpid()}\\)"):
            with exclusive(out):
                pass
        seen.append(row["label"])
        real_append(path, row)

    monkeypatch.setattr(cli, "append_row", append_under_lock)
    assert main(["eval", str(out / "checkpoints" / key), "eval.seq_lens=[24]", "--out", str(out)]) == 0
    assert seen == [f"{labels[key]} eval eval.seq_lens=[24]"]
    with exclusive(out):  # released afterwards
        pass


def test_a_refused_ablate_writes_nothing(finished, tmp_path, capsys):
    recipe, out, _labels = _copy(finished, tmp_path)
    with open(out / "results.jsonl", "ab") as fh:
        fh.write(b'{"cut short')  # a damaged line: a run that passes its checks would move it aside
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"}
    override = f"train.batch_size={random.choice([4, 8])}"
    assert main(["ablate", str(recipe), override, "--out", str(out), *FAST]) == 2
    assert "already has a finished row from a different recipe" in _one_line(capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"} == before


def test_the_closing_line_names_only_what_was_written(finished, tmp_path, capsys):
    recipe, out, _labels = _copy(finished, tmp_path)
    (out / "results.png").unlink(missing_ok=True)
    assert main(["ablate", str(recipe), "--out", str(out), *FAST]) == 0  # --no-plot
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("results: ") and "results.md" in last and "png" not in last, last
    assert not (out / "results.png").exists()
    assert main(["ablate", str(recipe), "--out", str(out), *STEPS, "--no-progress"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "plot: results.png" in last and (out / "results.png").stat().st_size > 1000, last
