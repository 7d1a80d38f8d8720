"""The user-facing layer: recipes, hybrid builder, tasks, training, ablations, benchmarks, CLI.

From Python (a notebook, a script)::

    import zoo
    recipe = zoo.load("recipes/ablations/quickstart.yaml", ["train.steps=100"])  # a Recipe
    result = zoo.train(recipe)                        # TrainResult: .metrics, .model, .history
    zoo.evaluate(result, ["eval.seq_lens=[64]"])      # metrics under other test settings

- ``zoo.load(path_or_mapping, overrides=())`` reads a recipe (extends -> overrides -> validation) and
  returns a :class:`zoo.config.Recipe` (:func:`zoo.recipes.resolve`). ``overrides``: a list of
  ``key.path=value`` strings, one such string, or a mapping ``{key.path: value}``; a ``Recipe`` given again
  takes more overrides. ``extends:`` is read from a recipe file only.
- ``zoo.build_model(recipe)`` builds the untrained :class:`zoo.model.HybridLM` (``zoo.HybridLM``), seeded by the
  recipe, leaving the caller's torch random state as it was; ``zoo.build_task(recipe)`` its task. These and
  ``zoo.train`` take a ``Recipe`` or a recipe file or mapping.
- ``zoo.train(recipe, progress=True, description="", checkpoint_dir=None)`` trains and evaluates;
  with ``checkpoint_dir`` it checkpoints there and resumes a checkpoint of the same recipe. A recipe with a
  grid trains its base recipe only, with a warning (``zoo ablate`` runs the cells).
- ``zoo.evaluate(result_or_checkpoint, overrides=())`` evaluates a trained model again (other lengths,
  test-time knobs, test data) without retraining; ``zoo.evaluate_checkpoint`` returns a full results
  row, ``zoo.load_checkpoint`` the raw checkpoint dict. A checkpoint is its folder or file (``str`` or ``Path``).
- ``zoo.UserError``: every mistake a user can fix (a recipe typo, a missing file, a missing extra) is
  raised as this one error, with a one-line message; an argument of the wrong kind (a ``TrainResult`` where a
  checkpoint path goes, a list of numbers as overrides) is one too, and also a ``TypeError``
  (:class:`zoo.api.ArgumentError`).
- Out-of-tree mixers: decorate a :class:`mixers.Mixer` subclass with ``@mixers.register_mixer`` in
  your module and name the module in the recipe's ``imports: [my_pkg.my_mixer]``.

The rooms of the package: :mod:`zoo.recipes` and :mod:`zoo.config` (reading and validating recipes),
:mod:`zoo.tasks` (data), :mod:`zoo.model` (the hybrid stack), :mod:`zoo.training` (training, evaluation,
checkpoints), :mod:`zoo.rows` (results rows, the ground floor every writer shares), :mod:`zoo.reevaluate`
(``zoo eval``), :mod:`zoo.experiments` (ablations, tables, the claims ledger), :mod:`zoo.benchmark`
(``zoo bench``) and :mod:`zoo.cli` (the ``zoo`` command).
"""
from __future__ import annotations

import importlib

# Names and the modules they come from, imported at first use (PEP 562): ``import zoo`` and the ``zoo`` command's
# first line import no torch, so a Ctrl-C while torch loads reaches the command line's one-line handler.
_EXPORTS = {
    "Recipe": ("zoo.config", "Recipe"),
    "UserError": ("zoo.errors", "UserError"),
    "HybridLM": ("zoo.model", "HybridLM"),
    "resolve": ("zoo.recipes", "resolve"),
    "load": ("zoo.api", "load"),
    "evaluate": ("zoo.api", "evaluate"),
    "evaluate_checkpoint": ("zoo.api", "evaluate_checkpoint"),
    "Task": ("zoo.tasks", "Task"),
    "TrainResult": ("zoo.training.loop", "TrainResult"),
    "train": ("zoo.api", "train"),
    "build_task": ("zoo.api", "build_task"),
    "build_model": ("zoo.api", "build_model"),
    "load_checkpoint": ("zoo.api", "load_checkpoint"),
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'zoo' has no attribute {name!r}")
    module, attribute = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = ["load", "resolve", "build_model", "build_task", "train", "evaluate", "evaluate_checkpoint",
           "load_checkpoint", "Recipe", "UserError", "TrainResult", "HybridLM", "Task"]
