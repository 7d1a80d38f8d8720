"""The results file of an ablation and everything rendered from it.

``results.jsonl`` holds one JSON object per finished cell, appended (and fsynced) the moment the
cell finishes. A line cut short by a kill is dropped on the next read, so the file stays valid JSON
lines. Tables (markdown, CSV) and the plot are rendered from that file alone.
"""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

from tabulate import tabulate


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


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1000 else f"{value:.0f}"
    return value


def table_columns(rows: list[dict]) -> list[str]:
    lengths = sorted({k for r in rows for k in r["metrics"] if k.startswith("test_accuracy@") and "=" not in k},
                     key=lambda k: int(k.split("@")[1]))
    iters = sorted({k for r in rows for k in r["metrics"] if k.startswith("test_accuracy@iters=")},
                   key=lambda k: int(k.split("=")[1]))
    extra = lengths + iters
    return ["cell", "layers", "test_accuracy", *extra, "params", "state_size", "steps", "train_seconds", "seed"]


def table_rows(rows: list[dict]) -> tuple[list[str], list[list]]:
    columns = table_columns(rows)
    body = []
    for r in rows:
        m = r["metrics"]
        values = {"cell": r["label"], "layers": "+".join(r["recipe"]["model"]["layers"]), "seed": r["recipe"]["seed"], **m}
        body.append([_fmt(values.get(c, "")) for c in columns])
    return columns, body


def render(rows: list[dict], out_dir: Path, title: str = "", plot: bool = True) -> str:
    """Write results.md, results.csv and results.png; return the markdown table."""
    columns, body = table_rows(rows)
    table = tabulate(body, headers=columns, tablefmt="github")
    header = f"# {title}\n\n" if title else ""
    note = ("test_accuracy: accuracy at the supervised positions of the test split at the training length; "
            "test_accuracy@L: the same at test length L; test_accuracy@iters=k: the same model evaluated with k "
            "solver iterations (test-time compute, no retraining); state_size: decode-state elements per sequence at the "
            "training length (all layers); steps: optimizer steps taken (fewer than planned when a cell stopped early at "
            "train.early_stop_acc); train_seconds: wall time of training on the device in the row.\n\n")
    (out_dir / "results.md").write_text(header + note + table + "\n")
    with open(out_dir / "results.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(columns)
        writer.writerows(body)
    if plot and rows:
        plot_rows(rows, out_dir / "results.png", title)
    return table


def plot_rows(rows: list[dict], path: Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({int(k.split("@")[1]) for r in rows for k in r["metrics"]
                      if k.startswith("test_accuracy@") and "=" not in k})
    fig, ax = plt.subplots(figsize=(7, 4))
    if lengths:
        for r in rows:
            m = r["metrics"]
            train_len = r["recipe"]["task"].get("seq_len")
            present = [L for L in lengths if f"test_accuracy@{L}" in m]  # cells of a mixed grid differ
            xs = [train_len] + present
            ys = [m["test_accuracy"]] + [m[f"test_accuracy@{L}"] for L in present]
            ax.plot(xs, ys, marker="o", label=r["label"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("test sequence length")
        ax.legend(fontsize=7)
    else:
        labels = [r["label"] for r in rows]
        ax.bar(range(len(rows)), [r["metrics"]["test_accuracy"] for r in rows])
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
