"""An ablation folder's tables and plots as a researcher meets them: labels with characters markdown or tabulate
would read as something else come back as written (read through a markdown parser), a zero-shot task's columns
follow its test lengths in numeric order, in a grid of many cells every cell keeps a colour and marker of its own
in results.png and curves.png, with the whole legend inside the figure; a damaged grid layout (cells.json) or a
wrong folder is one line naming it, and the learning curves name every damaged row they leave out."""
from __future__ import annotations

import contextlib
import csv
import json
import random
import statistics
from html.parser import HTMLParser

import pytest
import torch
from matplotlib.colors import to_rgba

from zoo.cli import main
from zoo.experiments import curves, results
from zoo.experiments.results import LAYOUT_NAME, render_folder
from zoo.rows import append_row

#: labels tabulate would read as numbers (a column of them only), and labels markdown would read as formatting
NUMBER_LIKE = ["1e-3", "3e-4", "0.10", "007", "1_000"]
MARKDOWN_LIKE = ["*best* run", "a|b", "`code`", "<b>bold</b>", "ü ~~gone~~", "back\\slash|", "ska_p1", "0.10"]


def _row(label: str, key: str, seed: int, rng: random.Random, metrics: dict | None = None) -> dict:
    steps = 8
    return {"recipe_key": key, "label": label, "seed": seed,
            "recipe": {"seed": seed, "model": {"layers": ["attention", "mamba2"]}, "task": {"seq_len": 16},
                       "train": {"batch_size": 4}},
            "metrics": {"test_accuracy": rng.random(), "test_accuracy@32": rng.random(), "params": 100,
                        "state_size": rng.choice([512, 1024]), "steps": steps, "train_seconds": rng.uniform(1, 9),
                        **(metrics or {})},
            "history": [{"step": s, "test_accuracy": rng.random(), "test_loss": 3.0} for s in (2, 4, 6)]}


def _write_grid(folder, rows: list[dict], labels: dict[str, str]) -> None:
    layout = {"title": "t", "cells": [{"key": row["recipe_key"], "label": labels[row["recipe_key"]]} for row in rows]}
    (folder / LAYOUT_NAME).write_text(json.dumps(layout))
    for row in rows:
        append_row(folder / "results.jsonl", row)


class _Tables(HTMLParser):
    """The text of every table cell of an HTML page, table by table, row by row."""

    def __init__(self):
        super().__init__()
        self.tables, self._cell = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ""
        elif self._cell is not None:  # markup inside a cell: the label was read as formatting
            self._cell += f"<{tag}>"

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def _html_tables(markdown: str) -> list[list[list[str]]]:
    markdown_it = pytest.importorskip("markdown_it")
    page = markdown_it.MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(markdown)
    parser = _Tables()
    parser.feed(page)
    return parser.tables


@pytest.mark.parametrize("written", [NUMBER_LIKE, MARKDOWN_LIKE])
def test_labels_come_back_as_written_and_the_seed_summary_matches_the_rows(tmp_path, written):
    rng = random.Random(torch.initial_seed())
    labels = rng.sample(written, len(written))
    seeds = rng.sample(range(100), 3)
    rows = [_row(f"old {i}", f"k{i}-{seed}", seed, rng) for i in range(len(labels)) for seed in seeds]
    _write_grid(tmp_path, rows, {f"k{i}-{seed}": label for i, label in enumerate(labels) for seed in seeds})
    render_folder(tmp_path, plot=False)

    summary, per_seed = _html_tables((tmp_path / "results.md").read_text())
    assert [line[0] for line in summary[1:]] == labels
    assert [line[0] for line in per_seed[1:]] == [label for label in labels for _ in seeds]
    column = summary[0].index("test_accuracy")
    for i, line in enumerate(summary[1:]):
        values = [row["metrics"]["test_accuracy"] for row in rows[3 * i:3 * i + 3]]
        assert line[column] == f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"
        assert line[summary[0].index("seeds")] == f"3 ({', '.join(map(str, sorted(seeds)))})"
    with open(tmp_path / "results.csv", newline="") as fh:
        assert [line["cell"] for line in csv.DictReader(fh)] == [label for label in labels for _ in seeds]


def test_a_zero_shot_tasks_columns_follow_its_test_lengths(tmp_path):
    rng = random.Random(torch.initial_seed())
    lengths = sorted(rng.sample([64, 128, 512, 1024, 4096, 16384], 3))
    knobs = sorted(rng.sample([0, 2, 5, 10, 30], 3))
    tasks = sorted(rng.sample(["niah", "multi_hop", "common_word"], 2))
    expected = [f"test_accuracy@{n}" for n in lengths]
    expected += [f"test_accuracy@num_iter={k}" for k in knobs]
    expected += [f"test_accuracy@task={t}{f'@{n}' if n else ''}" for t in tasks for n in [0, *lengths]]
    metrics = {name: rng.random() for name in rng.sample(expected, len(expected))}
    rows = [_row("cell", f"k{seed}", seed, rng, metrics) for seed in range(2)]
    _write_grid(tmp_path, rows, {row["recipe_key"]: "cell" for row in rows})
    render_folder(tmp_path, plot=False)

    with open(tmp_path / "results.csv", newline="") as fh:
        header = next(csv.reader(fh))
    shown = [c for c in header if c.startswith("test_accuracy@") and c != "test_accuracy@32"]
    assert shown == expected


@contextlib.contextmanager
def _recording(figures: list, draw):
    """``draw`` (results.figure), keeping every figure it makes in ``figures``."""
    @contextlib.contextmanager
    def figure(*args, **kwargs):
        with draw(*args, **kwargs) as (fig, axes):
            figures.append(fig)
            yield fig, axes
    yield figure


def _inside(fig, artist) -> bool:
    box, page = artist.get_window_extent(), fig.bbox
    return box.x0 >= page.x0 - 1 and box.y0 >= page.y0 - 1 and box.x1 <= page.x1 + 1 and box.y1 <= page.y1 + 1


@pytest.mark.parametrize("n_cells", [24, 45])
def test_every_cell_of_a_large_grid_keeps_its_own_colour_and_marker(tmp_path, monkeypatch, n_cells):
    rng = random.Random(torch.initial_seed() + n_cells)
    rows = [_row(f"cell {i}", f"k{i}-{seed}", seed, rng, {"state_size": 512 * (1 + i % 2)})
            for i in range(n_cells) for seed in (0, 1)]  # two decode-state sizes: a second panel
    _write_grid(tmp_path, rows, {row["recipe_key"]: row["label"] for row in rows})
    figures: list = []
    with _recording(figures, results.figure) as figure:
        monkeypatch.setattr(results, "figure", figure)
        monkeypatch.setattr(curves, "figure", figure)
        render_folder(tmp_path)
        curves.write_curves(tmp_path)
    table_figure, curve_figure = figures

    for ax in table_figure.axes:  # by length, then by decode state
        drawn = {c.get_label(): (to_rgba(c.lines[0].get_color()), c.lines[0].get_marker()) for c in ax.containers}
        assert len(drawn) == n_cells and len(set(drawn.values())) == n_cells
    length_styles = {c.get_label(): c.lines[0].get_color() for c in table_figure.axes[0].containers}
    state_styles = {c.get_label(): c.lines[0].get_color() for c in table_figure.axes[1].containers}
    assert length_styles == state_styles  # one colour per cell in both panels
    lines = {line.get_label(): (to_rgba(line.get_color()), line.get_marker()) for line in curve_figure.axes[0].lines}
    assert len(lines) == n_cells and len(set(lines.values())) == n_cells
    for fig in figures:
        (legend,) = fig.legends
        assert len(legend.get_texts()) == n_cells and _inside(fig, legend)


DAMAGED_LAYOUTS = {"cut short": b'{"title": "t", "cells": [{"key": "k0-0", "lab',
                   "not an object": b"[]\n",
                   "no cells": b'{"title": "t"}\n',
                   "a cell without its label": b'{"title": "t", "cells": [{"key": "k0-0"}]}\n',
                   "not UTF-8": b'{"title": "\xff"}\n'}


@pytest.mark.parametrize("damage", sorted(DAMAGED_LAYOUTS))
def test_a_damaged_grid_layout_is_one_line_naming_it_and_loses_nothing(tmp_path, capsys, damage):
    rng = random.Random(torch.initial_seed())
    rows = [_row("cell", f"k0-{seed}", seed, rng) for seed in range(2)]
    _write_grid(tmp_path, rows, {row["recipe_key"]: "cell" for row in rows})
    (tmp_path / LAYOUT_NAME).write_bytes(DAMAGED_LAYOUTS[damage])
    kept = (tmp_path / "results.jsonl").read_bytes()

    assert main(["table", str(tmp_path), "--no-plot"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and str(tmp_path / LAYOUT_NAME) in error and "zoo ablate" in error
    assert curves.main([str(tmp_path)]) == 2
    assert str(tmp_path / LAYOUT_NAME) in capsys.readouterr().err
    assert (tmp_path / "results.jsonl").read_bytes() == kept and not (tmp_path / "results.md").exists()


def test_a_grid_none_of_whose_cells_has_a_row_lists_the_rows_it_holds(tmp_path):
    rng = random.Random(torch.initial_seed())
    earlier = [_row("1e-3", f"old-{seed}", seed, rng) for seed in range(2)]
    for row in earlier:
        append_row(tmp_path / "results.jsonl", row)
    (tmp_path / LAYOUT_NAME).write_text(json.dumps({"title": "t", "cells": [{"key": "new-0", "label": "new"}]}))
    render_folder(tmp_path, plot=False)

    text = (tmp_path / "results.md").read_text()
    main_table, others = _html_tables(text)
    assert main_table[1:] == [] and [line[0] for line in others[1:]] == ["1e-3", "1e-3"]
    assert "`new` (1 of 1 run)" in text


def test_learning_curves_name_a_wrong_folder_and_every_seed_they_leave_out(tmp_path, capsys):
    rng = random.Random(torch.initial_seed())
    rows = [_row("cell", f"k0-{seed}", seed, rng) for seed in range(3)]
    _write_grid(tmp_path, rows, {row["recipe_key"]: "cell" for row in rows})
    for folder, what in ((tmp_path / "typo", "holds no results.jsonl"),
                         (tmp_path / "results.jsonl", "is a file, not a results folder")):
        assert curves.main([str(folder)]) == 2
        assert capsys.readouterr().err.strip() == (f"zoo: error: {folder} {what}; give the folder zoo ablate RECIPE "
                                                   f"--out DIR wrote (DIR)")

    whole = (tmp_path / "results.jsonl").read_bytes()
    (tmp_path / "results.jsonl").write_bytes(whole[:-len(json.dumps(rows[-1])) // 2])  # the last row cut short
    assert curves.main([str(tmp_path)]) == 0
    assert "line 3 is not a results row" in capsys.readouterr().err
    with open(tmp_path / "curves.csv", newline="") as fh:
        final = [line for line in csv.DictReader(fh) if line["tokens"] == str(8 * 4 * 16)]
    kept = [row["metrics"]["test_accuracy"] for row in rows[:2]]
    assert [float(line["test_accuracy"]) for line in final] == [pytest.approx(statistics.mean(kept), abs=1e-6)]
