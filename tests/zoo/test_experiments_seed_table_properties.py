"""The tables of an ablation folder, checked against numbers worked out here: one summary line per cell in grid
order under the cell's current label, its seeds listed in ascending order, every metric the mean and sample
standard deviation over the seeds that have it (the count named where a seed lacks it), and the per-seed
columns with test lengths and test-time knob values in numeric order."""
from __future__ import annotations

import csv
import json
import random
import statistics

import torch

from zoo.experiments.results import LAYOUT_NAME, render_folder
from zoo.rows import append_row

LENGTHS = [64, 128, 1024]  # in text order 1024 sorts before 128 and 64
KNOBS = [2, 10]


def _summary(text: str) -> dict[str, list[str]]:
    """The seed summary of results.md: cell -> its cells, in order."""
    part = text.split("Mean ± sample standard deviation", 1)[1].split("Per seed:", 1)[0]
    lines = [line for line in part.splitlines() if line.startswith("|") and not line.startswith("|--")]
    table = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    return {"columns": table[0], **{line[0]: line for line in table[1:]}}


def _fmt(value: float) -> str:
    return f"{value:.4f}"


def test_the_seed_summary_and_the_per_seed_columns_match_numbers_worked_out_by_hand(tmp_path):
    rng = random.Random(torch.initial_seed())
    cells = [(f"cell{i}", f"{rng.getrandbits(60):015x}") for i in range(rng.randint(2, 4))]
    rng.shuffle(cells)  # grid order differs from label order
    seeds = {label: rng.sample(range(50), rng.randint(2, 4)) for label, _ in cells}
    lacking = {label: rng.choice(seeds[label]) for label, _ in cells}  # a seed evaluated without the longest length
    rows = []
    for label, key in cells:
        params = rng.randrange(1000, 5000)
        for j, seed in enumerate(seeds[label]):  # listed in the order they ran, not ascending
            steps = 4 + 2 * (j % 2) if label == cells[0][0] else rng.choice([4, 6])  # a seed that stopped early
            metrics = {"test_accuracy": rng.random(), "params": params, "state_size": 64, "steps": steps,
                       "train_seconds": rng.uniform(1, 9)}
            for length in rng.sample(LENGTHS, len(LENGTHS)):
                if not (length == 1024 and seed == lacking[label]):
                    metrics[f"test_accuracy@{length}"] = rng.random()
            for knob in rng.sample(KNOBS, len(KNOBS)):
                metrics[f"test_accuracy@num_iter={knob}"] = rng.random()
            rows.append({"recipe_key": f"{key}-{seed}", "label": f"old name {label}", "seed": seed, "metrics": metrics,
                         "recipe": {"seed": seed, "model": {"layers": ["attention"]}, "task": {"seq_len": 32}}})
    layout = {"title": "t", "cells": [{"key": f"{key}-{seed}", "label": label} for label, key in cells
                                      for seed in seeds[label]]}
    (tmp_path / LAYOUT_NAME).write_text(json.dumps(layout))
    rng.shuffle(rows)  # the order the cells finished in
    for row in rows:
        append_row(tmp_path / "results.jsonl", row)
    render_folder(tmp_path, plot=False)

    metric_columns = ["test_accuracy", *(f"test_accuracy@{n}" for n in LENGTHS),
                      *(f"test_accuracy@num_iter={k}" for k in KNOBS), "params", "state_size", "steps", "train_seconds"]
    with open(tmp_path / "results.csv", newline="") as fh:
        per_seed = list(csv.reader(fh))
    assert per_seed[0] == ["cell", "layers", *metric_columns, "seed"]
    by_key = {r["recipe_key"]: r for r in rows}
    expected_order = [(label, by_key[c["key"]]) for label, _ in cells for c in layout["cells"] if c["label"] == label]
    assert [(line[0], int(line[-1])) for line in per_seed[1:]] == [(label, r["seed"]) for label, r in expected_order]

    summary = _summary((tmp_path / "results.md").read_text())
    assert summary["columns"] == ["cell", "layers", "seeds", *metric_columns]
    assert list(summary)[1:] == [label for label, _ in cells]
    for label, key in cells:
        line = dict(zip(summary["columns"], summary[label]))
        group = [r for r in rows if r["recipe_key"].startswith(key)]
        assert line["seeds"] == f"{len(group)} ({', '.join(map(str, sorted(seeds[label])))})"
        assert line["params"] == str(group[0]["metrics"]["params"])
        steps = [r["metrics"]["steps"] for r in group]
        assert line["steps"] == (str(steps[0]) if len(set(steps)) == 1 else
                                 f"{_fmt(statistics.mean(steps))} ± {_fmt(statistics.stdev(steps))}")
        for column in ("test_accuracy", "test_accuracy@64", "test_accuracy@num_iter=10", "train_seconds"):
            values = [r["metrics"][column] for r in group]
            assert line[column] == f"{_fmt(statistics.mean(values))} ± {_fmt(statistics.stdev(values))}", column
        longest = [r["metrics"]["test_accuracy@1024"] for r in group if "test_accuracy@1024" in r["metrics"]]
        if len(longest) == 1:
            expected = f"{_fmt(longest[0])} (n=1)"
        else:
            expected = f"{_fmt(statistics.mean(longest))} ± {_fmt(statistics.stdev(longest))} (n={len(longest)})"
        assert line["test_accuracy@1024"] == expected


def test_a_language_model_table_orders_its_lengths_by_number(tmp_path):
    rng = random.Random(torch.initial_seed())
    lengths = rng.sample([32, 256, 1024, 4096, 512], 4)
    metrics = {"val_bpb": rng.uniform(1, 3), "val_ppl": rng.uniform(2, 9), **{f"val_bpb@{n}": rng.uniform(1, 3)
                                                                               for n in lengths}}
    append_row(tmp_path / "results.jsonl", {"recipe_key": "k", "label": "lm", "seed": 0, "metrics": metrics,
                                            "recipe": {"seed": 0, "model": {"layers": ["gla"]},
                                                       "task": {"seq_len": 64}}})
    render_folder(tmp_path, plot=False)
    with open(tmp_path / "results.csv", newline="") as fh:
        header, line = list(csv.reader(fh))
    shown = [c for c in header if c.startswith("val_bpb@")]
    assert shown == [f"val_bpb@{n}" for n in sorted(lengths)]
    assert [float(line[header.index(c)]) for c in shown] == [round(metrics[c], 4) for c in shown]


def test_only_a_whole_seed_word_makes_rows_seeds_of_one_cell(tmp_path):
    rng = random.Random(torch.initial_seed())
    labels = ["a seed=1", "a seed=2", "init_seed=1", "init_seed=2", "seed=3 b"]
    rows = [{"recipe_key": f"k{i}", "label": label, "seed": i, "metrics": {"test_accuracy": rng.random()},
             "recipe": {"seed": i, "model": {"layers": ["attention"]}, "task": {"seq_len": 32}}}
            for i, label in enumerate(labels)]
    for row in rows:
        append_row(tmp_path / "results.jsonl", row)
    render_folder(tmp_path, plot=False)
    summary = _summary((tmp_path / "results.md").read_text())
    assert list(summary)[1:] == ["a", "init_seed=1", "init_seed=2", "b"]
    accuracy = [r["metrics"]["test_accuracy"] for r in rows[:2]]
    assert summary["a"][2:4] == ["2 (0, 1)", f"{_fmt(statistics.mean(accuracy))} ± {_fmt(statistics.stdev(accuracy))}"]


def test_an_eval_row_written_before_its_cells_training_row_is_never_the_cell(tmp_path):
    rng = random.Random(torch.initial_seed())
    key = f"{rng.getrandbits(60):015x}"
    (tmp_path / LAYOUT_NAME).write_text(json.dumps({"title": "t", "cells": [{"key": key, "label": "a"}]}))
    partial, trained = rng.uniform(0, 0.5), rng.uniform(0.5, 1)
    recipe = {"seed": 0, "model": {"layers": ["attention"]}, "task": {"seq_len": 32}}
    # zoo eval of the checkpoint of the cell's unfinished run, then the cell's own training row
    append_row(tmp_path / "results.jsonl", {"recipe_key": key, "trained_recipe_key": key, "label": "a eval",
                                            "seed": 0, "recipe": recipe, "metrics": {"test_accuracy": partial}})
    append_row(tmp_path / "results.jsonl", {"recipe_key": key, "label": "a", "seed": 0, "recipe": recipe,
                                            "metrics": {"test_accuracy": trained}})
    render_folder(tmp_path, plot=False)
    with open(tmp_path / "results.csv", newline="") as fh:
        header, *lines = list(csv.reader(fh))
    assert [(line[0], float(line[header.index("test_accuracy")])) for line in lines] == [("a", round(trained, 4))]


def test_a_seed_that_diverged_is_left_out_of_its_cells_mean_and_named(tmp_path):
    """A diverged seed's loss is NaN: the cell's summary is the mean of the finite seeds with the count of the others
    (not ``nan ± nan``); a cell where every seed diverged says so."""
    rng = random.Random(torch.initial_seed())
    finite = [rng.uniform(1, 3) for _ in range(rng.randint(2, 4))]
    bad = rng.randint(1, 2)
    values = {"mixed": finite + [float("nan")] * bad, "lost": [float("nan"), float("inf")]}
    for label, group in values.items():
        for seed, v in enumerate(group):
            append_row(tmp_path / "results.jsonl", {
                "recipe_key": f"{label}-{seed}", "label": label, "seed": seed, "metrics": {"val_bpb": v, "steps": 3},
                "recipe": {"seed": seed, "model": {"layers": ["gla"]}, "task": {"seq_len": 64}}})
    render_folder(tmp_path, plot=True)
    summary = _summary((tmp_path / "results.md").read_text())
    line = dict(zip(summary["columns"], summary["mixed"]))
    assert line["val_bpb"] == (f"{_fmt(statistics.mean(finite))} ± {_fmt(statistics.stdev(finite))} "
                               f"(n={len(finite)}; {bad} not finite)")
    assert dict(zip(summary["columns"], summary["lost"]))["val_bpb"] == "not finite (2 of 2 seeds)"
