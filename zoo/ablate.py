"""Ablations: a base recipe plus a grid of overrides, run cell by cell, resumable.

``grid`` is either a mapping ``key.path -> [values]`` (the cartesian product) or a list of override
mappings (explicit cells, each with an optional ``label``). Every finished cell is appended to
``results.jsonl`` at once with its resolved recipe, metrics, parameter count, state size, wall time,
library versions, device and seed; running the same command again skips the cells already there, so an
interruption loses at most the cell in flight.
"""
from __future__ import annotations

import copy
import itertools
import json
import platform
import subprocess
import warnings
from pathlib import Path

import torch

from .recipes import RecipeError, recipe_from_dict, to_plain
from .results import append_row, read_rows, render


def expand_grid(grid) -> list[tuple[str, dict]]:
    """``[(label, {key.path: value})]`` for every cell of the grid (one empty cell without a grid)."""
    if grid is None:
        return [("base", {})]
    if isinstance(grid, dict):
        if not grid:
            return [("base", {})]
        keys = list(grid)
        for key in keys:
            if not isinstance(grid[key], list) or not grid[key]:
                raise RecipeError(f"grid.{key}: expected a non-empty list of values to try")
        cells = []
        for values in itertools.product(*(grid[k] for k in keys)):
            overrides = dict(zip(keys, values))
            cells.append((" ".join(f"{k.split('.')[-1]}={_short(v)}" for k, v in overrides.items()), overrides))
        return cells
    if isinstance(grid, list):
        cells = []
        for i, cell in enumerate(grid):
            if not isinstance(cell, dict):
                raise RecipeError(f"grid.{i}: expected a mapping of key.path: value overrides")
            cell = dict(cell)
            label = str(cell.pop("label", None) or " ".join(f"{k}={_short(v)}" for k, v in cell.items()) or f"cell{i}")
            cells.append((label, cell))
        labels = [c[0] for c in cells]
        dupes = {x for x in labels if labels.count(x) > 1}
        if dupes:
            raise RecipeError(f"grid: duplicate cell labels {sorted(dupes)}; give each cell a distinct label")
        return cells
    raise RecipeError("grid: expected a mapping of key.path -> list, or a list of override mappings")


def _short(value) -> str:
    if isinstance(value, list):
        return "+".join(map(str, value))
    return str(value)


def cell_key(overrides: dict) -> str:
    return json.dumps(overrides, sort_keys=True)


def environment() -> dict:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("triton", "einops", "fla"):
        try:
            with warnings.catch_warnings():  # fla warns that it falls back to the CPU
                warnings.simplefilter("ignore")
                versions[name] = __import__(name).__version__
        except Exception:
            pass
    try:
        from importlib.metadata import version
        versions["mixer-zoo"] = version("mixer-zoo")
    except Exception:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip()
        if commit:
            versions["git"] = commit
    except Exception:
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return {"versions": versions, "device_name": device}


def plan(base: dict, grid) -> list[tuple[str, dict, object]]:
    """Validate every cell before running any: ``[(label, overrides, recipe)]``."""
    cells = []
    for label, overrides in expand_grid(grid):
        recipe = recipe_from_dict(base, overrides, label=f"grid cell {label!r}:")
        cells.append((label, overrides, recipe))
    return cells


def run_ablation(base: dict, out_dir: Path, title: str = "", progress: bool = True, plot: bool = True, echo=print) -> list[dict]:
    """Run (or resume) every cell of ``base['grid']``; returns the rows in grid order."""
    base = copy.deepcopy(base)
    grid = base.pop("grid", None)
    cells = plan(base, grid)
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.jsonl"
    done = {row["cell_key"]: row for row in read_rows(results_path)}
    from .train import train  # late import keeps `zoo check` light

    for i, (label, overrides, recipe) in enumerate(cells):
        key = cell_key(overrides)
        if key in done:
            echo(f"[{i + 1}/{len(cells)}] {label}: done already, skipped")
            continue
        echo(f"[{i + 1}/{len(cells)}] {label}: training")
        result = train(recipe, progress=progress, description=label)
        row = {"cell_key": key, "label": label, "overrides": overrides, "recipe": to_plain(recipe),
               "seed": recipe.seed, "metrics": result.metrics, "history": result.history,
               **environment()}  # after training: train.threads may have changed the thread count
        append_row(results_path, row)
        done[key] = row
        echo(f"[{i + 1}/{len(cells)}] {label}: test_accuracy={result.metrics['test_accuracy']:.4f} "
             f"({result.metrics['train_seconds']:.0f}s)")
    rows = [done[cell_key(o)] for _, o, _ in cells]
    table = render(rows, out_dir, title=title, plot=plot)
    echo(table)
    return rows
