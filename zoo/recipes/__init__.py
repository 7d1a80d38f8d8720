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

A recipe's levels, from below: its ``extends`` bases, the recipe itself, the overrides, a grid cell's keys.
Each level gives a model's layers one way (``model.layers``, or ``model.pattern`` with ``model.n_layers``) and
replaces the other way's keys inherited from below; both ways in one level are refused. An error in a grid
cell names the file and line of the cell's key, the cell's label and the key with its value.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Mapping

from mixers import MIXERS

from ..config import COSMETIC_KEYS, COSMETIC_TRAIN_KEYS, Cell, Recipe
from ..errors import UserError
from .grids import GridError, cell_paths, cross_seeds, expand_grid
from .loading import Source, check_size, load_raw, replace_layers, unshared
from .overrides import apply_override, flow_yaml, given_layer_keys, key_path, parse_override
from .plain import recipe_differences
from .validation import Places, import_modules, key_parts, undeclared_knob, validate


def _override_items(overrides) -> list[tuple[list, object, str]]:
    """``[(key path, value, the label that blames it)]`` of ``overrides`` (strings or a mapping)."""
    items = []
    for item in (overrides.items() if isinstance(overrides, Mapping) else overrides):
        if isinstance(overrides, Mapping):
            key, value = item
            items.append((key_path(key), value, f"override {key}={value!r}"))
        else:
            path, value = parse_override(item)
            items.append((path, value, f"override {item!r}"))
    return items


def _overridden(data: dict, overrides) -> dict:
    """Apply ``overrides`` (strings or a mapping) to ``data``; ``{key path: the label that blames it}``."""
    items = _override_items(overrides)
    replace_layers(data, set().union(*(given_layer_keys(path, value) for path, value, _ in items)))
    override_paths = {}
    for path, value, label in items:
        override_paths[tuple(apply_override(data, path, copy.deepcopy(value), label))] = label
    return override_paths


def _cell_place(places: Places, at: tuple, label: str, key: str, value) -> str:
    """Where a grid cell's ``key: value`` is written, as errors name it: the file and line (or the override that
    wrote the grid), the cell's label and the key with its value."""
    shown = flow_yaml(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    where = places.at(at)
    return f"{where + ': ' if where else ''}grid cell {label!r} ({key}={shown})"


def _cell(data: dict, places: Places, label: str, cell_overrides: dict, at: dict, name: str) -> Recipe:
    """One grid cell: the recipe (after the command line's overrides) with the cell's overrides, validated; ``at``:
    where each of its keys is written in the recipe. Its layers and its own test-time knobs are its own level."""
    cell_data = copy.deepcopy(data)
    cell_paths = dict(places.override_paths)
    replace_layers(cell_data, set().union(*(given_layer_keys(key_path(k), v) for k, v in cell_overrides.items())))
    own = []
    for key, value in cell_overrides.items():
        path = key_path(key)
        where = _cell_place(places, at.get(key, ("seeds",) if key == "seed" else ("grid",)), label, key, value)
        path = apply_override(cell_data, path, copy.deepcopy(value), where)
        cell_paths[tuple(path)] = where
        own.append(tuple(path))
    cell_places = Places(places.source, cell_paths)
    own_knob = lambda knob: any(key_parts(knob)[:len(p)] == p for p in own)  # noqa: E731
    return validate(cell_data, cell_places, name, own_knob)


def resolve(recipe: str | Path | Mapping, overrides=()) -> Recipe:
    """The one way a recipe becomes a :class:`Recipe`: extends -> overrides -> validation.

    ``recipe`` is a YAML path or an already-loaded mapping; ``overrides`` is a list of ``key.path=value``
    strings or a mapping ``{key.path: value}``. A recipe with a ``grid`` also gets ``cells``: every cell
    resolved the same way (base + overrides + the cell's overrides), all validated before anything runs.
    With ``seeds: [s, ...]`` every cell (or the recipe itself, without a grid) runs once per seed under
    its own label.

    A test-time knob must be declared by a layer of the model it is given for: in a recipe file without a grid,
    in an override, or in a grid cell's own keys; the knobs a grid's cells share need a declaring layer in some
    cell (the other cells leave those columns empty). A recorded recipe (passed as a mapping, or a results row's
    recipe with its ``model.layer_options``) keeps its knobs, since a recorded grid cell holds its grid's: there
    only the overrides' knobs must be declared by a layer of the model.
    """
    if isinstance(recipe, Mapping):
        data, source, name = copy.deepcopy(dict(recipe)), Source(), "<recipe>"
        check_size(data, name)
        data = unshared(data)  # a value the caller put at two places is two values
    else:
        data, source = load_raw(recipe)
        name = str(recipe)
    override_paths = _overridden(data, overrides)
    places = Places(source, override_paths)
    imports = import_modules(data, places)
    grid = data.pop("grid", None)
    if grid is not None:
        own_knob = lambda knob: False  # noqa: E731 - shared by the cells: checked across them below
    elif isinstance(recipe, Mapping):
        own_knob = lambda knob: places.override_at(key_parts(knob)) is not None  # noqa: E731
    else:
        own_knob = None
    base = validate(data, places, name, own_knob)
    base.config.grid, base.imports = grid, imports
    cell_places = {}
    if grid is not None or base.config.seeds is not None:
        cell_places = _add_cells(base, data, places, grid, name)
    _refuse_identical_cells(base.cells, grid, places)
    _refuse_unused_options(base, overrides, places, cell_places)
    if grid is not None:
        _refuse_undeclared_knobs(base, places)
    return base


def _add_cells(base: Recipe, data: dict, places: Places, grid, name: str) -> dict:
    """Every cell of the grid (or the recipe itself), once per seed with ``seeds``, resolved into ``base.cells``;
    returns where each cell's keys are written (by the cell's ``id``)."""
    places_of: dict[int, dict] = {}
    try:
        cells, at = expand_grid(grid), cell_paths(grid)
    except GridError as err:
        places.fail_at(err.parts, err.message)
    for (label, overrides), where in zip(cells, at):
        for seed_label, cell_overrides in cross_seeds([(label, overrides)], base.config.seeds):
            cell = _cell(data, places, seed_label, cell_overrides, where, name)
            cell.imports = base.imports
            base.cells.append(Cell(seed_label, cell_overrides, cell))
            places_of[id(base.cells[-1])] = where
    return places_of


def _refuse_unused_options(base: Recipe, overrides, places: Places, cell_places: dict) -> None:
    """An override of ``model.mixer_options.<mixer>`` that no layer takes is refused: a grid cell's own key where
    no layer of that cell takes it, a command-line override where no layer of the recipe or of any cell does."""
    for cell in base.cells:
        for key, value in cell.overrides.items():
            problem = unused_mixer_options([cell.recipe], key_path(key), value, "this cell")
            if problem:
                where = _cell_place(places, cell_places.get(id(cell), {}).get(key, ("grid",)), cell.label, key, value)
                raise UserError(f"{where}: {problem}")
    recipes = [base] + [cell.recipe for cell in base.cells]
    for path, value, label in _override_items(overrides):
        problem = unused_mixer_options(recipes, path, value, "the recipe or any cell of its grid" if base.cells
                                       else "this recipe")
        if problem:
            raise UserError(f"{label}: {problem}")


def _refuse_undeclared_knobs(base: Recipe, places: Places) -> None:
    """A test-time knob the cells of a grid share is declared by a layer of at least one cell."""
    recipes = [cell.recipe for cell in base.cells]
    names = [spec.name for recipe in recipes for spec in recipe.layers]
    own = sorted({k for name in names for k in MIXERS.get(name).test_time_knobs})
    for section in ("test_time", "test_time_sweep"):
        for knob in getattr(base.eval, section):
            if knob not in own:
                places.fail(f"eval.{section}.{knob}", undeclared_knob(knob, names, own, "any grid cell"))


def _mixer_option_targets(path: list, value) -> list[tuple[str, list]]:
    """``[(mixer, option names)]`` that an override at ``path`` sets in ``model.mixer_options`` (no names: the
    mixer's whole mapping, or one that is not a mapping); none for any other path, and none for the whole of
    ``model.mixer_options``, whose replacement drops every other mixer's defaults as well."""
    path = list(path)
    if path[:2] != ["model", "mixer_options"] or len(path) == 2:
        return []
    if len(path) == 3:
        return [(path[2], list(value) if isinstance(value, dict) else [])]
    return [(path[2], [path[3]])]


def _takes(recipe: Recipe, mixer: str, options: list) -> bool:
    """Whether some layer of ``recipe`` is a ``mixer`` that takes one of ``options`` from ``model.mixer_options``
    (a layer that sets an option itself does not take its type's default; no ``options``: any such layer)."""
    for name, own in recipe.model.named_layer_entries():
        if name == mixer and (not options or any(o not in own for o in options)):
            return True
    return False


def unused_mixer_options(recipes: list[Recipe], path: list, value, whose: str) -> str | None:
    """Why an override at ``path`` (``model.mixer_options.<mixer>...``) changes no layer of ``recipes`` (the recipe,
    or every cell of its grid), or None when it reaches one: options of a mixer no layer is, or that every layer of
    it sets itself, would be recorded in the recipe and its hash yet train nothing differently."""
    for mixer, options in _mixer_option_targets(path, value):
        if any(_takes(recipe, mixer, options) for recipe in recipes):
            continue
        names = list(dict.fromkeys(spec.name for recipe in recipes for spec in recipe.layers))
        if mixer in names:
            shown = ", ".join(options)
            return (f"every {mixer} layer of {whose} sets {shown} itself, so this default of model.mixer_options "
                    f"changes nothing; set it on a layer (model.layers.<i>.{mixer}.{options[0]}=value) or drop it")
        return (f"no layer of {whose} is {mixer} (layers: {', '.join(names)}), so options of {mixer} change nothing; "
                f"add a {mixer} layer or drop it")
    return None


def _replaces(cell: Cell, path: list) -> str | None:
    """The key of ``cell`` that replaces whatever an override at ``path`` set (the key itself or a mapping above
    it, or the other way of giving the model's layers), or None when the override reaches the cell."""
    layer_keys = set()
    for key, value in cell.overrides.items():
        cell_path = key_path(key)
        if path[:len(cell_path)] == cell_path:
            return key
        layer_keys |= given_layer_keys(cell_path, value)
    if path[:1] == ["model"] and len(path) > 1:
        if path[1] in ("pattern", "n_layers") and "layers" in layer_keys:
            return "model.layers"
        if path[1] == "layers" and "pattern" in layer_keys:
            return "model.pattern"
    return None


def _cells_replacing(recipe: Recipe, path: list) -> list[tuple[str, str]]:
    """``(label, key)`` of each grid cell whose own key replaces an override at ``path`` (:func:`_replaces`)."""
    return [(cell.label, key) for cell in recipe.cells if (key := _replaces(cell, path))]


def refuse_overrides_every_cell_replaces(recipe: Recipe, overrides: list[str]) -> None:
    """Refuse a command-line override that every cell of the grid replaces with a key of its own (``train.lr=...``
    where every cell sets ``train.lr``, ``model.layers.1=...`` where every cell sets ``model.layers``), or an option
    of ``model.mixer_options`` that only the base recipe's layers take: the override would change no run of the
    ablation."""
    if not recipe.cells:
        return
    for text in overrides:
        path, value = parse_override(text)
        problem = unused_mixer_options([cell.recipe for cell in recipe.cells], path, value, "any cell of the grid")
        if problem:  # it reaches the base recipe's layers only, which zoo ablate never trains
            raise UserError(f"override {text!r} changes no cell of the grid: {problem}")
        replaced = _cells_replacing(recipe, path)
        if len(replaced) == len(recipe.cells):
            shown = sorted({key for _label, key in replaced})
            raise UserError(f"override {text!r} changes no cell of the grid: every cell sets "
                            f"{' or '.join(shown)} itself (e.g. cell {recipe.cells[0].label!r}), replacing it; "
                            f"drop the override, or write its value into the grid's cells")


def overrides_some_cells_replace(recipe: Recipe, overrides: list[str]) -> list[str]:
    """One line per command-line override that some cells of the grid (not all: that is refused,
    :func:`refuse_overrides_every_cell_replaces`) replace with a key of their own: those cells run without it
    (``train.steps=2`` where two cells set ``train.steps: 2500`` trains them 2,500 steps)."""
    notes = []
    for text in overrides if recipe.cells else ():
        replaced = _cells_replacing(recipe, parse_override(text)[0])
        if replaced and len(replaced) < len(recipe.cells):
            shown = ", ".join(f"{label!r} ({key})" for label, key in replaced[:4])
            more = f" and {len(replaced) - 4} more" if len(replaced) > 4 else ""
            notes.append(f"override {text!r} does not reach {len(replaced)} of the grid's {len(recipe.cells)} cells, "
                         f"which set it themselves: {shown}{more}; they run with their own value")
    return notes


def _computed(recipe: Recipe) -> str:
    """What ``recipe`` trains and evaluates, however its layers' options are written: its key's content with every
    layer as its mixer and resolved options (``model.layer_options``), without ``model.mixer_options`` (an option
    there that every layer of its type sets itself, or of a mixer no layer uses, changes no layer)."""
    content = {k: v for k, v in recipe.plain.items() if k not in COSMETIC_KEYS}
    content["train"] = {k: v for k, v in content["train"].items() if k not in COSMETIC_TRAIN_KEYS}
    content["model"] = {k: v for k, v in content["model"].items() if k != "mixer_options"}
    content["model"]["layers"] = [spec.name for spec in recipe.layers]
    return json.dumps(content, sort_keys=True)


def _refuse_identical_cells(cells: list[Cell], grid, places: Places) -> None:
    """Two grid cells that build the same model and train it the same way would train the same thing twice under
    two labels, even where they write it differently (e.g. an option of ``model.mixer_options`` no layer takes). A
    mapping ``grid`` makes every combination of its values, so its cells are left out by listing the others. The
    refusal names where the grid is written."""
    fix = ("a mapping grid runs every combination of its values: list the cells to run instead (grid: [{label: ..., "
           "key.path: value}, ...])" if isinstance(grid, dict) else "remove one of them or make them differ")
    seen: dict[str, Cell] = {}
    for cell in cells:
        twin = seen.setdefault(_computed(cell.recipe), cell)
        if twin is not cell:
            written = recipe_differences(twin.recipe.plain, cell.recipe.plain)
            how = f"; they differ only in {'; '.join(written)}" if written else ""
            where = places.at(("grid",))
            raise UserError(f"{where + ': ' if where else ''}grid cells {twin.label!r} and {cell.label!r} resolve to "
                            f"the same recipe (seed {cell.recipe.seed}{how}); {fix}")
