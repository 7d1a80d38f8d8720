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
- Out-of-tree mixers: decorate a :class:`mixers.Mixer` subclass with ``@mixers.register_mixer`` in
  your module and name the module in the recipe's ``imports: [my_pkg.my_mixer]``.

``zoo.train`` here is the function; the module of the same name is reached with
``from zoo.train import ...``.
"""
from __future__ import annotations

from .checkpoint import load as _load_checkpoint_file
from .checkpoint import path_in as _checkpoint_path
from .config import Recipe
from .evaluation import evaluate, evaluate_checkpoint
from .recipes import RecipeError, resolve
from .train import TrainResult, build_task, train

load = resolve


def build_model(recipe: Recipe):
    """The untrained model of ``recipe``, initialised exactly as training initialises it."""
    import torch

    from .model import HybridLM
    torch.manual_seed(recipe.seed)
    return HybridLM.from_recipe(recipe, build_task(recipe).vocab_size)


def load_checkpoint(location) -> dict:
    """The checkpoint dict at ``location`` (a ``checkpoint.pt`` file or the folder holding it)."""
    return _load_checkpoint_file(_checkpoint_path(location))


__all__ = ["load", "resolve", "build_model", "build_task", "train", "evaluate", "evaluate_checkpoint",
           "load_checkpoint", "Recipe", "RecipeError", "TrainResult"]
