"""The bookkeeping of an ablation, checked with an executor that returns made-up rows instead of training: a
resumed grid runs exactly its missing cells, once each, a seed's finished row finishes only that seed, failed
cells come back in grid order, only the cells still to run are checked against this machine, a run refused
before its first write leaves no folder behind, and a folder an ablation has locked is refused to zoo train."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from zoo.errors import UserError
from zoo.experiments.ablate import CellsFailed, cells_of, completed_rows, refuse_train_into, run_ablation
from zoo.experiments.executors import Executor, Outcome
from zoo.recipes import resolve
from zoo.rows import append_row, make_row, read_rows

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


class MadeUpRows(Executor):
    """Runs no training: each submitted cell finishes with a row of random numbers, in a shuffled order, or
    fails when its label is in ``failing``."""
    name = "made-up rows"
    local = False

    def __init__(self, rng: random.Random, failing=()):
        super().__init__()
        self.rng, self.failing, self.submitted, self.queue = rng, set(failing), [], []

    def submit(self, index, cell):
        self.submitted.append(cell.recipe.key)
        self.queue.append((index, cell))

    def finished(self):
        self.rng.shuffle(self.queue)
        for index, cell in self.queue:
            if cell.label in self.failing:
                yield Outcome(index, cell, error=f"{cell.label} broke")
            else:
                metrics = {"test_accuracy": self.rng.random(), "steps": 1, "train_seconds": self.rng.random()}
                yield Outcome(index, cell, row=make_row(cell.recipe, cell.label, metrics, cell.overrides))


class RefusingCluster(MadeUpRows):
    def describe(self):
        raise UserError("--address nowhere: cannot connect to a Ray cluster")


def _rng() -> random.Random:
    """Draws that follow the test's torch seed, so that ZOO_TEST_SEED replays them."""
    return random.Random(torch.initial_seed())


def _grid(tmp_path: Path, labels, seeds=None) -> Path:
    path = tmp_path / "grid.yaml"
    lines = [f"extends: {TINY}", "grid:", *(f"  - {{label: {label}, train.lr: {1e-3 * (i + 1)}}}"
                                            for i, label in enumerate(labels))]
    if seeds is not None:
        lines.append(f"seeds: {list(seeds)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_resumed_grid_runs_each_missing_cell_once_and_returns_every_cell_in_grid_order(tmp_path):
    rng = _rng()
    labels = [f"c{i}" for i in range(rng.randint(3, 6))]
    recipe = resolve(_grid(tmp_path, labels, seeds=[0, 1]))
    cells = cells_of(recipe)
    out = tmp_path / "out"
    failing = set(rng.sample(labels, 2))
    with pytest.raises(CellsFailed) as raised:
        run_ablation(recipe, out, plot=False, echo=lambda *_: None, executor=MadeUpRows(rng, failing))
    failed_keys = [c.recipe.key for c in cells if c.label in failing]
    assert [o.cell.recipe.key for o in raised.value.failures] == failed_keys  # grid order, whatever the finish order
    first = read_rows(out / "results.jsonl")
    assert sorted(r["recipe_key"] for r in first) == sorted(c.recipe.key for c in cells if c.label not in failing)

    again = MadeUpRows(rng)
    rows = run_ablation(recipe, out, plot=False, echo=lambda *_: None, executor=again)
    assert sorted(again.submitted) == sorted(failed_keys)  # only the missing cells, each once
    assert [r["recipe_key"] for r in rows] == [c.recipe.key for c in cells]
    assert read_rows(out / "results.jsonl")[:len(first)] == first  # finished rows kept as they were
    assert len(read_rows(out / "results.jsonl")) == len(cells)

    third = MadeUpRows(rng)
    run_ablation(recipe, out, plot=False, echo=lambda *_: None, executor=third)
    assert third.submitted == [] and len(read_rows(out / "results.jsonl")) == len(cells)


def test_a_finished_seed_of_a_cell_finishes_that_seed_only(tmp_path):
    rng = _rng()
    seeds = rng.sample(range(100), 2)
    recipe = resolve(_grid(tmp_path, ["a", "b"], seeds=seeds))
    cells = cells_of(recipe)
    done_cell = rng.choice(cells)
    row = make_row(done_cell.recipe, done_cell.label, {"test_accuracy": rng.random()}, done_cell.overrides)
    assert completed_rows([row], cells) == {done_cell.recipe.key: row}  # the other seeds of its label still run

    changed = resolve(_grid(tmp_path, ["a", "b"], seeds=seeds), ["train.batch_size=8"])
    other = next(c for c in cells_of(changed) if c.label == done_cell.label and c.recipe.seed != done_cell.recipe.seed)
    stale = make_row(other.recipe, other.label, {"test_accuracy": rng.random()}, other.overrides)
    with pytest.raises(UserError, match=rf"cell '{done_cell.label} \(seed {other.recipe.seed}\)'.*train.batch_size"):
        completed_rows([row, stale], cells)


def test_a_resumed_grid_checks_only_its_missing_cells_against_this_machine(tmp_path, monkeypatch):
    rng = _rng()
    recipe = resolve(_grid(tmp_path, ["a", "b", "c"]))
    cells = cells_of(recipe)
    out = tmp_path / "out"
    done = rng.choice(cells)  # say it trained on a machine with a device this one lacks
    out.mkdir()
    append_row(out / "results.jsonl",
               make_row(done.recipe, done.label, {"test_accuracy": rng.random()}, done.overrides))

    def refuse(checked):
        for cell_recipe, where in checked:
            if cell_recipe.key == done.recipe.key:
                raise UserError(f"{where}: train.device=cuda, but this machine has no CUDA device")
    monkeypatch.setattr("zoo.experiments.ablate.refuse_unrunnable", refuse)
    here = MadeUpRows(rng)
    here.local = True
    rows = run_ablation(recipe, out, plot=False, echo=lambda *_: None, executor=here)
    assert sorted(here.submitted) == sorted(c.recipe.key for c in cells if c is not done)
    assert [r["recipe_key"] for r in rows] == [c.recipe.key for c in cells]


def test_a_run_refused_before_its_first_write_leaves_no_folder(tmp_path):
    rng = _rng()
    recipe = resolve(_grid(tmp_path, ["a", "b"]))
    out = tmp_path / "new" / "deeper" / "out"
    with pytest.raises(UserError, match="cannot connect"):
        run_ablation(recipe, out, plot=False, echo=lambda *_: None, executor=RefusingCluster(rng))
    assert not (tmp_path / "new").exists()

    kept = tmp_path / "kept"
    kept.mkdir()
    cell = cells_of(recipe)[0]
    append_row(kept / "results.jsonl", make_row(cell.recipe, cell.label, {"test_accuracy": rng.random()}))
    before = (kept / "results.jsonl").read_bytes()
    with pytest.raises(UserError, match="cannot connect"):
        run_ablation(recipe, kept, plot=False, echo=lambda *_: None, executor=RefusingCluster(rng))
    assert (kept / "results.jsonl").read_bytes() == before
    assert sorted(p.name for p in kept.iterdir()) == [".lock", "results.jsonl"]


def test_zoo_train_refuses_a_folder_an_ablation_is_starting_to_write(tmp_path):
    refuse_train_into(tmp_path)  # an empty folder is free
    (tmp_path / ".lock").write_text(str(_rng().randrange(2, 1 << 22)))  # its lock, before its cells.json
    with pytest.raises(UserError, match="holds an ablation"):
        refuse_train_into(tmp_path)
