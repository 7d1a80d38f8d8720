"""``results.jsonl`` rows: the one way a row is made, read and appended.

A row is one JSON object per finished run (an ablation cell, a ``zoo train --out`` run, a ``zoo eval``):
the recipe key and label, the overrides that made the cell, the full resolved recipe, the seed, the
metrics, and the environment it ran in (library versions, device, threads). Rows are appended (and
fsynced) the moment a run finishes. A line cut short by a kill is dropped on the next read, so the file
stays valid JSON lines.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from ..environment import environment


def make_row(recipe, label: str, metrics: dict, overrides: dict | None = None, device=None, **extra) -> dict:
    """The results row of a run of ``recipe``; ``extra`` adds fields (history, checkpoint, host, ...)."""
    return {"recipe_key": recipe.key, "label": label, "overrides": dict(overrides or {}), "recipe": recipe.plain,
            "seed": recipe.seed, "metrics": metrics, **extra, **environment(device)}


def read_rows(path: Path) -> list[dict]:
    """All complete rows; a trailing partial line (a killed write) is cut off the file."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    rows, good_end = [], 0
    for line in raw.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
        good_end += len(line)
    if good_end != len(raw):
        with open(path, "r+b") as fh:
            fh.truncate(good_end)
    return rows


def append_row(path: Path, row: dict) -> None:
    data = (json.dumps(row, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)  # one write: a kill leaves either the whole line or none
        os.fsync(fd)
    finally:
        os.close(fd)
