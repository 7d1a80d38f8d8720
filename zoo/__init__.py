"""The user-facing layer: recipes, hybrid builder, tasks, training, ablations, benchmarks, CLI.

From Python (a notebook, a script)::

    import zoo
    recipe = zoo.load("recipes/ablations/quickstart.yaml", ["train.steps=100"])  # a Recipe
    result = zoo.train(recipe)                        # TrainResult: .metrics, .model, .history
    zoo.evaluate(result, ["eval.seq_lens=[64]"])      # metrics under other test settings

- ``zoo.load(path_or_mapping, overrides=())`` reads a recipe (extends -> overrides -> validation) and
  returns a :class:`zoo.config.Recipe`; it is :func:`zoo.recipes.resolve`.
- ``zoo.build_model(recipe)`` builds the untrained :class:`zoo.model.HybridLM` (seeded by the recipe).
- ``zoo.train(recipe, progress=True, description="", checkpoint_dir=None)`` trains and evaluates;
  with ``checkpoint_dir`` it checkpoints there and resumes a checkpoint of the same recipe.
- ``zoo.evaluate(result_or_checkpoint, overrides=())`` evaluates a trained model again (other lengths,
  test-time knobs, test data) without retraining; ``zoo.evaluate_checkpoint`` returns a full results
  row, ``zoo.load_checkpoint`` the raw checkpoint dict.
- ``zoo.UserError``: every mistake a user can fix (a recipe typo, a missing file, a missing extra) is
  raised as this one error, with a one-line message.
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
    "load": ("zoo.recipes", "resolve"),
    "evaluate": ("zoo.reevaluate", "evaluate"),
    "evaluate_checkpoint": ("zoo.reevaluate", "evaluate_checkpoint"),
    "Task": ("zoo.tasks", "Task"),
    "TrainResult": ("zoo.training.loop", "TrainResult"),
    "train": ("zoo.training.loop", "train"),
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
           "load_checkpoint", "Recipe", "UserError", "TrainResult"]
