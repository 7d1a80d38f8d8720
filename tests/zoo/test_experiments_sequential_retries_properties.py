"""The in-process executor, with training replaced by a stand-in: a cell that fails ``k`` times is tried
``min(k, retries) + 1`` times and finishes exactly when ``k <= retries``; a recipe or machine problem (UserError)
is never retried; cells finish in the order they were submitted; each cell trains with its own thread count and
checkpoint folder, and the process's thread count is restored after it, whether it finished or failed."""
from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from zoo.errors import UserError
from zoo.experiments import executors
from zoo.experiments.ablate import cells_of
from zoo.experiments.executors import SequentialExecutor, make_executor, run_cell
from zoo.recipes import resolve

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def _cells(tmp_path: Path, n: int):
    path = tmp_path / "grid.yaml"
    path.write_text(f"extends: {TINY}\ngrid:\n" + "".join(f"  - {{label: c{i}, train.lr: {1e-3 * (i + 1)}}}\n"
                                                           for i in range(n)))
    return cells_of(resolve(path))


def _stand_in(monkeypatch, failures: dict, kind=RuntimeError):
    """Each cell's run fails ``failures[label]`` times (raising ``kind``), then returns a row."""
    calls: dict[str, int] = {}

    def run(cell, progress=False, checkpoint_root=None):
        calls[cell.label] = calls.get(cell.label, 0) + 1
        if calls[cell.label] <= failures.get(cell.label, 0):
            raise kind(f"{cell.label} attempt {calls[cell.label]} broke")
        return {"label": cell.label}
    monkeypatch.setattr(executors, "run_cell", run)
    return calls


def test_a_cell_is_tried_until_it_finishes_or_its_retries_are_spent(tmp_path, monkeypatch):
    rng = random.Random(torch.initial_seed())
    cells = _cells(tmp_path, 5)
    retries = rng.randint(1, 3)
    failures = {c.label: rng.randint(0, 4) for c in cells}
    edge = rng.sample(cells, 2)  # one finishes at its last attempt, one fails at it
    failures[edge[0].label], failures[edge[1].label] = retries, retries + 1
    calls = _stand_in(monkeypatch, failures)
    executor = make_executor("sequential", retries=retries, progress=False, echo=lambda *_: None)
    for i, cell in enumerate(cells):
        executor.submit(i, cell)
    outcomes = list(executor.finished())
    assert [o.index for o in outcomes] == list(range(len(cells)))  # submission order
    for outcome in outcomes:
        k = failures[outcome.cell.label]
        assert outcome.attempts == calls[outcome.cell.label] == min(k, retries) + 1
        assert len(outcome.errors) == min(k, retries + 1)
        if k <= retries:
            assert outcome.row == {"label": outcome.cell.label} and outcome.error is None
        else:
            assert outcome.row is None and outcome.error.endswith(f"attempt {retries + 1} broke")


def test_a_user_error_is_not_retried(tmp_path, monkeypatch):
    cells = _cells(tmp_path, 2)
    calls = _stand_in(monkeypatch, {cells[0].label: 5}, kind=UserError)
    executor = SequentialExecutor(retries=3, progress=False, echo=lambda *_: None)
    executor.submit(0, cells[0])
    executor.submit(1, cells[1])
    first, second = executor.finished()
    assert first.row is None and first.attempts == 1 == calls[cells[0].label] and "attempt 1 broke" in first.error
    assert second.row is not None and second.attempts == 1


def test_negative_retries_are_refused():
    with pytest.raises(UserError, match="--retries -1"):
        make_executor("sequential", retries=-1)


@pytest.mark.parametrize("fails", [False, True])
def test_a_cell_trains_with_its_threads_and_checkpoint_folder_and_the_thread_count_comes_back(tmp_path, monkeypatch,
                                                                                                fails):
    before = torch.get_num_threads()
    threads = before + 1 + int(torch.randint(0, 3, ()))
    (cell,) = cells_of(resolve(TINY, [f"train.threads={threads}"]))
    seen = {}

    def train(recipe, progress=False, description="", checkpoint_dir=None):
        seen.update(threads=torch.get_num_threads(), checkpoint_dir=checkpoint_dir)
        if fails:
            raise RuntimeError("diverged")
        return SimpleNamespace(metrics={"test_accuracy": 0.5, "device": "cpu"}, history=[])
    monkeypatch.setattr(executors.loop, "train", train)
    monkeypatch.setattr(executors, "untrained_metrics", lambda recipe: {})
    try:
        if fails:
            with pytest.raises(RuntimeError, match="diverged"):
                run_cell(cell, checkpoint_root=str(tmp_path))
        else:
            row = run_cell(cell, checkpoint_root=str(tmp_path))
            assert row["recipe_key"] == cell.recipe.key and row["metrics"]["test_accuracy"] == 0.5
        assert seen == {"threads": threads, "checkpoint_dir": tmp_path / cell.recipe.key}
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
