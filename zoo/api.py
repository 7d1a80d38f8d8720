"""The helpers ``import zoo`` offers beside the recipe reader and the trainer: a recipe's task and untrained
model, and a checkpoint read as a dict (``zoo.build_task``, ``zoo.build_model``, ``zoo.load_checkpoint``)."""
from __future__ import annotations

import torch

from .config import Recipe
from .model import HybridLM
from .tasks import Task
from .training.checkpoint import load, path_in


def build_task(recipe: Recipe) -> Task:
    """The task of ``recipe``, built from its validated options."""
    return Task.from_spec(recipe.task)


def build_model(recipe: Recipe) -> HybridLM:
    """The untrained model of ``recipe``, initialised exactly as training initialises it."""
    torch.manual_seed(recipe.seed)
    return HybridLM.from_recipe(recipe, build_task(recipe).vocab_size)


def load_checkpoint(location) -> dict:
    """The checkpoint dict at ``location`` (a ``checkpoint.pt`` file or the folder holding it)."""
    return load(path_in(location))
