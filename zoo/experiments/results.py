"""Everything rendered from result files: ablation tables and ``zoo bench`` tables.

``results.jsonl`` (:mod:`zoo.rows`) holds one JSON object per finished run. Tables
(markdown, CSV) and plots (PNG) are rendered from the stored records alone, through one
table writer (:func:`write_table`) and one figure helper (:func:`figure`) for both kinds of result.

A folder written by ``zoo ablate`` holds its grid's layout in ``cells.json`` (title, and each cell's recipe
key and label in grid order). There the main table, the seed summary, ``results.csv`` and the plot show
the grid's own training rows only: the rows whose recipe key is a cell of the layout, one per key (the
first in the file), under the cell's current label. Every other row of ``results.jsonl`` (``zoo eval``
rows, rows of ``zoo train``, rows of an earlier, different grid, a second row of a cell's recipe) is
listed as recorded in a separate table at the end of ``results.md``, and never counted as a seed of a
cell; a cell of the layout without a row (it failed, or has not run yet) is named below the tables, so that a
grid with a cell missing never reads as complete. A folder without ``cells.json`` renders every row in the main
table, in file order.
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure
from tabulate import tabulate

from ..errors import UserError
from ..recipes.grids import cell_of
from ..recipes.plain import layer_label
from ..rows import is_eval_row, read_rows
from ..training.throughput import MIN_WARMUP_STEPS, WARMUP_FRACTION

#: an ablation's grid order, labels and title, beside its results.jsonl
LAYOUT_NAME = "cells.json"


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1000 else f"{value:.0f}"
    return value


#: characters markdown would read as formatting inside a table cell (a backslash first: it escapes the others)
_MARKDOWN_SPECIAL = ("\\", "|", "*", "`", "<", "~")

#: columns of names, never numbers: tabulate would otherwise rewrite a label such as ``1e-3`` or ``0.10``
TEXT_COLUMNS = ("cell", "layers", "seeds", "recipe_key", "evaluates")


def _markdown_cell(value):
    """A table cell as GitHub markdown reads it: a ``|`` in a label or an override escaped (it would end the
    cell), as are ``*``, backticks, ``<``, ``~`` and backslashes (emphasis, code, HTML or strikethrough would hide
    them), and line breaks written as escapes (they would end the row)."""
    if not isinstance(value, str):
        return value
    for char in _MARKDOWN_SPECIAL:
        value = value.replace(char, "\\" + char)
    return value.replace("\r", "\\r").replace("\n", "\\n")


def markdown_table(body: list[list], columns: list[str]) -> str:
    """``body`` under ``columns`` as a GitHub markdown table, whatever characters its labels hold."""
    return tabulate([[_markdown_cell(v) for v in line] for line in body],
                    headers=[_markdown_cell(c) for c in columns], tablefmt="github",
                    disable_numparse=[i for i, c in enumerate(columns) if c in TEXT_COLUMNS] if body else False)


def write_table(out_dir: Path, stem: str, columns: list[str], body: list[list], head: str = "",
                tail: str = "") -> str:
    """Write ``<stem>.md`` (``head``, a GitHub table, then ``tail``) and ``<stem>.csv`` (the table alone);
    return the table text."""
    table = markdown_table(body, columns)
    (out_dir / f"{stem}.md").write_text(head + table + "\n" + tail)
    with open(out_dir / f"{stem}.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(columns)
        writer.writerows(body)
    return table


@contextlib.contextmanager
def figure(path: Path, ncols: int = 1, size=(7, 4), title: str = ""):
    """A matplotlib figure with ``ncols`` axes, saved to ``path`` on exit. Drawn on a standalone
    :class:`~matplotlib.figure.Figure` (Agg), so pyplot's global backend and figure list stay untouched."""
    fig = Figure(figsize=size)
    axes = fig.subplots(1, ncols)
    yield fig, axes
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.8, 1) if fig.legends else None)  # room for a legend beside the axes
    fig.savefig(path, dpi=120)


def table_columns(rows: list[dict]) -> list[str]:
    """The columns of a table of ``rows``: bits per byte for language models, accuracy otherwise; a grid that mixes
    both (cells of a language-model task beside cells of a recall task) shows both."""
    accuracy_rows = [r for r in rows if "val_bpb" not in r["metrics"]]
    if len(accuracy_rows) < len(rows):  # language models: bits per byte instead of accuracy
        bpb = sorted({k for r in rows for k in r["metrics"] if k.startswith("val_bpb@")}, key=lambda k: int(k[8:]))
        memory = ["peak_memory_mib"] if any("peak_memory_mib" in r["metrics"] for r in rows) else []
        accuracy = _accuracy_columns(accuracy_rows) if accuracy_rows else []
        return ["cell", "layers", "val_bpb", *bpb, "val_ppl", *accuracy, "params", "state_size",
                *_steady_columns(rows), "train_tokens_per_second", *memory, "steps", *_diverged_column(rows),
                "train_seconds", "seed"]
    active = ["active_state_size"] if any(r["metrics"].get("active_state_size", r["metrics"].get("state_size"))
                                          != r["metrics"].get("state_size") for r in rows) else []
    return ["cell", "layers", *_accuracy_columns(rows), "params", "state_size", *active, "steps",
            *_diverged_column(rows), "train_seconds", "seed"]


def _diverged_column(rows: list[dict]) -> list[str]:
    """``diverged_at_step`` where a run stopped early because its weights were no longer finite."""
    return ["diverged_at_step"] if any("diverged_at_step" in r["metrics"] for r in rows) else []


def _accuracy_columns(rows: list[dict]) -> list[str]:
    """Test accuracy, sequence accuracy where it differs, accuracy at other lengths and at test-time knobs."""
    lengths = sorted({k for r in rows for k in r["metrics"] if k.startswith("test_accuracy@") and "=" not in k},
                     key=lambda k: int(k.split("@")[1]))
    knobs = sorted({k for r in rows for k in r["metrics"] if k.startswith("test_accuracy@") and "=" in k},
                   key=_knob_order)
    seq = ["test_sequence_accuracy"] if any(_differs_from_token_accuracy(r["metrics"]) for r in rows) else []
    return ["test_accuracy", *seq, *lengths, *knobs]


#: the steady-state throughput columns, shown where a row has them (rows written before they existed
#: have only the overall ``train_tokens_per_second``, and their tables render as they always did)
STEADY_COLUMNS = ("steady_tokens_per_second", "warmup_seconds")
STEADY_NOTE = ("steady_tokens_per_second: training tokens per second after the warm-up (the first "
               f"max({MIN_WARMUP_STEPS}, {WARMUP_FRACTION:.0%}) of a training process's steps), periodic evaluation "
               "and checkpoints excluded; warmup_seconds: "
               "the time of those warm-up steps, compilation included; train_tokens_per_second: the overall "
               "rate, every step over train_seconds, warm-up and periodic evaluation included.")


def _steady_columns(rows: list[dict]) -> list[str]:
    return list(STEADY_COLUMNS) if any("steady_tokens_per_second" in r["metrics"] for r in rows) else []


def _knob_order(key: str):
    """Knob columns by knob and value (numbers by size), a zero-shot task's columns by task, then by length:
    ``test_accuracy@task=niah``, ``@task=niah@512``, ``@task=niah@1024``."""
    setting = key.split("@", 1)[1]
    head, at, length = setting.rpartition("@")
    setting, length = (head, int(length)) if at and length.isdigit() else (setting, 0)
    name, _, value = setting.partition("=")
    try:
        return (name, float(value), value, length)
    except ValueError:
        return (name, float("inf"), value, length)


def _differs_from_token_accuracy(metrics: dict) -> bool:
    """Sequence accuracy is worth a column only where an example has more than one supervised position."""
    seq = metrics.get("test_sequence_accuracy")
    return seq is not None and abs(seq - metrics["test_accuracy"]) > 1e-12


def table_rows(rows: list[dict]) -> tuple[list[str], list[list]]:
    columns = table_columns(rows)
    body = []
    for r in rows:
        m = r["metrics"]
        values = {"cell": r["label"], "layers": "+".join(layer_label(e) for e in r["recipe"]["model"]["layers"]),
                  "seed": r["recipe"]["seed"], **m}
        body.append([_fmt(values.get(c, "")) for c in columns])
    return columns, body


def group_by_cell(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by :func:`cell_of` of their label, in order of first appearance."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(cell_of(r["label"]), []).append(r)
    return groups


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1 in the denominator; 0 for a single value)."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, std


def seed_table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """One line per cell over its seeds: every metric column as mean ± sample std over the seeds that have it as a
    finite number; where some do not, their count (a seed that diverged has a NaN loss: left out and named, not
    turned into ``nan ± nan``)."""
    per_seed_columns = table_columns(rows)
    metrics = [c for c in per_seed_columns if c not in ("cell", "layers", "seed")]
    columns = ["cell", "layers", "seeds", *metrics]
    body = []
    for cell, group in group_by_cell(rows).items():
        seeds = sorted(r["recipe"]["seed"] for r in group)
        line = [cell, "+".join(layer_label(e) for e in group[0]["recipe"]["model"]["layers"]),
                f"{len(group)} ({', '.join(map(str, seeds))})"]
        for c in metrics:
            numbers = [r["metrics"][c] for r in group if isinstance(r["metrics"].get(c), (int, float))]
            values = [v for v in numbers if math.isfinite(v)]   # a diverged seed's NaN loss would make it nan ± nan
            fewer = f" (n={len(values)})" if len(values) != len(group) else ""  # seeds without the metric
            if len(values) != len(numbers):
                fewer = f" (n={len(values)}; {len(numbers) - len(values)} not finite)"
            if not values:
                line.append(f"not finite ({len(numbers)} of {len(group)} seeds)" if numbers else "")
            elif len(values) == 1:
                line.append(f"{_fmt(values[0])}{fewer}" if fewer else _fmt(values[0]))
            elif c in ("params", "state_size", "active_state_size", "steps") and len(set(values)) == 1:
                line.append(f"{values[0]}{fewer}" if fewer else values[0])
            else:
                mean, std = mean_std([float(v) for v in values])
                line.append(f"{_fmt(mean)} ± {_fmt(std)}{fewer}")
        body.append(line)
    return columns, body


def render(rows: list[dict], out_dir: Path, title: str = "", plot: bool = True, tail: str = "") -> str:
    """Write results.md, results.csv and results.png; return the markdown table.

    When a cell has several seeds, results.md starts with one line per cell (mean ± sample standard
    deviation over its seeds) and keeps the per-seed rows below it; results.csv holds the per-seed rows.
    ``tail`` (markdown) ends results.md.
    """
    columns, body = table_rows(rows)
    header = f"# {title}\n\n" if title else ""
    note = ("test_accuracy: accuracy at the supervised positions of the test split at the training length; "
            "test_sequence_accuracy: fraction of test examples with every supervised position right; "
            "test_accuracy@L: the same at test length L; test_accuracy@knob=k: the same model evaluated with the "
            "test-time knob set to k (test-time compute, no retraining); state_size: decode-state elements per "
            "sequence at the training length (all layers); active_state_size: the part of it one decode step "
            "touches (shown when it differs); steps: optimizer steps taken (fewer than planned when a cell "
            "stopped early at "
            "train.early_stop_acc); train_seconds: wall time of training on the device in the row.\n\n")
    if _steady_columns(rows) and "train_tokens_per_second" in columns:
        note = note[:-2] + " " + STEADY_NOTE + "\n\n"
    if any(len(g) > 1 for g in group_by_cell(rows).values()):
        agg_columns, agg_body = seed_table(rows)
        summary = markdown_table(agg_body, agg_columns)
        note += (f"Mean ± sample standard deviation over the seeds of each cell (seeds: how many, and which; n: the "
                 f"seeds with a finite value, where not all have one):\n\n"
                 f"{summary}\n\nPer seed:\n\n")
        table = summary + "\n\n" + write_table(out_dir, "results", columns, body, header + note, tail)
    else:
        table = write_table(out_dir, "results", columns, body, header + note, tail)
    if plot and rows:
        plot_rows(rows, out_dir / "results.png", title)
    return table


def write_layout(out_dir: Path, title: str, cells: list) -> None:
    """Record an ablation's grid in ``out_dir/cells.json``: its title and, in grid order, each cell's recipe
    key and current label, so that every rendering of the folder orders and names the rows alike."""
    layout = {"title": title, "cells": [{"key": c.recipe.key, "label": c.label} for c in cells]}
    tmp = out_dir / f".{LAYOUT_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(layout, indent=1) + "\n")
    os.replace(tmp, out_dir / LAYOUT_NAME)


def read_layout(out_dir: Path) -> dict | None:
    """The grid layout ``zoo ablate`` recorded in ``out_dir/cells.json``, or None in a folder without one; a file
    that is not such a layout (edited by hand, cut short) is refused in one line naming it and the way out."""
    path = Path(out_dir) / LAYOUT_NAME
    if not path.exists():
        return None
    try:
        layout = json.loads(path.read_bytes())
        why = _layout_problem(layout)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        why = f"not JSON: {str(err).splitlines()[0]}"
    if why:
        raise UserError(f"{path}: not the grid layout zoo ablate writes ({why}); run the folder's zoo ablate command "
                        f"again to write it anew (finished cells are not trained again), or remove it to render "
                        f"every row of results.jsonl in file order")
    return layout


def _layout_problem(layout) -> str:
    """What keeps ``layout`` from being a grid layout (:func:`write_layout`); empty when nothing does."""
    if not isinstance(layout, dict) or not isinstance(layout.get("cells"), list):
        return "no list of cells"
    if not isinstance(layout.get("title", ""), str):
        return "its title is not a string"
    for i, cell in enumerate(layout["cells"]):
        if not (isinstance(cell, dict) and isinstance(cell.get("key"), str) and isinstance(cell.get("label"), str)):
            return f"cell {i} has no key and label"
    return ""


#: the heading of the rows of an ablation folder that are not cells of its grid
OTHER_ROWS_HEADING = "Other rows in results.jsonl, not cells of this grid"


def split_rows(rows: list[dict], layout: dict) -> tuple[list[dict], list[dict]]:
    """``(cells, others)``: the grid's own training rows in grid order under their current labels, one per
    recipe key (the first in the file), and every other row in file order (eval rows, rows of another
    recipe, later rows of a cell's recipe)."""
    order = {cell["key"]: (i, cell["label"]) for i, cell in enumerate(layout["cells"])}
    first: dict[str, dict] = {}
    others = []
    for row in rows:
        if row["recipe_key"] in order and not is_eval_row(row) and row["recipe_key"] not in first:
            first[row["recipe_key"]] = row
        else:
            others.append(row)
    cells = [{**first[key], "label": label} for key, (_i, label) in sorted(order.items(), key=lambda kv: kv[1][0])
             if key in first]
    return cells, others


#: the heading of the cells of an ablation folder's grid that have no row
MISSING_CELLS_HEADING = "Cells of this grid without a row"


def missing_cells_note(shown: list[dict], layout: dict) -> str:
    """The cells of the grid (``layout``) that have no row among ``shown`` (a cell that failed, or not run yet),
    each with how many of its runs (seeds) are missing; empty when every cell has its rows."""
    have = {row["recipe_key"] for row in shown}
    planned: dict[str, int] = {}
    missing: dict[str, int] = {}
    for cell in layout["cells"]:
        planned[cell["label"]] = planned.get(cell["label"], 0) + 1
        if cell["key"] not in have:
            missing[cell["label"]] = missing.get(cell["label"], 0) + 1
    if not missing:
        return ""
    listed = ", ".join(f"`{label}` ({n} of {planned[label]} run{'s' * (planned[label] != 1)})"
                       for label, n in missing.items())
    return (f"## {MISSING_CELLS_HEADING}\n\n"
            f"The tables above leave out these runs of the grid, which have no finished row in results.jsonl (a cell "
            f"that failed, or one not run yet); running the same zoo ablate command again runs only them: "
            f"{listed}.\n")


def other_rows_table(others: list[dict], layout: dict) -> str:
    """The rows of an ablation folder that are not cells of its grid, one line each as recorded; ``evaluates``
    names the cell (or the recipe key) whose checkpoint an eval row measured."""
    labels = {cell["key"]: cell["label"] for cell in layout["cells"]}
    columns, body = table_rows(others)
    columns = [*columns, "recipe_key", "evaluates"]
    for line, row in zip(body, others):
        trained = row.get("trained_recipe_key")
        line += [row["recipe_key"], (f"cell {labels[trained]!r}" if trained in labels else trained) if trained else ""]
    return (f"## {OTHER_ROWS_HEADING}\n\n"
            "Rows of zoo eval (evaluates: the checkpoint they measured again), of zoo train, of an earlier grid "
            "with other recipes, or a later row of a cell's recipe: each as recorded, none counted in the "
            "tables above, the seed summary or the plot.\n\n"
            + markdown_table(body, columns) + "\n")


def render_folder(out_dir: Path, title: str | None = None, plot: bool = True, report=None) -> str:
    """Render ``out_dir/results.jsonl`` (read only; damaged lines go to ``report``). In a folder with a grid
    layout (``cells.json``) the tables and the plot hold the grid's own training rows in grid order under
    their current labels, and every other row is listed in a separate table at the end of results.md
    (:func:`split_rows`); without a layout every row is rendered in file order. ``zoo ablate`` and
    ``zoo table`` both render through this function, so they write the same tables."""
    rows = read_rows(out_dir / "results.jsonl", report)
    if not rows:
        raise UserError(f"{out_dir / 'results.jsonl'}: no finished rows to render")
    layout = read_layout(out_dir)
    if layout is None:
        title = title or rows[-1]["recipe"].get("name") or out_dir.name
        return render(rows, out_dir, title=title, plot=plot)
    shown, others = split_rows(rows, layout)
    missing = missing_cells_note(shown, layout)
    tail = "\n".join(part for part in (missing, other_rows_table(others, layout) if others else "") if part)
    title = title or layout.get("title") or out_dir.name
    table = render(shown, out_dir, title=title, plot=plot, tail="\n" + tail if tail else "")
    return table + ("\n\n" + tail.rstrip("\n") if tail else "")


#: what a table's plot draws: the headline metric of its rows, how it reads, and its axis limits (None: free)
PLOTTED = {"test_accuracy": ("test accuracy", (0, 1.02)),
           "val_bpb": ("validation bits per byte", None)}


def plotted_metric(rows: list[dict]) -> str:
    """The metric a table's plot draws: ``val_bpb`` for language models (their tables lead with it), else
    ``test_accuracy``."""
    return "val_bpb" if any("val_bpb" in r["metrics"] for r in rows) else "test_accuracy"


def plot_rows(rows: list[dict], path: Path, title: str = "") -> None:
    """The headline metric (:func:`plotted_metric`) per cell (mean over the seeds that have it, error bar = sample
    std; a cell of a mixed grid without it is left out) against test length, and, when the cells' decode states
    differ, against decode-state size."""
    metric = plotted_metric(rows)
    cells = group_by_cell(rows)
    lengths = sorted({int(k.split("@")[1]) for r in rows for k in r["metrics"]
                      if k.startswith(f"{metric}@") and "=" not in k})
    states = {r["metrics"].get("state_size") for r in rows} - {None}
    ncols = 2 if len(states) > 1 else 1
    styles = cell_styles(list(cells))
    with figure(path, ncols=ncols, size=(6 * ncols + 2.5, 4), title=title) as (fig, axes):
        axes = list(axes) if ncols > 1 else [axes]
        _plot_by_length(axes[0], cells, lengths, metric, styles)
        if ncols > 1:
            _plot_state(axes[1], cells, metric, styles)
        handles, labels = axes[0].get_legend_handles_labels()
        if not handles:  # a bar chart carries its labels on the axis; the state panel still needs a legend
            handles, labels = axes[-1].get_legend_handles_labels()
        if handles:  # one legend beside the axes, however many cells
            fig.legend(handles, labels, loc="center right", fontsize=7, ncol=legend_columns(len(labels)))


#: a legend beside a plot starts another column at this many entries (a longer column would run off the figure)
LEGEND_ROWS = 24
#: markers that tell apart cells whose colours repeat (a palette holds 10 or 20 colours)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def legend_columns(entries: int) -> int:
    """Columns of a legend of ``entries`` beside a plot, so that no column runs past the figure."""
    return 1 + entries // LEGEND_ROWS


def cell_styles(labels: list[str]) -> dict[str, dict]:
    """A colour and a marker for each cell, no two alike up to 160 cells: matplotlib's 10 colours with round markers
    for up to 10 cells, else tab20's 20 colours, with another marker for each further 20 cells."""
    palette = [f"C{i}" for i in range(10)] if len(labels) <= 10 else list(matplotlib.colormaps["tab20"].colors)
    return {label: {"color": palette[i % len(palette)], "marker": MARKERS[(i // len(palette)) % len(MARKERS)]}
            for i, label in enumerate(labels)}


def _mean_std_of(group: list[dict], key: str) -> tuple[float, float] | None:
    """Mean and sample std of ``key`` over the rows of ``group`` that have it as a number (a seed without it, or a
    cell of another task in a mixed grid, is left out, as in the seed table); None when no row has it."""
    values = [float(r["metrics"][key]) for r in group if isinstance(r["metrics"].get(key), (int, float))]
    values = [v for v in values if math.isfinite(v)]   # as the seed table, which names the seeds left out
    return mean_std(values) if values else None


def _plot_by_length(ax, cells: dict[str, list[dict]], lengths: list[int], metric: str, styles: dict[str, dict]):
    words, limits = PLOTTED[metric]
    if lengths:
        for label, group in cells.items():
            train_len = group[0]["recipe"]["task"].get("seq_len")
            points = [(x, _mean_std_of(group, k)) for x, k in
                      [(train_len, metric)] + [(L, f"{metric}@{L}") for L in lengths]]  # cells of a mixed grid differ
            points = [(x, s) for x, s in points if s is not None]
            if points:
                ax.errorbar([x for x, _ in points], [s[0] for _, s in points], yerr=[s[1] for _, s in points],
                            capsize=3, label=label, **styles[label])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("test sequence length")
    else:
        drawn = {label: _mean_std_of(group, metric) for label, group in cells.items()}
        drawn = {label: s for label, s in drawn.items() if s is not None}
        ax.bar(range(len(drawn)), [s[0] for s in drawn.values()], yerr=[s[1] for s in drawn.values()], capsize=3)
        ax.set_xticks(range(len(drawn)), list(drawn), rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(f"{words} (mean ± std over seeds)")
    if limits:
        ax.set_ylim(*limits)


def _plot_state(ax, cells: dict[str, list[dict]], metric: str, styles: dict[str, dict]):
    words, limits = PLOTTED[metric]
    for label, group in cells.items():
        state = group[0]["metrics"].get("state_size")
        stats = _mean_std_of(group, metric)
        if state and stats is not None:
            ax.errorbar([state], [stats[0]], yerr=[stats[1]], capsize=3, label=label, **styles[label])
    ax.set_xscale("log")
    ax.set_xlabel("decode state (elements per sequence, at the training length)")
    ax.set_ylabel(f"{words} at the training length")
    if limits:
        ax.set_ylim(*limits)


# --------------------------------------------------------------------------------------- zoo bench
BENCH_TIMES = ("fwd_ms", "fwd_bwd_ms", "decode_ms")


def fmt_number(value, digits=3):
    if value is None:
        return "n/a"
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e6:
            return f"{value:.{digits}g}" if abs(value) < 100 else f"{value:.0f}"
        return f"{value:.2e}"
    return str(value)


def _cpu_ms(row: dict) -> float | None:
    """User + system CPU ms per forward+backward of a bench row (None when not measured)."""
    if row.get("fwd_bwd_user_ms") is None or row.get("fwd_bwd_sys_ms") is None:
        return None
    return row["fwd_bwd_user_ms"] + row["fwd_bwd_sys_ms"]


def bench_with_ratios(rows: list[dict], baseline: str | None = None) -> list[dict]:
    """Add ``<time>_vs_baseline`` (ratio to the ``baseline`` entry at the same T; default the first entry)
    and ``fwd_bwd_growth`` (fwd+bwd time over the same entry's at the previous, shorter T)."""
    base = baseline or (rows[0]["label"] if rows else None)
    attn = {r["T"]: r for r in rows if r["label"] == base}
    previous: dict[str, dict] = {}
    out = []
    for r in sorted(rows, key=lambda r: (list(dict.fromkeys(x["label"] for x in rows)).index(r["label"]), r["T"])):
        r = dict(r)
        a = attn.get(r["T"])
        for key in BENCH_TIMES:
            if a is not None and r.get(key) is not None and a.get(key):
                r[f"{key}_vs_baseline"] = r[key] / a[key]
        p = previous.get(r["label"])
        if p is not None and p.get("fwd_bwd_ms") and r.get("fwd_bwd_ms"):
            r["fwd_bwd_growth"] = r["fwd_bwd_ms"] / p["fwd_bwd_ms"]
            r["T_growth"] = r["T"] / p["T"]
            if _cpu_ms(p) and _cpu_ms(r):
                r["fwd_bwd_cpu_growth"] = _cpu_ms(r) / _cpu_ms(p)
        if r.get("fwd_bwd_ms"):
            previous[r["label"]] = r
        out.append(r)
    return out


def render_bench(result: dict, out_dir: Path, plot: bool = True) -> str:
    """Write ``bench.md`` / ``bench.csv`` (and ``bench.png``) from a ``zoo bench`` result; return the markdown."""
    env, c = result["machine"], result["config"]
    base = c.get("baseline")
    rows = bench_with_ratios(result["rows"], base)
    base = base or (rows[0]["label"] if rows else "")
    columns = ["mixer", "T", "fwd ms", "fwd+bwd ms", "growth", "fwd+bwd cpu ms", "cpu growth", "sys %",
               f"fwd+bwd / {base}", "train tok/s", "peak MiB", "prefill peak MiB", "saved MiB", "decode ms",
               f"decode / {base}"]
    columns += ["state KiB", "params", "note"]
    body = []
    for r in rows:
        growth = (f"{r['fwd_bwd_growth']:.2f}x (T x{r['T_growth']:g})" if r.get("fwd_bwd_growth") else "")
        line = [r["label"], r["T"], fmt_number(r.get("fwd_ms")), fmt_number(r.get("fwd_bwd_ms")), growth]
        cpu = _cpu_ms(r)
        line += [fmt_number(cpu), f"{r['fwd_bwd_cpu_growth']:.2f}x" if r.get("fwd_bwd_cpu_growth") else "",
                 fmt_number(100 * r["fwd_bwd_sys_ms"] / cpu if cpu else None, 2)]
        line += [fmt_number(r.get("fwd_bwd_ms_vs_baseline")), fmt_number(r.get("tok_s_train")),
                 fmt_number(r.get("peak_mib")), fmt_number(r.get("prefill_peak_mib")), fmt_number(r.get("saved_mib")),
                 fmt_number(r.get("decode_ms")), fmt_number(r.get("decode_ms_vs_baseline"))]
        sb = r.get("state_bytes")
        params = r.get("params")   # 0 for a mixer without weights: shown, not blank
        line += [fmt_number(sb / 1024 if sb is not None else None), "" if params is None else params, r.get("error") or ""]
        body.append(line)
    head = (f"# zoo bench\n\n"
            f"Device: {env['device_name']} ({env['device']}), torch {env['versions']['torch']}, "
            f"{c['threads']} threads; batch {c['batch']}, d_model {c['d_model']}, {c['dtype']}, median of "
            + (f"{c['repeats']}" if c.get("rounds", 1) == 1 else
               f"{c['rounds']} rounds x {c['repeats']} (the rounds interleaved over the whole sweep)")
            + f" after {c['warmup']} warm-up.\n"
            f"fwd = inference forward (no_grad); fwd+bwd = forward with autograd + backward; growth = fwd+bwd "
            f"time over the same mixer's at the previous T (linear in T is the T ratio); decode = one step after "
            f"a prefill of T tokens; state = decode state after that prefill; saved = tensors kept for the "
            f"backward; cpu = user + system CPU time per fwd+bwd (cpu growth: its ratio to the previous T; sys % "
            f"its system share); peak = memory of one fwd+bwd (prefill peak: of one prefill) above what was "
            f"allocated before it (CUDA allocator high-water mark, or on CPU the peak resident set size); "
            f"`/ {base}` = ratio to that entry at the same T in this run.\n"
            + _run_line(result) + "\n")
    text = head + write_table(out_dir, "bench", columns, body) + "\n"
    (out_dir / "bench.md").write_text(text)
    if plot:
        plot_bench(result, out_dir / "bench.png")
    return text


def _run_line(result: dict) -> str:
    run = result.get("run")
    if not run:
        return ""
    cpu = run["user_s"] + run["sys_s"]
    share = f" ({100 * run['sys_s'] / cpu:.1f}% of the CPU time)" if cpu else ""
    return (f"Whole run: {run['wall_s']:.0f} s wall, {run['user_s']:.0f} s user, {run['sys_s']:.1f} s system"
            f"{share}.\n")


def plot_bench(result: dict, path: Path) -> None:
    c, env = result["config"], result["machine"]
    title = f"{env['device_name']}, batch {c['batch']}, d_model {c['d_model']}, {c['dtype']}"
    with figure(path, ncols=2, size=(11, 4.2), title=title) as (fig, (ax_t, ax_s)):
        for name in dict.fromkeys(r["label"] for r in result["rows"]):
            rows = sorted((r for r in result["rows"] if r["label"] == name), key=lambda r: r["T"])
            for ax, key in ((ax_t, "fwd_bwd_ms"), (ax_s, "state_bytes")):
                pts = [(r["T"], r[key]) for r in rows if r.get(key)]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=name)
        for ax, sub, ylabel in ((ax_t, "forward + backward", "time (ms)"), (ax_s, "decode state after prefill", "bytes")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length T")
            ax.set_ylabel(ylabel)
            ax.set_title(sub)
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
