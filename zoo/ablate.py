"""Ablations: a base recipe plus a grid of overrides, run cell by cell, resumable.

``grid`` is either a mapping ``key.path -> [values]`` (the cartesian product) or a list of override
mappings (explicit cells, each with an optional ``label``); :func:`zoo.recipes.resolve` validates every
cell before anything runs. Every finished cell is appended to ``results.jsonl`` at once with its
resolved recipe, its hash, metrics, parameter count, state size, wall time, library versions, device
and seed.

A cell is identified by the hash of its full resolved recipe (``recipe_key``), never by its overrides
alone: running the same command again skips the cells already there, and a changed base recipe or
command-line override is never answered with an old row. A folder holding a finished row for a cell
whose recipe has since changed is refused with the differences named (use another ``--out``). One
process writes a folder at a time (a lock file); a second one is refused at once.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from .config import Cell, Recipe
from .environment import environment
from .recipes import RecipeError
from .results import append_row, read_rows, render


def recipe_differences(old: dict, new: dict, prefix: str = "", limit: int = 4) -> list[str]:
    """Up to ``limit`` ``"key.path: old -> new"`` lines where two plain recipes differ."""
    out: list[str] = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        path = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += recipe_differences(a, b, path + ".", limit - len(out))
        elif a != b:
            out.append(f"{path}: {a!r} -> {b!r}")
        if len(out) >= limit:
            break
    return out[:limit]


@contextlib.contextmanager
def exclusive(out_dir: Path):
    """Hold ``out_dir/.lock`` for the run; refuse at once if another process holds it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            raise RecipeError(f"{out_dir}: another zoo ablate (pid {holder}) is writing here; wait for it to "
                              f"finish or choose another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def cells_of(recipe: Recipe) -> list[Cell]:
    """The grid cells of ``recipe``, or the recipe itself as a single cell named ``base``."""
    return recipe.cells or [Cell("base", {}, recipe)]


def completed_rows(rows: list[dict], cells: list[Cell]) -> dict[str, dict]:
    """Finished rows by recipe key; raise when a cell's label has a row from a different recipe."""
    done = {row["recipe_key"]: row for row in rows if "recipe_key" in row}
    for cell in cells:
        if cell.recipe.key in done:
            continue
        stale = [r for r in rows if r.get("label") == cell.label]
        if stale:
            old = stale[-1]
            diff = recipe_differences(old.get("recipe", {}), cell.recipe.plain)
            why = "; ".join(diff) if diff else "written by an older mixer-zoo without recipe hashes"
            raise RecipeError(f"cell {cell.label!r} already has a finished row from a different recipe ({why}); "
                              f"its results would be mixed with the new ones: use another --out folder")
    return done


def run_ablation(recipe: Recipe, out_dir: Path, title: str = "", progress: bool = True, plot: bool = True,
                 echo=print) -> list[dict]:
    """Run (or resume) every cell of ``recipe``; returns the rows in grid order."""
    from .train import train  # late import keeps `zoo check` light

    cells = cells_of(recipe)
    results_path = out_dir / "results.jsonl"
    with exclusive(out_dir):
        done = completed_rows(read_rows(results_path), cells)
        for i, cell in enumerate(cells):
            where = f"[{i + 1}/{len(cells)}] {cell.label}"
            if cell.recipe.key in done:
                echo(f"{where}: done already, skipped")
                continue
            echo(f"{where}: training")
            result = train(cell.recipe, progress=progress, description=cell.label)
            row = {"recipe_key": cell.recipe.key, "label": cell.label, "overrides": cell.overrides,
                   "recipe": cell.recipe.plain, "seed": cell.recipe.seed, "metrics": result.metrics,
                   "history": result.history, **environment()}  # after training: train.threads may have changed
            append_row(results_path, row)
            done[cell.recipe.key] = row
            echo(f"{where}: test_accuracy={result.metrics['test_accuracy']:.4f} "
                 f"({result.metrics['train_seconds']:.0f}s)")
        rows = [done[cell.recipe.key] for cell in cells]
        table = render(rows, out_dir, title=title, plot=plot)
    echo(table)
    return rows
