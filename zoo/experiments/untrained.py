"""Step-0 evaluation: the metrics of a table cell's model before its first optimizer step.

A rule that already holds on untrained models says nothing about training: "GKA is within 0.02 of GLA" is
true of two models that both guess. The ledger evaluates every verdict condition on these numbers too and
flags a condition that holds at step 0 (:mod:`zoo.experiments.claims.verdicts`).

The untrained model of a row is built exactly as training builds it (``torch.manual_seed(seed)``, then the
model from the row's resolved recipe) and evaluated by the end-of-run evaluation
(:func:`zoo.training.evaluation.test_metrics`) on the same test data. The numbers are stored per table in
``tables/<name>/untrained.json`` (``{"commit": ..., "cells": {label: {seed: metrics}}}``), written by
``zoo claims --untrained <table>``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import Recipe
from ..errors import UserError
from ..model import HybridLM
from ..recipes import resolve
from ..recipes.plain import recipe_mapping
from ..rows import read_rows
from ..tasks import Task
from ..training.device import resolve_device
from ..training.evaluation import test_metrics
from .claims.errors import ClaimsError, read_record
from .preregistration import git
from .results import group_by_cell

FILENAME = "untrained.json"


def untrained_metrics(recipe: Recipe | dict) -> dict:
    """The end-of-run metrics of the recipe's model at step 0, in fp32 (a row's plain recipe is resolved)."""
    if isinstance(recipe, dict):
        recipe = resolve(recipe_mapping(recipe))
    task = Task.from_spec(recipe.task)
    device = resolve_device(recipe.train.device)
    torch.manual_seed(recipe.seed)
    model = HybridLM.from_recipe(recipe, task.vocab_size).to(device)
    return test_metrics(model, recipe, task, device, "fp32")


def row_metrics(row: dict) -> dict | None:
    """The step-0 metrics a row recorded (rows of this version record them; older rows do not)."""
    return row.get("step0_metrics")


def path_of(root: Path, table: str) -> Path:
    return root / "tables" / table / FILENAME


def load(root: Path, table: str) -> dict[str, dict[int, dict]]:
    """``{label: {seed: metrics}}`` of a table's step-0 evaluation: what its rows recorded, else what
    ``untrained.json`` holds for the older rows (empty when neither has any)."""
    out = _read_file(path_of(root, table), table)
    rows = root / "tables" / table / "results.jsonl"
    for label, cell_rows in (group_by_cell(read_rows(rows)) if rows.is_file() else {}).items():
        for row in cell_rows:
            if row_metrics(row) is not None:
                out.setdefault(label, {})[int(row["recipe"]["seed"])] = row_metrics(row)
    return out


def _read_file(path: Path, table: str) -> dict[str, dict[int, dict]]:
    """``{label: {seed: metrics}}`` of an ``untrained.json`` (empty when there is none); one that is not such a file
    (a merge left conflict markers in it, a hand edit) is refused naming it, never read as no evaluation."""
    fix = f"repair it or delete it and run zoo claims --untrained {table}"
    data = read_record(path, fix)
    if data is None:
        return {}
    cells = data.get("cells") or {} if isinstance(data, dict) else None
    if not isinstance(cells, dict) or not all(isinstance(seeds, dict) for seeds in cells.values()):
        raise ClaimsError(f"{path}: not {{\"commit\": ..., \"cells\": {{label: {{seed: metrics}}}}}}; {fix}")
    try:
        return {label: {int(seed): m for seed, m in seeds.items()} for label, seeds in cells.items()}
    except ValueError as err:
        raise ClaimsError(f"{path}: a seed that is not a whole number ({err}); {fix}") from None


def write(root: Path, table: str, labels: set[str] | None = None, threads: int = 1) -> Path:
    """Evaluate the untrained model of every row of ``table`` (of the cells ``labels``, if given) and write
    ``untrained.json``; cells already evaluated are kept. A table without rows (``results.jsonl``) is refused:
    there is nothing to evaluate, and rows made since record their step-0 metrics themselves."""
    rows_path = root / "tables" / table / "results.jsonl"
    if not rows_path.is_file():
        raise UserError(f"zoo claims --untrained {table}: {rows_path} does not exist, so there is no row to evaluate "
                        f"(rows zoo ablate writes record their untrained models' metrics themselves)")
    torch.set_num_threads(threads)
    found = load(root, table)
    for label, rows in group_by_cell(read_rows(rows_path)).items():
        if labels is not None and label not in labels:
            continue
        for row in rows:
            seed = int(row["recipe"]["seed"])
            if seed not in found.get(label, {}):
                found.setdefault(label, {})[seed] = untrained_metrics(row["recipe"])
    commit = (git(root, "rev-parse", "--short", "HEAD") or "").strip()
    path = path_of(root, table)
    cells = {label: {str(s): found[label][s] for s in sorted(found[label])} for label in sorted(found)}
    path.write_text(json.dumps({"commit": commit, "cells": cells}, indent=1, sort_keys=True) + "\n")
    return path
