"""The learning curves of an ablation's folder hold the grid's own cells, as its tables do: an eval row, a row
of an earlier grid and a later row of a cell's recipe are neither curves of their own nor seeds of a cell, and
each cell is named by its current label. Before, every row of results.jsonl was grouped by its recorded label:
an earlier grid's row was averaged into the cell of the same label, and an eval row became a curve."""
import csv
import json
import random

from zoo.experiments.curves import write_curves
from zoo.experiments.results import LAYOUT_NAME

BATCH, SEQ = 4, 16


def _row(key, label, seed, steps, **extra):
    """A language-model row with a history of ``steps`` periodic evaluations (fresh random losses)."""
    losses = sorted((random.uniform(1.0, 3.0) for _ in range(steps)), reverse=True)
    final = losses[-1]
    history = [{"step": 10 * (i + 1), "test_loss": x} for i, x in enumerate(losses)]
    metrics = {"val_bpb": final * random.uniform(1.3, 1.6), "test_loss": final, "steps": 10 * steps,
               "test_accuracy": 0.5}
    return {"recipe_key": key, "label": label, "seed": seed, "metrics": metrics, "history": history,
            "recipe": {"seed": seed, "name": "lm", "train": {"batch_size": BATCH}, "task": {"seq_len": SEQ},
                       "model": {"layers": ["attention"]}},
            "step0_metrics": {"val_bpb": random.uniform(7.0, 8.0)}, **extra}


def _by_hand(rows):
    """Each row's points ``{tokens: bits per byte}``; then their mean at the token counts all rows have."""
    curves = []
    for r in rows:
        m = r["metrics"]
        scale = m["val_bpb"] / m["test_loss"]
        points = {0: r["step0_metrics"]["val_bpb"]}
        points.update({h["step"] * BATCH * SEQ: h["test_loss"] * scale for h in r["history"]})
        points[m["steps"] * BATCH * SEQ] = m["val_bpb"]
        curves.append(points)
    shared = sorted(set.intersection(*(set(c) for c in curves)))
    return [(t, sum(c[t] for c in curves) / len(curves)) for t in shared]


def test_curves_of_an_ablation_folder_hold_its_cells_only(tmp_path):
    a0, a1 = _row("ka0", "a", 0, 3), _row("ka1", "a", 1, 3)
    b0 = _row("kb0", "b", 0, 3)
    rows = [a0, b0,
            _row("old", "a", 2, 3),                                             # an earlier grid's cell, same label
            a1,
            _row("ka0", "a eval", 0, 3, trained_recipe_key="ka0", history=[]),  # zoo eval of a's checkpoint
            _row("ka1", "a", 1, 3)]                                             # a later row of a cell's recipe
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    layout = {"title": "grid", "cells": [{"key": "ka0", "label": "a"}, {"key": "ka1", "label": "a"},
                                         {"key": "kb0", "label": "b renamed"}]}
    (tmp_path / LAYOUT_NAME).write_text(json.dumps(layout))
    write_curves(tmp_path)
    with open(tmp_path / "curves.csv") as fh:
        found: dict[str, list] = {}
        for line in csv.DictReader(fh):
            found.setdefault(line["cell"], []).append((int(line["tokens"]), float(line["val_bpb"])))
    expected = {"a": _by_hand([a0, a1]), "b renamed": _by_hand([b0])}
    assert list(found) == list(expected)
    for cell, points in expected.items():
        assert [t for t, _ in found[cell]] == [t for t, _ in points]
        assert all(abs(x - y) < 1e-5 for (_, x), (_, y) in zip(found[cell], points)), cell


def test_curves_of_a_folder_without_a_layout_hold_every_row(tmp_path):
    a0, a1 = _row("k0", "a", 0, 2), _row("k1", "a", 1, 2)
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (a0, a1)))
    write_curves(tmp_path)
    with open(tmp_path / "curves.csv") as fh:
        lines = list(csv.DictReader(fh))
    assert {line["cell"] for line in lines} == {"a"}
    expected = _by_hand([a0, a1])
    assert [int(x["tokens"]) for x in lines] == [t for t, _ in expected]
    assert all(abs(float(x["val_bpb"]) - b) < 1e-5 for x, (_, b) in zip(lines, expected))
