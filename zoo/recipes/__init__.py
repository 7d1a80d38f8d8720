"""Recipes: load, extend, override and validate YAML recipes — in one pass, :func:`resolve`.

Everything that reads a recipe (``zoo check``, ``train``, ``ablate`` and each of its grid cells,
``bench``, ``eval`` and the Python API) calls :func:`resolve`, which goes ``extends`` -> overrides ->
validation exactly once and returns a :class:`zoo.config.Recipe`: typed sections, a validated spec per
layer, the plain resolved dict and its stable hash. Its rooms:

- :mod:`.loading`: recipe files read safely (``yaml.safe_load``, sizes, duplicate keys), the ``file:line``
  of every key, and ``extends`` chains merged;
- :mod:`.overrides`: ``key.path=value`` overrides, from the command line or a grid cell;
- :mod:`.validation`: the strict check of a merged mapping into a :class:`zoo.config.Recipe`;
- :mod:`.grids`: a ``grid`` expanded into labelled cells, crossed with ``seeds``;
- :mod:`.plain`: the plain (JSON) form of a resolved recipe, its differences, a layer's label.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Mapping

from ..config import Cell, Recipe
from ..errors import UserError
from .grids import cross_seeds, expand_grid
from .loading import Source, check_size, load_raw
from .overrides import apply_override, key_path, parse_override
from .validation import Places, import_modules, validate


def _overridden(data: dict, overrides) -> dict:
    """Apply ``overrides`` (strings or a mapping) to ``data``; ``{key path: the label that blames it}``."""
    items = overrides.items() if isinstance(overrides, Mapping) else [parse_override(t) + (t,) for t in overrides]
    override_paths = {}
    for item in items:
        if isinstance(overrides, Mapping):
            key, value = item
            path, label = key_path(key), f"override {key}={value!r}"
        else:
            path, value, text = item
            label = f"override {text!r}"
        apply_override(data, path, copy.deepcopy(value), label)
        override_paths[tuple(path)] = label
    return override_paths


def _cell(data: dict, source: Source, override_paths: dict, label: str, cell_overrides: dict, name: str) -> Recipe:
    """One grid cell: the recipe (after the command line's overrides) with the cell's overrides, validated."""
    cell_data = copy.deepcopy(data)
    cell_paths = dict(override_paths)
    for key, value in cell_overrides.items():
        path = key_path(key)
        where = f"grid cell {label!r}: {key}"
        apply_override(cell_data, path, copy.deepcopy(value), where)
        cell_paths[tuple(path)] = where
    return validate(cell_data, Places(source, cell_paths), name)


def resolve(recipe: str | Path | Mapping, overrides=()) -> Recipe:
    """The one way a recipe becomes a :class:`Recipe`: extends -> overrides -> validation.

    ``recipe`` is a YAML path or an already-loaded mapping; ``overrides`` is a list of ``key.path=value``
    strings or a mapping ``{key.path: value}``. A recipe with a ``grid`` also gets ``cells``: every cell
    resolved the same way (base + overrides + the cell's overrides), all validated before anything runs.
    With ``seeds: [s, ...]`` every cell (or the recipe itself, without a grid) runs once per seed under
    its own label.
    """
    if isinstance(recipe, Mapping):
        data, source, name = copy.deepcopy(dict(recipe)), Source(), "<recipe>"
        check_size(data, name)
    else:
        data, source = load_raw(recipe)
        name = str(recipe)
    override_paths = _overridden(data, overrides)
    places = Places(source, override_paths)
    imports = import_modules(data, places)
    grid = data.pop("grid", None)
    base = validate(data, places, name)
    base.config.grid, base.imports = grid, imports
    if grid is not None or base.config.seeds is not None:
        for label, cell_overrides in cross_seeds(expand_grid(grid), base.config.seeds):
            cell = _cell(data, source, override_paths, label, cell_overrides, name)
            cell.imports = imports
            base.cells.append(Cell(label, cell_overrides, cell))
    _refuse_identical_cells(base.cells)
    return base


def _refuse_identical_cells(cells: list[Cell]) -> None:
    """Two grid cells that resolve to one recipe would train the same thing twice under two labels."""
    seen: dict[str, Cell] = {}
    for cell in cells:
        twin = seen.setdefault(cell.recipe.key, cell)
        if twin is not cell:
            raise UserError(f"grid cells {twin.label!r} and {cell.label!r} resolve to the same recipe "
                            f"(seed {cell.recipe.seed}); remove one of them or make them differ")
