"""The functions ``import zoo`` offers (``zoo.load``, ``zoo.build_task``, ``zoo.build_model``, ``zoo.train``,
``zoo.evaluate``, ``zoo.evaluate_checkpoint``, ``zoo.load_checkpoint``), with their arguments checked at the door.

Each takes what a notebook naturally has at hand and names anything else in one line, as an
:class:`ArgumentError` (a :class:`zoo.UserError` that is also a ``TypeError``), before any work starts:

- a recipe: a :class:`zoo.config.Recipe`, or a recipe file (``str`` or ``Path``) or mapping, read with
  :func:`load`; a :class:`zoo.training.loop.TrainResult` or a checkpoint is pointed to ``result.recipe``;
- overrides: a list (or tuple) of ``key.path=value`` strings, one such string, a mapping
  ``{key.path: value}``, or ``None`` for none;
- a checkpoint: its folder or its ``checkpoint.pt`` (``str`` or ``Path``); a ``TrainResult``, a ``Recipe`` or the
  dict :func:`load_checkpoint` returns is refused with the call that takes it.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Mapping

import torch

from . import reevaluate
from .config import Recipe
from .errors import UserError
from .model import HybridLM
from .recipes import resolve
from .recipes.plain import recipe_mapping
from .tasks import Task
from .training import checkpoint as ckpt
from .training import loop

OVERRIDES_FORM = "a list of 'key.path=value' strings (e.g. ['train.steps=20']) or a mapping {'train.steps': 20}"


class ArgumentError(UserError, TypeError):
    """An argument of the wrong kind given to a function of ``import zoo``, named in one line with what to pass."""


def _kind(value) -> str:
    """``an int``, ``a TrainResult``: the type of ``value`` with its article."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _is_path(value) -> bool:
    return isinstance(value, (str, os.PathLike)) and isinstance(os.fspath(value), str)


def override_list(overrides, who: str):
    """``overrides`` as :func:`zoo.recipes.resolve` takes them: a list of strings or a mapping with string keys."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return [overrides]
    if isinstance(overrides, Mapping):
        bad = [key for key in overrides if not isinstance(key, str)]
        if bad:
            raise ArgumentError(f"{who}: override key {bad[0]!r} is {_kind(bad[0])}; write each key path as a "
                                f"string, e.g. {{'train.steps': 20}}")
        return dict(overrides)
    if isinstance(overrides, (list, tuple)):
        bad = [item for item in overrides if not isinstance(item, str)]
        if bad:
            raise ArgumentError(f"{who}: override {bad[0]!r} is {_kind(bad[0])}, not a 'key.path=value' string; "
                                f"give overrides as {OVERRIDES_FORM}")
        return list(overrides)
    raise ArgumentError(f"{who}: overrides must be {OVERRIDES_FORM}, got {_kind(overrides)}")


def _reloaded(recipe: Recipe, overrides) -> Recipe:
    """``recipe`` with more ``overrides``, resolved again from its plain form (which keeps no grid)."""
    if recipe.cells:
        raise ArgumentError(f"zoo.load: this Recipe has {len(recipe.cells)} grid cells, which its resolved form does "
                            f"not keep; give every override when reading the file: zoo.load(path, overrides)")
    return resolve(recipe_mapping(recipe.plain, list(recipe.imports)), overrides)


def load(recipe, overrides=()) -> Recipe:
    """The :class:`Recipe` of ``recipe`` (a YAML path, a mapping, or a ``Recipe`` to apply more overrides to) with
    ``overrides`` (see the module docstring): :func:`zoo.recipes.resolve` with its arguments checked. A ``Recipe``
    takes its overrides over its resolved form, where the layers are listed one by one (``model.layers``)."""
    overrides = override_list(overrides, "zoo.load")
    if isinstance(recipe, Recipe):
        return _reloaded(recipe, overrides) if overrides else recipe
    if isinstance(recipe, Mapping):
        if "extends" in recipe:
            raise ArgumentError("zoo.load: 'extends' is read only from a recipe file (its base is found next to it); "
                                "pass the file's path, or merge the base into the mapping yourself")
        return resolve(recipe, overrides)
    if _is_path(recipe):
        return resolve(recipe if isinstance(recipe, (str, Path)) else Path(os.fspath(recipe)), overrides)
    hint = " (its recipe is result.recipe)" if isinstance(recipe, loop.TrainResult) else ""
    raise ArgumentError(f"zoo.load: expected a recipe file path (str or Path) or a mapping, got "
                        f"{_kind(recipe)}{hint}")


def as_recipe(recipe, who: str) -> Recipe:
    """``recipe`` as a :class:`Recipe`: itself, or the recipe file or mapping read with :func:`load`."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, Mapping) or _is_path(recipe):
        return load(recipe)
    hint = ""
    if isinstance(recipe, loop.TrainResult):
        hint = "; a TrainResult's recipe is result.recipe, its trained model result.model"
    raise ArgumentError(f"{who}: expected a Recipe (zoo.load(path, overrides)) or a recipe file path or mapping, "
                        f"got {_kind(recipe)}{hint}")


def checkpoint_location(location, who: str) -> Path:
    """``location`` as a path, or a one-line refusal naming what to pass for what was given."""
    if _is_path(location):
        return Path(os.fspath(location))
    if isinstance(location, loop.TrainResult):
        why = ("a TrainResult is not a checkpoint: evaluate it with zoo.evaluate(result), or train with "
               "zoo.train(recipe, checkpoint_dir=DIR) and pass DIR")
    elif isinstance(location, Recipe):
        why = "a Recipe is not a checkpoint: train it with zoo.train(recipe, checkpoint_dir=DIR) and pass DIR"
    elif isinstance(location, Mapping):
        why = "this mapping is not a checkpoint's location (a checkpoint's contents?): pass its folder or file path"
    else:
        why = f"expected a checkpoint folder or file path (str or Path), got {_kind(location)}"
    raise ArgumentError(f"{who}: {why}")


def build_task(recipe) -> Task:
    """The task of ``recipe``, built from its validated options."""
    return Task.from_spec(as_recipe(recipe, "zoo.build_task").task)


def build_model(recipe) -> HybridLM:
    """The untrained model of ``recipe``, initialised exactly as training initialises it (from ``recipe.seed``);
    the caller's torch random state is left as it was."""
    recipe = as_recipe(recipe, "zoo.build_model")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        return HybridLM.from_recipe(recipe, build_task(recipe).vocab_size)


def train(recipe, progress: bool = True, description: str = "", checkpoint_dir=None) -> loop.TrainResult:
    """Train ``recipe`` and evaluate it (:func:`zoo.training.loop.train`); with ``checkpoint_dir`` (a folder path),
    checkpoint there and resume a checkpoint of the same recipe. A recipe with grid cells trains its base recipe
    only, with a warning that says how to train the cells."""
    recipe = as_recipe(recipe, "zoo.train")
    if checkpoint_dir is not None and not _is_path(checkpoint_dir):
        raise ArgumentError(f"zoo.train: checkpoint_dir must be a folder path (str or Path) or None, got "
                            f"{_kind(checkpoint_dir)}")
    if recipe.cells:
        warnings.warn(f"zoo.train: this recipe has {len(recipe.cells)} cells (its grid or seeds); training the base "
                      f"recipe only (one cell: zoo.train(recipe.cells[i].recipe); every cell: zoo ablate RECIPE)",
                      stacklevel=2)
    return loop.train(recipe, progress, description, checkpoint_dir)


def evaluate(source, overrides=()) -> dict:
    """Metrics of a trained model under ``overrides`` (other lengths, test-time knobs, test data): ``source`` is
    the :class:`TrainResult` of :func:`train` or a checkpoint's folder or file (:func:`zoo.reevaluate.evaluate`)."""
    overrides = override_list(overrides, "zoo.evaluate")
    if isinstance(source, loop.TrainResult):
        return reevaluate.evaluate(source, overrides)
    if isinstance(source, torch.nn.Module):
        raise ArgumentError("zoo.evaluate: a model alone carries no recipe; pass the TrainResult zoo.train returned, "
                            "or a checkpoint folder")
    return reevaluate.evaluate(checkpoint_location(source, "zoo.evaluate"), overrides)


def evaluate_checkpoint(location, overrides=(), label: str = "") -> dict:
    """The results row of the checkpoint at ``location`` evaluated under ``overrides``
    (:func:`zoo.reevaluate.evaluate_checkpoint`)."""
    location = checkpoint_location(location, "zoo.evaluate_checkpoint")
    return reevaluate.evaluate_checkpoint(location, override_list(overrides, "zoo.evaluate_checkpoint"), label)


def load_checkpoint(location) -> dict:
    """The checkpoint dict at ``location`` (a ``checkpoint.pt`` file or the folder holding it)."""
    return ckpt.load(ckpt.path_in(checkpoint_location(location, "zoo.load_checkpoint")))
