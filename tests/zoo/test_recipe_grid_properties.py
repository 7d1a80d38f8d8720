"""A grid mapping crossed with ``seeds`` against cells listed here by nested loops: one cell per combination of
values, the last key varying fastest, each run once per seed (cell-major), labelled ``<last key part>=<value>``,
its recipe holding the cell's values, its seed and the command line's overrides."""
from __future__ import annotations

import copy
import random
from pathlib import Path

import torch
import yaml

from zoo.recipes import resolve

TINY = yaml.safe_load((Path(__file__).parent / "recipes" / "tiny.yaml").read_text())
POOLS = {"train.lr": [1e-3, 2e-3, 5e-3], "train.weight_decay": [0.0, 0.05, 0.1], "train.steps": [6, 7, 9],
         "train.batch_size": [8, 16, 32]}


def combinations_by_hand(keys: list[str], grid: dict) -> list[list]:
    if not keys:
        return [[]]
    return [[value] + rest for value in grid[keys[0]] for rest in combinations_by_hand(keys[1:], grid)]


def value_at(recipe, key: str):
    section, name = key.split(".")
    return getattr(getattr(recipe, section), name)


def test_grid_cells_follow_the_written_keys_and_run_once_per_seed():
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    keys = rng.sample(sorted(POOLS), rng.randint(1, 3))
    grid = {key: rng.sample(POOLS[key], 2 if len(keys) > 1 else 3) for key in keys}
    seeds = rng.sample(range(100), rng.randint(2, 3))
    warmup = rng.randint(0, 5)
    data = copy.deepcopy(TINY)
    data["grid"], data["seeds"] = grid, seeds
    recipe = resolve(data, [f"train.warmup_steps={warmup}"])
    expected = [(" ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(keys, values)), dict(zip(keys, values)), seed)
                for values in combinations_by_hand(keys, grid) for seed in seeds]
    got = [(cell.label, {k: value_at(cell.recipe, k) for k in keys}, cell.recipe.seed) for cell in recipe.cells]
    assert got == expected, (grid, seeds)
    assert all(cell.recipe.train.warmup_steps == warmup for cell in recipe.cells)
    assert len({cell.recipe.key for cell in recipe.cells}) == len(expected)


def test_a_pattern_is_repeated_and_cut_to_n_layers():
    rng = random.Random(int(torch.randint(0, 2**31, ())))
    pattern = ["attention", "mamba2"] + [rng.choice(["attention", "mamba2"]) for _ in range(rng.randint(0, 1))]
    rng.shuffle(pattern)
    n_layers = rng.randint(len(pattern), 7)
    data = copy.deepcopy(TINY)
    data["model"].pop("layers")
    data["model"]["pattern"], data["model"]["n_layers"] = pattern, n_layers
    repeated = []
    while len(repeated) < n_layers:
        repeated += pattern
    recipe = resolve(data)
    assert [spec.name for spec in recipe.layers] == repeated[:n_layers]
    assert recipe.plain["model"]["layers"] == repeated[:n_layers]
    # overriding one layer first writes the pattern out into its layers
    at = rng.randrange(n_layers)
    other = "attention" if repeated[at] == "mamba2" else "mamba2"
    changed = resolve(data, [f"model.layers.{at}={other}"])
    assert [spec.name for spec in changed.layers] == repeated[:at] + [other] + repeated[at + 1:n_layers]
