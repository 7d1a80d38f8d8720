"""``results.jsonl`` rows: the one way a row is made, read, repaired and appended.

A row is one JSON object per finished run (an ablation cell, a ``zoo train --out`` run, a ``zoo eval``):
the recipe key and label, the overrides that made the cell, the full resolved recipe, the seed, the
metrics, and the environment it ran in (library versions, device, threads). Rows are appended (and
fsynced) in one write the moment a run finishes. A ``zoo eval`` row also carries ``trained_recipe_key``, the
recipe its checkpoint was trained under (:func:`is_eval_row`): it measures a trained model again and never
counts as a finished ablation cell or as a seed of one, even when its own ``recipe_key`` equals the cell's
(an evaluation without overrides).

Reading never deletes a valid row. A line that is not a complete UTF-8 JSON object with the fields every
row has (a line cut short by a kill, NUL bytes left by a power loss, a blank or foreign line) is
*damaged*: :func:`read_rows` skips it and reports it (file, line number, first bytes); only the driver of
an ablation, which owns the folder, calls :func:`repair_rows` to move the damaged lines to
``results.damaged.jsonl`` beside the file, so that their cells are recomputed and every valid row stays
byte for byte. Rendering commands never write ``results.jsonl``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .environment import environment

#: what every row has, with its type
REQUIRED_FIELDS = {"recipe_key": str, "label": str, "recipe": dict, "metrics": dict}
DAMAGED_NAME = "results.damaged.jsonl"


#: metrics that measure the machine rather than the model (they differ between two runs of one recipe)
TIMING_METRICS = ("train_seconds", "wall_seconds", "train_tokens_per_second", "steady_tokens_per_second",
                  "steady_steps", "warmup_seconds")


def is_eval_row(row: dict) -> bool:
    """Whether ``row`` was written by ``zoo eval`` (a trained model evaluated again), not by a training run."""
    return "trained_recipe_key" in row


def make_row(recipe, label: str, metrics: dict, overrides: dict | None = None, device=None, **extra) -> dict:
    """The results row of a run of ``recipe``; ``extra`` adds fields (history, checkpoint, host, ...). A recipe that
    imports out-of-tree modules (``imports:``) records them, so that its recipe can be run again from the row."""
    imports = {"imports": sorted(recipe.imports)} if recipe.imports else {}
    return {"recipe_key": recipe.key, "label": label, "overrides": dict(overrides or {}), "recipe": recipe.plain,
            "seed": recipe.seed, "metrics": metrics, **imports, **extra, **environment(device)}


@dataclass
class Damage:
    """One damaged line of a rows file."""
    path: Path
    line_number: int
    raw: bytes
    why: str

    def describe(self) -> str:
        return f"{self.path}: line {self.line_number} is not a results row ({self.why}; first bytes {self.raw[:40]!r})"


def _parse(line: bytes) -> tuple[dict | None, str]:
    """``(row, "")`` for a valid row line, else ``(None, why)``."""
    if not line.endswith(b"\n"):
        return None, "cut short: no line end (a write interrupted)"
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 at byte {err.start}"
    except (json.JSONDecodeError, RecursionError) as err:
        return None, f"not JSON ({str(err).splitlines()[0]})"
    if not isinstance(row, dict):
        return None, f"a JSON {type(row).__name__}, not an object"
    missing = [k for k, kind in REQUIRED_FIELDS.items() if not isinstance(row.get(k), kind)]
    if missing:
        return None, f"missing or mistyped fields {missing}"
    return row, ""


def scan_rows(path: Path) -> tuple[list[tuple[dict, bytes]], list[Damage]]:
    """Every valid row with its exact bytes, and every damaged line, of ``path`` (read only)."""
    if not path.exists():
        return [], []
    good, damaged = [], []
    for number, line in enumerate(path.read_bytes().splitlines(keepends=True), start=1):
        row, why = _parse(line)
        if row is None:
            damaged.append(Damage(path, number, line, why))
        else:
            good.append((row, line))
    return good, damaged


def read_rows(path: Path, report=None) -> list[dict]:
    """The valid rows of ``path``; each damaged line is passed to ``report`` (a callable) if given. Never writes."""
    good, damaged = scan_rows(path)
    for damage in damaged:
        if report is not None:
            report(damage)
    return [row for row, _ in good]


def repair_rows(path: Path) -> tuple[list[dict], list[Damage]]:
    """Move the damaged lines of ``path`` to ``results.damaged.jsonl`` beside it and keep every valid row
    byte for byte; returns the valid rows and what was moved. Call only while holding the folder's lock."""
    good, damaged = scan_rows(path)
    if damaged:
        with open(path.with_name(DAMAGED_NAME), "ab") as fh:
            for damage in damaged:
                fh.write(damage.raw if damage.raw.endswith(b"\n") else damage.raw + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(b"".join(line for _, line in good))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    return [row for row, _ in good], damaged


def append_row(path: Path, row: dict) -> None:
    """Append ``row`` as one line. After a line a kill cut short (no line end) the row starts a line of its own,
    so that it is not read as part of that damaged line and moved aside with it."""
    data = (json.dumps(row, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        os.write(fd, data)  # one write: a kill leaves either the whole line or a cut-off one (moved aside later)
        os.fsync(fd)
    finally:
        os.close(fd)
