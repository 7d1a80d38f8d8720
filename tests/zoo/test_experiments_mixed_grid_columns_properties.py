"""A grid that mixes language-model cells (bits per byte) with recall cells (accuracy): the per-seed table and the
seed summary show both kinds of metric, each cell's numbers under its own columns and blank under the other's."""
from __future__ import annotations

import random
import statistics

import torch

from zoo.experiments.results import seed_table, table_columns, table_rows


def _row(label: str, seed: int, metrics: dict) -> dict:
    return {"label": label, "metrics": metrics,
            "recipe": {"seed": seed, "model": {"layers": ["attention"]}, "task": {"seq_len": 32}}}


def test_a_mixed_grid_shows_bits_per_byte_and_accuracy_each_under_its_own_columns():
    rng = random.Random(torch.initial_seed())
    seeds = rng.sample(range(20), 3)
    common = {"params": 1000, "state_size": 64, "steps": 4, "train_seconds": 1.0}
    lm = [_row("lm", s, {**common, "val_bpb": rng.uniform(2, 5), "val_bpb@256": rng.uniform(2, 5),
                         "val_ppl": rng.uniform(3, 30), "train_tokens_per_second": 1e4}) for s in seeds]
    recall = [_row("recall", s, {**common, "test_accuracy": rng.random(), "test_accuracy@64": rng.random()})
              for s in seeds]
    rows = lm + recall
    rng.shuffle(rows)
    columns = table_columns(rows)
    for name in ("val_bpb", "val_bpb@256", "val_ppl", "test_accuracy", "test_accuracy@64", "params"):
        assert name in columns
    _, body = table_rows(rows)
    for row, line in zip(rows, body):
        shown = dict(zip(columns, line))
        for name in ("val_bpb", "test_accuracy", "test_accuracy@64"):
            if name in row["metrics"]:
                assert shown[name] == f"{row['metrics'][name]:.4f}"
            else:
                assert shown[name] == ""
    summary_columns, summary = seed_table(rows)
    by_cell = {line[0]: dict(zip(summary_columns, line)) for line in summary}
    for cell, group, name in (("lm", lm, "val_bpb"), ("recall", recall, "test_accuracy@64")):
        values = [r["metrics"][name] for r in group]
        assert by_cell[cell][name] == f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"
    assert by_cell["lm"]["test_accuracy"] == "" and by_cell["recall"]["val_bpb"] == ""


def test_a_table_of_one_kind_keeps_its_columns():
    rng = random.Random(torch.initial_seed())
    common = {"params": 1000, "state_size": 64, "steps": 4, "train_seconds": 1.0}
    recall = [_row("r", s, {**common, "test_accuracy": rng.random()}) for s in range(2)]
    assert table_columns(recall) == ["cell", "layers", "test_accuracy", "params", "state_size", "steps",
                                     "train_seconds", "seed"]
    lm = [_row("l", s, {**common, "val_bpb": 3.0, "val_ppl": 9.0, "train_tokens_per_second": 1.0}) for s in range(2)]
    assert table_columns(lm) == ["cell", "layers", "val_bpb", "val_ppl", "params", "state_size",
                                 "train_tokens_per_second", "steps", "train_seconds", "seed"]
