"""Ablations: a base recipe plus a grid of overrides, run cell by cell, resumable.

``grid`` is either a mapping ``key.path -> [values]`` (the cartesian product) or a list of override
mappings (explicit cells, each with an optional ``label``); ``seeds: [0, 1, 2]`` runs every cell once
per seed under the same label; :func:`zoo.recipes.resolve` validates every cell before anything runs.
Every finished cell is appended to ``results.jsonl`` at once with its
resolved recipe, its hash, metrics, parameter count, state size, wall time, library versions, device
and seed.

A cell is identified by the hash of its full resolved recipe (``recipe_key``), never by its overrides
alone: running the same command again skips the cells already there, and a changed base recipe or
command-line override is never answered with an old row. Only training rows finish a cell: a ``zoo eval``
row (:func:`zoo.rows.is_eval_row`) never does, whatever its recipe key. A folder holding a finished row for
a cell whose recipe has since changed is refused with the differences named (use another ``--out``); a
refused run changes nothing in the folder: the grid's layout (``cells.json``, which the tables follow) and
the repair of damaged lines are written only after every check passed (the Ray cluster joined included), and a
folder the run created is removed again when it was refused before writing anything. Where the cells train on
this machine (in this process, or on a Ray started here), every cell still to run is first checked against it
(:func:`zoo.preflight.refuse_unrunnable`: device, tracking package, a layer's chosen backend), so a cell that
cannot start here is refused before any cell trains rather than after the cells before it. One process writes a folder at a
time (a lock file, which ``zoo eval --out`` into an ablation folder takes as well); a second one is refused
at once.

Cells run on an executor (:mod:`zoo.experiments.executors`): one after another in this process, or as Ray tasks on
one machine or a cluster. Either way this process is the only writer of ``results.jsonl``: it appends
each row as its cell finishes. A cell that still fails after its retries is listed at the end with its
error; the rows of the other cells are kept, and running the command again runs only what is missing.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from ..config import Cell, Recipe
from ..errors import UserError
from ..paths import probe_writable
from ..preflight import refuse_unrunnable
from ..recipes.plain import recipe_differences
from ..rows import append_row, is_eval_row, read_rows, repair_rows
from ..training.loop import probe_folders
from ..training.stopping import terminate_as_interrupt
from .executors import Executor, SequentialExecutor
from .results import LAYOUT_NAME, render_folder, write_layout

#: files an ablation writes in its folder (each must be writable before the first cell trains)
WRITTEN = ("results.jsonl", "results.md", "results.csv", "results.png", "cells.json", "results.damaged.jsonl")


def check_writable(out_dir: Path) -> None:
    """Refuse, in one line and before any training, a folder the run could not write its results into."""
    for parent in [out_dir, *out_dir.parents]:
        if parent.exists():
            break
    if not parent.is_dir():
        raise UserError(f"--out {out_dir}: {parent} is a file, not a folder; choose another --out")
    if parent == out_dir:
        for name in WRITTEN:  # each is replaced or appended to as a file: a folder (or a pipe) there would fail later
            path = out_dir / name
            if path.exists() and not path.is_file():
                kind = "a folder" if path.is_dir() else "not a regular file"
                raise UserError(f"--out {out_dir}: {path} is {kind}, where the ablation writes its {name} file; "
                                f"move it away or choose another --out")
        targets = [out_dir] + [out_dir / n for n in WRITTEN + ("checkpoints",) if (out_dir / n).exists()]
    else:
        targets = [parent]
    for target in targets:
        if not os.access(target, os.W_OK | (os.X_OK if target.is_dir() else 0)):
            raise UserError(f"--out {out_dir}: {target} is not writable here; fix its permissions or choose "
                            f"another --out")


def holds_ablation(folder: Path) -> bool:
    """Whether ``folder`` holds an ablation: the grid layout ``zoo ablate`` records there (``cells.json``)
    or the lock of one writing there now."""
    return (Path(folder) / LAYOUT_NAME).exists() or (Path(folder) / ".lock").exists()


def refuse_train_into(out_dir: Path) -> None:
    """``zoo train --out`` never writes into an ablation's folder: its row would be read as a cell of the grid."""
    if holds_ablation(out_dir):
        raise UserError(f"zoo train: --out {out_dir} holds an ablation (cells.json), whose results.jsonl rows are "
                        f"its grid's cells; choose another --out, or add this recipe as a cell of the grid and run "
                        f"zoo ablate")


@contextlib.contextmanager
def exclusive(out_dir: Path, who: str = "zoo ablate"):
    """Hold ``out_dir/.lock`` for the run; refuse at once if another process holds it. The lock file holds
    the holder's pid, followed by its command when that is not ``zoo ablate`` (``who``)."""
    check_writable(out_dir)
    probe_writable(out_dir, "--out")  # what permissions do not show: a read-only mount, a full disk
    made = [p for p in [out_dir, *out_dir.parents] if not p.exists()]  # the folders this run creates
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / ".lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise UserError(f"--out {out_dir}: cannot write there ({err.strerror}); choose another --out") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").split(maxsplit=1) or ["unknown"]
            command = holder[1] if len(holder) > 1 else "zoo ablate"
            raise UserError(f"{out_dir}: another {command} (pid {holder[0]}) is writing here; wait for it to "
                              f"finish or choose another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (str(os.getpid()) + ("" if who == "zoo ablate" else f" {who}")).encode(), 0)
        try:
            yield
        except UserError:
            if made:  # refused before it wrote anything: the folders it made go, so nothing is left behind
                _remove_if_only_lock(out_dir, made)
            raise
    finally:
        os.close(fd)  # closing releases the lock


def _remove_if_only_lock(out_dir: Path, made: list[Path]) -> None:
    """Remove ``out_dir`` (and the folders above it in ``made``, this run's own) when it holds nothing but the lock
    file: a run refused before its first write leaves no folder that would read as an ablation's."""
    try:
        if {p.name for p in out_dir.iterdir()} != {".lock"}:
            return
        (out_dir / ".lock").unlink()
        for folder in made:  # innermost first; one another process has written into since stays
            folder.rmdir()
    except OSError:
        pass


@contextlib.contextmanager
def ablation_lock(folder: Path, who: str):
    """Hold ``folder``'s lock (:func:`exclusive`) while ``who`` writes into an ablation's folder; a folder that
    holds no ablation is not locked."""
    if holds_ablation(folder):
        with exclusive(folder, who):
            yield
    else:
        yield


def cells_of(recipe: Recipe) -> list[Cell]:
    """The grid cells of ``recipe``, or the recipe itself as a single cell named ``base``."""
    return recipe.cells or [Cell("base", {}, recipe)]


def row_seed(row: dict):
    """The seed a row ran with (rows of one cell label differ only by it under a recipe's ``seeds``)."""
    return row.get("seed", row.get("recipe", {}).get("seed"))


def cell_name(cell: Cell, cells: list[Cell]) -> str:
    """The cell's label, plus its seed when other cells share the label (a recipe's ``seeds``)."""
    if sum(c.label == cell.label for c in cells) > 1:
        return f"{cell.label} (seed {cell.recipe.seed})"
    return cell.label


def completed_rows(rows: list[dict], cells: list[Cell]) -> dict[str, dict]:
    """Finished training rows by recipe key (the first row of a key; eval rows never finish a cell); raise when
    a cell's label and seed have a row from a different recipe."""
    done: dict[str, dict] = {}
    for row in rows:
        if "recipe_key" in row and not is_eval_row(row):
            done.setdefault(row["recipe_key"], row)
    for cell in cells:
        if cell.recipe.key in done:
            continue
        stale = [r for r in rows if not is_eval_row(r) and r.get("label") == cell.label
                 and row_seed(r) == cell.recipe.seed]
        if stale:
            old = stale[-1]
            diff = recipe_differences(old.get("recipe", {}), cell.recipe.plain)
            why = "; ".join(diff) if diff else "written by an older mixer-zoo without recipe hashes"
            raise UserError(f"cell {cell_name(cell, cells)!r} already has a finished row from a different recipe ({why}); "
                            f"its results would be mixed with the new ones: use another --out folder for the new "
                            f"recipe, or run the recipe and overrides as they were to resume this folder")
    return done


class CellsFailed(Exception):
    """Some cells still failed after their retries; every finished row is kept in ``results.jsonl``."""

    def __init__(self, failures: list, rows: list[dict]):
        self.failures, self.rows = failures, rows
        names = "; ".join(f"{o.cell.label!r} ({o.error})" for o in failures)
        super().__init__(f"{len(failures)} cell{'s' * (len(failures) != 1)} failed: {names}")


def _headline(metrics: dict) -> str:
    """A finished cell's line: its headline metric (``val_bpb`` for a language model) and its training time."""
    name = "val_bpb" if "val_bpb" in metrics else "test_accuracy"
    value = metrics.get(name)
    shown = f"{name}={value:.4f} " if isinstance(value, (int, float)) else ""
    seconds = metrics.get("train_seconds")
    return shown + (f"({seconds:.0f}s" if isinstance(seconds, (int, float)) else "(")


def _append(results_path: Path, row: dict, cell: str) -> None:
    """Append a finished cell's row; a write that fails (a full disk) is refused in one line: the cell's finished
    checkpoint keeps its trained model, so the same command evaluates it again without training it again."""
    try:
        append_row(results_path, row)
    except OSError as err:
        raise UserError(f"{results_path}: cannot append the row of cell {cell!r} "
                        f"({err.strerror or err}); make room or fix the folder, then run the same command again (its "
                        f"checkpoint keeps the trained model: it is evaluated again, not trained again)") from None


def run_ablation(recipe: Recipe, out_dir: Path, title: str = "", progress: bool = True, plot: bool = True,
                 echo=print, executor: Executor | None = None) -> list[dict]:
    """Run (or resume) every cell of ``recipe`` on ``executor`` (default: sequential, in this process).

    Rows are appended to ``results.jsonl`` by this process alone, in the order cells finish; the table
    lists them in grid order. Returns the rows in grid order; raises :class:`CellsFailed` (after
    writing the table of the finished cells) when a cell still fails after its retries.
    """
    cells = cells_of(recipe)
    results_path = out_dir / "results.jsonl"
    where = {cell.recipe.key: f"[{i + 1}/{len(cells)}] {cell_name(cell, cells)}" for i, cell in enumerate(cells)}
    executor = executor or SequentialExecutor(progress=progress, echo=echo)
    with exclusive(out_dir), terminate_as_interrupt():  # a scheduler's SIGTERM stops the run as a Ctrl-C does
        done = completed_rows(read_rows(results_path), cells)  # read only: a refused run writes nothing
        for cell in cells:  # every folder a cell writes, before the first one trains
            if cell.recipe.key not in done:
                probe_folders(cell.recipe, out_dir / "checkpoints" / cell.recipe.key)
        if executor.local:  # cells train on this machine: one that cannot start here is refused before any trains
            source = recipe.source or "recipe"
            refuse_unrunnable([(cell.recipe, f"{source}: grid cell {cell_name(cell, cells)!r}" if recipe.cells
                                else source) for cell in cells if cell.recipe.key not in done])
        todo = [(i, cell) for i, cell in enumerate(cells) if cell.recipe.key not in done]
        failures = []
        executor.echo = echo  # the driver says where messages go
        # a killed cell resumes from its checkpoint; absolute, since a worker (a Ray task on a cluster started
        # with `ray start` in another folder) runs in a working directory of its own
        executor.checkpoint_root = str((out_dir / "checkpoints").absolute())
        executor.on_start = lambda cell: echo(f"{where[cell.recipe.key]}: training")
        with executor:
            # joined before the folder changes: a Ray cluster it cannot reach is refused like any other check
            running_on = executor.describe() if todo else ""
            executor.refuse_unplaceable([cell for _, cell in todo])   # a cell no node can hold: before any launch
            _rows, damaged = repair_rows(results_path)  # every check passed: the folder is this run's now
            for damage in damaged:
                echo(f"{damage.describe()}: moved to {damage.path.with_name('results.damaged.jsonl')}; "
                     f"its cell runs again")
            write_layout(out_dir, title, cells)
            for cell in cells:
                if cell.recipe.key in done:
                    echo(f"{where[cell.recipe.key]}: done already, skipped")
            if todo:
                echo(f"running {len(todo)} cell{'s' * (len(todo) != 1)} on {running_on}")
            for i, cell in todo:
                executor.submit(i, cell)
            for outcome in executor.finished():
                here = where[outcome.cell.recipe.key]
                retried = f", attempt {outcome.attempts}" if outcome.attempts > 1 else ""
                if outcome.row is None:
                    failures.append(outcome)
                    echo(f"{here}: FAILED after {outcome.attempts} attempt{'s' * (outcome.attempts != 1)}: "
                         f"{outcome.error}")
                    continue
                _append(results_path, outcome.row, cell_name(outcome.cell, cells))
                done[outcome.cell.recipe.key] = outcome.row
                echo(f"{here}: {_headline(outcome.row['metrics'])}{retried})")
        rows = [done[cell.recipe.key] for cell in cells if cell.recipe.key in done]
        table = render_folder(out_dir, plot=plot) if rows else ""
    if table:
        echo(table)
    if failures:
        failures.sort(key=lambda o: o.index)
        raise CellsFailed(failures, rows)
    return rows
