"""Ablation grids: a recipe's ``grid`` expanded into labelled cells of overrides, and ``seeds`` crossed with them.

A grid is a mapping ``{key.path: [values]}`` (every combination is a cell, labelled ``name=value`` by its values,
each key named by its last segment, or by as many last segments as tell it from the grid's other keys and name more
than a list index: ``lr``, ``layers.1``, ``attention.n_heads``) or a list of
override mappings (one cell each, labelled by its ``label`` or its overrides). Cell labels must differ. A key of
a listed cell without a dot is ``label`` or a top-level recipe key (``seed``, ``name``...): a typo names the
nearest of those. :func:`cell_paths` gives where each cell's keys are written (for errors that name the cell).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import fields

from mixers.options import nearest

from ..config import RecipeConfig
from ..errors import UserError
from .plain import layer_label

#: the keys without a dot a listed cell may have: its label, or a top-level recipe key
CELL_KEYS = ("label", *(f.name for f in fields(RecipeConfig) if f.name not in ("grid", "seeds")))


class GridError(UserError):
    """A malformed grid; ``parts`` is the key path of the offending entry (a grid key with dots is one part)."""

    def __init__(self, parts: tuple, message: str):
        self.parts, self.message = parts, message
        super().__init__(f"{'.'.join(map(str, parts))}: {message}")


def _is_layer(entry) -> bool:
    """Whether ``entry`` is written as a layer: a name, or one name with a mapping of options (or none)."""
    return isinstance(entry, str) or (isinstance(entry, dict) and len(entry) == 1 and isinstance(next(iter(entry)), str)
                                      and isinstance(next(iter(entry.values())), (dict, type(None))))


def _short(value) -> str:
    """A value in a cell's label: a list of layers as ``a+b(option=value)``, anything else as written. Any value
    gets a label (a list of ``eval.tasks`` entries, a malformed layer), so that validation names what is wrong."""
    if isinstance(value, list):
        return "+".join(layer_label(v) if _is_layer(v) else str(v) for v in value)
    return str(value)


def _check_grid_key(key, parts: tuple) -> None:
    if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
        raise GridError(parts, f"a grid key is a key.path such as train.lr, got {key!r}")


def _product_cells(grid: dict) -> list[tuple[str, dict]]:
    """``{key.path: [values]}``: one cell per combination of values."""
    keys = list(grid)
    for key in keys:
        _check_grid_key(key, ("grid", key))
        if key in ("grid", "seeds"):  # a cell is one run: its own grid or seeds would never be expanded
            raise GridError(("grid", key), "a grid cell cannot set " + (
                "seeds; give seeds: [...] at the top level of the recipe (every cell then runs once per seed)"
                if key == "seeds" else "a grid of its own; a recipe has one grid: write these cells into it"))
        if not isinstance(grid[key], list) or not grid[key]:
            raise GridError(("grid", key), "expected a non-empty list of values to try")
    cells, names = [], _label_names(keys)
    for values in itertools.product(*(grid[k] for k in keys)):
        overrides = dict(zip(keys, values))
        cells.append((" ".join(f"{name}={_short(v)}" for name, v in zip(names, values)), overrides))
    return cells


def _tail(parts: list[str], n: int) -> str:
    """The last ``n`` segments of a key path, more while the first of them is a list index."""
    n = min(n, len(parts))
    while n < len(parts) and parts[-n].lstrip("-").isdigit():
        n += 1
    return ".".join(parts[-n:])


def _label_names(keys: list[str]) -> list[str]:
    """Each grid key as a product cell's label names it: its last segment (``train.lr`` -> ``lr``), or as many last
    segments as tell it from the grid's other keys, never starting at a list index (``model.layers.1`` ->
    ``layers.1``; ``attention.n_heads`` and ``gka.n_heads`` for two mixers' ``n_heads``)."""
    parts = [key.split(".") for key in keys]
    lengths = [1] * len(keys)
    while True:
        names = [_tail(p, n) for p, n in zip(parts, lengths)]
        clashing = [i for i, name in enumerate(names) if names.count(name) > 1 and len(name.split(".")) < len(parts[i])]
        if not clashing:
            return names
        for i in clashing:
            lengths[i] = len(names[i].split(".")) + 1


def _check_label(label, i: int) -> None:
    """A listed cell's label is a name as written: YAML reads ``yes``/``no``/``on``/``off`` as booleans and ``0.10``
    as the number 0.1, which would label the cell ``True`` or ``0.1``; those are refused with how to quote them
    (an integer label keeps its digits, e.g. ``label: 0``)."""
    if label is None or isinstance(label, str) or (isinstance(label, int) and not isinstance(label, bool)):
        return
    if isinstance(label, (bool, float)):
        example = "'yes'" if isinstance(label, bool) else "'0.10'"
        raise GridError(("grid", i, "label"), f"YAML reads this label as the {type(label).__name__} {label!r}, not "
                                              f"the name written; quote it as written, e.g. label: {example}")
    raise GridError(("grid", i, "label"), f"expected a short name, got {label!r}")


def _listed_cells(grid: list) -> list[tuple[str, dict]]:
    """A list of override mappings: one cell each, with distinct labels."""
    if not grid:
        raise GridError(("grid",), "the list of cells is empty")
    cells = []
    for i, cell in enumerate(grid):
        if not isinstance(cell, dict):
            raise GridError(("grid", i), "expected a mapping of key.path: value overrides")
        cell = dict(cell)
        label = cell.pop("label", None)
        _check_label(label, i)
        for key in cell:
            _check_grid_key(key, ("grid", i, key))
            if "." not in key and key not in CELL_KEYS:
                raise GridError(("grid", i, key), f"unknown key {key!r}{nearest(key, CELL_KEYS)} (a cell's keys are "
                                                  f"label and key paths such as train.lr or model.layers)")
        if label == "":
            raise GridError(("grid", i, "label"), "the label is empty; give a short name, or leave label out to name "
                                                  "the cell by its overrides")
        if label is None:
            label = " ".join(f"{k}={_short(v)}" for k, v in cell.items()) or f"cell{i}"
        cells.append((str(label), cell))
    labels = [c[0] for c in cells]
    dupes = {x for x in labels if labels.count(x) > 1}
    if dupes:
        raise GridError(("grid",), f"duplicate cell labels {sorted(dupes)}; give each cell a distinct label")
    _check_seed_words(cells)
    return cells


#: a ``seed=N`` word in a label: older tables named seed replicates "<cell> seed=1" instead of using ``seeds``
_SEED_WORD = re.compile(r"(?<!\S)seed=\d+(?!\S)")


def cell_of(label: str) -> str:
    """The cell a row belongs to: its label without a ``seed=N`` word (rows of one cell differ by seed)."""
    return " ".join(_SEED_WORD.sub(" ", str(label)).split())


def _check_seed_words(cells: list[tuple[str, dict]]) -> None:
    """Cells whose labels differ only by a ``seed=N`` word are read by the tables as seeds of one cell: refuse
    them unless their overrides differ only in ``seed``."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for label, overrides in cells:
        rest = repr(sorted((k, repr(v)) for k, v in overrides.items() if k != "seed"))
        groups.setdefault(cell_of(label), []).append((label, rest))
    for shown, members in groups.items():
        if len({rest for _, rest in members}) > 1:
            raise GridError(("grid",), f"cells {[label for label, _ in members]} differ in more than their seed, but "
                                       f"the tables read a seed=N word in a label as a seed of the cell {shown!r}; "
                                       f"rename them (or run one cell with seeds: [...] at the top level)")


def expand_grid(grid) -> list[tuple[str, dict]]:
    """``[(label, {key.path: value})]`` for every cell of the grid (one empty cell without a grid)."""
    if grid is None or grid == {}:
        return [("base", {})]
    if isinstance(grid, dict):
        return _product_cells(grid)
    if isinstance(grid, list):
        return _listed_cells(grid)
    raise GridError(("grid",), "expected a mapping of key.path -> list, or a list of override mappings")


def cell_paths(grid) -> list[dict]:
    """For every cell of :func:`expand_grid` (in its order, before seeds): ``{key: the key path of its value in
    the recipe}``, ``("grid", key, j)`` for a grid mapping, ``("grid", i, key)`` for a list of cells."""
    if isinstance(grid, dict) and grid:
        keys = list(grid)
        return [{k: ("grid", k, j) for k, j in zip(keys, index)}
                for index in itertools.product(*(range(len(grid[k])) for k in keys))]
    if isinstance(grid, list):
        return [{k: ("grid", i, k) for k in cell if k != "label"} for i, cell in enumerate(grid)]
    return [{}]


def cross_seeds(cells: list[tuple[str, dict]], seeds: list[int] | None) -> list[tuple[str, dict]]:
    """Every cell once per seed (cell-major order), each keeping its label; ``cells`` unchanged without seeds.

    A cell that sets ``seed`` itself cannot also be crossed with the recipe's ``seeds``: that would run
    some cells with other seeds than the rest of the comparison.
    """
    if seeds is None:
        return cells
    out = []
    for label, overrides in cells:
        if "seed" in overrides:
            raise UserError(f"grid cell {label!r} sets seed: {overrides['seed']!r}, but the recipe runs every cell "
                              f"with seeds: {seeds}; remove the cell's seed (or the seeds list)")
        out += [(label, {**overrides, "seed": seed}) for seed in seeds]
    return out
