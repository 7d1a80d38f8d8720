"""Learning curves of an ablation's rows against the tokens trained on: validation bits per byte for language
models, test accuracy for every other task (MQAR and the other synthetic tasks).

A row's ``history`` holds its periodic evaluations (``train.eval_every``): the step, ``test_loss`` and
``test_accuracy`` on the test split at the training length, the same data as the row's final evaluation. A
language model's ``test_loss`` is the mean loss in nats per token over its validation windows, where the row also
has ``val_bpb``; so the row's ratio ``val_bpb / test_loss`` (1/ln 2 times the tokens per byte of those windows)
turns every periodic loss into bits per byte. The curve starts at the untrained model (the row's
``step0_metrics``, evaluated in fp32) and ends at the final evaluation. Tokens = step x ``train.batch_size`` x
``task.seq_len``. A folder with a language-model row draws bits per byte (its other rows have no curve), any
other folder test accuracy (:func:`zoo.experiments.results.plotted_metric`).

    python -m zoo.experiments.curves DIR     # DIR/results.jsonl -> DIR/curves.png (and curves.csv)

A cell with several seeds is drawn as the mean over its seeds at the steps they share. In an ablation's folder
(one with the grid layout ``cells.json``) the curves hold the grid's own training rows under their current
labels, as its tables do (:func:`zoo.experiments.results.split_rows`): an eval row, a row of an earlier grid or
a later row of a cell's recipe is neither a curve of its own nor a seed of a cell.
"""
from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

from ..errors import UserError
from ..rows import read_rows
from .results import cell_styles, figure, group_by_cell, legend_columns, plotted_metric, read_layout, split_rows

#: the y axis of a curve of each metric
AXIS = {"val_bpb": "validation bits per byte (training length)",
        "test_accuracy": "test accuracy (training length)"}


def curve(row: dict, metric: str = "val_bpb") -> list[tuple[int, float]]:
    """``[(tokens, value)]`` of a row's ``metric`` (``val_bpb`` or ``test_accuracy``), its final evaluation last;
    empty for a row without that metric."""
    m = row["metrics"]
    if not isinstance(m.get(metric), (int, float)) or (metric == "val_bpb" and not m.get("test_loss")):
        return []
    tokens_per_step = row["recipe"]["train"]["batch_size"] * row["recipe"]["task"]["seq_len"]
    start = (row.get("step0_metrics") or {}).get(metric)
    points = [(0, start)] if isinstance(start, (int, float)) else []
    if metric == "val_bpb":  # the periodic losses in nats per token, as bits per byte
        per_nat = m["val_bpb"] / m["test_loss"]
        periodic = [(h["step"], h.get("test_loss", math.nan) * per_nat) for h in row.get("history") or []]
    else:
        periodic = [(h["step"], h.get(metric, math.nan)) for h in row.get("history") or []]
    points += [(step * tokens_per_step, value) for step, value in periodic if math.isfinite(value)]
    return points + [(m["steps"] * tokens_per_step, m[metric])]


def mean_curve(rows: list[dict], metric: str = "val_bpb") -> list[tuple[int, float]]:
    """The mean curve of one cell's rows (one per seed), at the token counts every row has."""
    curves = [dict(curve(r, metric)) for r in rows]
    shared = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return [(t, sum(c[t] for c in curves) / len(curves)) for t in shared]


def plot_curves(rows: list[dict], path: Path, title: str = "",
                metric: str = "val_bpb") -> dict[str, list[tuple[int, float]]]:
    """Draw every cell's learning curve of ``metric`` into ``path`` (PNG); returns the curves drawn, by cell."""
    cells = {label: mean_curve(group, metric) for label, group in group_by_cell(rows).items()}
    cells = {label: points for label, points in cells.items() if points}
    if not cells:
        raise UserError(f"no finished rows with {metric} to draw learning curves of; run the grid first (zoo ablate)")
    styles = cell_styles(list(cells))
    with figure(path, size=(9.5, 4.5), title=title) as (fig, ax):
        for label, points in cells.items():
            ax.plot([t / 1e6 for t, _ in points], [b for _, b in points], markersize=3, label=label, **styles[label])
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel(AXIS[metric])
        fig.legend(*ax.get_legend_handles_labels(), loc="center right", fontsize=7, ncol=legend_columns(len(cells)))
    return cells


def write_curves(out_dir: Path, title: str = "", report=None) -> Path:
    """``out_dir/curves.png`` and ``curves.csv`` (cell, tokens, and ``val_bpb`` or ``test_accuracy``) from
    ``out_dir/results.jsonl``; a damaged line of it (a seed the curves leave out) goes to ``report``."""
    if not (out_dir / "results.jsonl").is_file():
        what = "is a file, not a results folder" if out_dir.is_file() else "holds no results.jsonl"
        raise UserError(f"{out_dir} {what}; give the folder zoo ablate RECIPE --out DIR wrote (DIR)")
    rows = read_rows(out_dir / "results.jsonl", report)
    name = rows[-1]["recipe"].get("name", "") if rows else ""
    layout = read_layout(out_dir)
    if layout is not None:  # the grid's own cells, as in its tables
        rows = split_rows(rows, layout)[0]
        name = layout.get("title") or name
    metric = plotted_metric(rows)
    cells = plot_curves(rows, out_dir / "curves.png", title or name, metric)
    with open(out_dir / "curves.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["cell", "tokens", metric])
        writer.writerows([label, t, f"{b:.6f}"] for label, points in cells.items() for t, b in points)
    return out_dir / "curves.png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.experiments.curves", description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="an ablation folder holding results.jsonl")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)

    def report(damage):
        print(f"zoo: {damage.describe()}; not drawn (zoo ablate on this folder moves it aside and recomputes its "
              f"cell)", file=sys.stderr)
    try:
        print(f"wrote {write_curves(Path(args.dir), args.title, report)}")
    except UserError as err:
        print(f"zoo: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
