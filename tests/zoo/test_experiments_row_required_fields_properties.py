"""A results line without one of the fields every row has (recipe key, label, recipe, metrics), or with it of the
wrong type, is a damaged line: reading reports it by its line number and keeps every whole row in file order,
and a repair moves exactly those lines aside, so that their cells run again instead of breaking the tables."""
from __future__ import annotations

import json
import random

import torch

from zoo.rows import DAMAGED_NAME, append_row, read_rows, repair_rows

FIELDS = {"recipe_key": "k", "label": "cell", "recipe": {"seed": 0}, "metrics": {"test_accuracy": 0.5}}
WRONG_TYPE = {"recipe_key": 7, "label": ["cell"], "recipe": "tiny.yaml", "metrics": [0.5]}


def test_a_line_missing_or_mistyping_a_required_field_is_reported_and_moved_aside(tmp_path):
    rng = random.Random(torch.initial_seed())
    path = tmp_path / "results.jsonl"
    lines, whole, bad_numbers = [], [], []
    for field in FIELDS:
        for broken in ("missing", "mistyped"):
            row = {**FIELDS, "recipe_key": f"k{len(lines)}", "metrics": {"test_accuracy": rng.random()}}
            if broken == "missing":
                del row[field]
            else:
                row[field] = WRONG_TYPE[field]
            lines.append((row, False))
        lines.append(({**FIELDS, "recipe_key": f"k{len(lines)}", "metrics": {"test_accuracy": rng.random()}}, True))
    rng.shuffle(lines)
    for number, (row, ok) in enumerate(lines, start=1):
        append_row(path, row)
        (whole if ok else bad_numbers).append(row if ok else number)
    seen = []
    assert read_rows(path, seen.append) == whole
    assert [d.line_number for d in seen] == bad_numbers
    kept, moved = repair_rows(path)
    assert kept == whole and [d.line_number for d in moved] == bad_numbers
    assert read_rows(path) == whole and [json.loads(line) for line in path.read_text().splitlines()] == whole
    assert [json.loads(line) for line in (tmp_path / DAMAGED_NAME).read_text().splitlines()] == \
        [row for row, ok in lines if not ok]
