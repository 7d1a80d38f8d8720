"""``zoo eval``: evaluate a trained model again, without retraining, under other test settings.

The checkpoint carries its resolved recipe; :func:`eval_recipe` re-resolves it with overrides that
leave the trained model as it is:

- ``eval.*``: other test lengths (``eval.seq_lens=[64,128]``), test-time knob values
  (``eval.test_time={knob: v}``, ``eval.test_time_sweep``), other tasks with the same vocabulary
  (``eval.tasks``, :mod:`zoo.eval_tasks`), the evaluation batch size;
- ``task.<option>`` for options that keep the task's vocabulary (e.g. ``task.num_test``,
  ``task.seq_len``, ``task.num_kv_pairs``), never ``task.name``;
- ``seed`` (it selects the test data here), ``train.device``, ``train.threads``,
  ``train.precision``, ``name``, ``description``, ``imports``.

Every other override (``model.*``, the rest of ``train.*``) describes how the checkpoint was trained,
and is refused with a one-line error. Without overrides, evaluation repeats the end-of-training
evaluation exactly (same data, same code path, same numbers on a CPU with the recipe's threads).
Rows go to ``results.jsonl`` in the format of ablation rows.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from . import checkpoint as ckpt
from .config import Recipe
from .environment import environment
from .model import HybridLM
from .recipes import RecipeError, parse_override, resolve

ALLOWED_PREFIXES = ("eval", "task", "seed", "name", "description", "imports", "train.device", "train.threads",
                    "train.precision")
WHY = ("zoo eval may change only eval.*, task options that keep the vocabulary, seed (the test data), "
       "train.device/threads/precision")


def _override_items(overrides) -> list[tuple[str, object, str]]:
    if isinstance(overrides, Mapping):
        return [(k, v, f"{k}={v!r}") for k, v in overrides.items()]
    items = []
    for text in overrides:
        path, value = parse_override(text)
        items.append((".".join(str(p) for p in path), value, text))
    return items


def eval_recipe(plain: dict, imports: list[str] = (), overrides=()) -> tuple[Recipe, Recipe]:
    """``(trained, for_eval)``: the checkpoint's recipe and the one with the evaluation overrides,
    after checking that no override changes the trained model."""
    base = ckpt.recipe_mapping(plain, imports)
    for key, _value, text in _override_items(overrides):
        if key == "task.name" or not any(key == p or key.startswith(p + ".") for p in ALLOWED_PREFIXES):
            raise RecipeError(f"zoo eval: override {text!r} would change the trained model; {WHY}")
    trained = resolve(base)
    new = resolve(base, overrides)
    from .train import build_task
    if new.task.name != trained.task.name:
        raise RecipeError(f"zoo eval: the task must stay {trained.task.name!r}; {WHY}")
    old_vocab, new_vocab = build_task(trained).vocab_size, build_task(new).vocab_size
    if old_vocab != new_vocab:
        raise RecipeError(f"zoo eval: these task options change the vocabulary from {old_vocab} to {new_vocab}, "
                          f"which the trained embedding cannot read; {WHY}")
    return trained, new


def load_model(state: dict, recipe: Recipe, device) -> HybridLM:
    from .train import build_task
    model = HybridLM.from_recipe(recipe, build_task(recipe).vocab_size)
    model.load_state_dict(state["model"])
    return model.to(device).eval()


def evaluate_checkpoint(location: str | Path, overrides=(), label: str = "") -> dict:
    """Evaluate the checkpoint at ``location`` (a file or its folder); returns a results row
    (``recipe_key``, ``label``, ``recipe``, ``metrics``, environment, ...)."""
    from .train import build_task, resolve_device, resolve_precision, test_metrics
    path = ckpt.path_in(location)
    state = ckpt.load(path)
    trained, recipe = eval_recipe(state["recipe"], state.get("imports", []), overrides)
    if trained.key != state["recipe_key"]:
        raise RecipeError(f"{path}: its recipe no longer resolves to the key it was trained under "
                          f"({trained.key} != {state['recipe_key']}); a default changed since it was written")
    t = recipe.train
    if t.threads:
        torch.set_num_threads(t.threads)
    device = resolve_device(t.device)
    model = load_model(state, trained, device)
    metrics = {"steps": state["step"]}
    metrics.update(test_metrics(model, recipe, build_task(recipe), device, resolve_precision(t.precision, device)))
    metrics["device"] = str(device)
    texts = [text for _k, _v, text in _override_items(overrides)]
    return {"recipe_key": recipe.key, "label": label or " ".join(["eval"] + texts), "overrides":
            {k: v for k, v, _t in _override_items(overrides)}, "recipe": recipe.plain, "seed": recipe.seed,
            "metrics": metrics, "checkpoint": str(path), "trained_recipe_key": state["recipe_key"],
            "finished": state["finished"], **environment(device)}


def evaluate(source, overrides=()) -> dict:
    """Metrics of a trained model: ``source`` is a :class:`zoo.train.TrainResult` or a checkpoint path."""
    if isinstance(source, (str, Path)):
        return evaluate_checkpoint(source, overrides)["metrics"]
    from .train import build_task, resolve_precision, test_metrics
    result = source
    if result.recipe is None:
        raise RecipeError("evaluate: this TrainResult carries no recipe; pass a checkpoint path instead")
    _trained, recipe = eval_recipe(result.recipe.plain, ckpt.imports_for(result.recipe), overrides)
    device = next(result.model.parameters()).device
    return test_metrics(result.model, recipe, build_task(recipe), device, resolve_precision(recipe.train.precision, device))
