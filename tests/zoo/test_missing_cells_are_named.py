"""results.md of an ablation's folder names the runs of its grid that have no row (a cell that failed, or one
not run yet), with how many of each cell's seeds are missing; a complete grid renders as before. Before, a
failed cell simply was not in the table, and the rendered files read as a complete grid."""
import json
import random

from zoo.experiments.results import LAYOUT_NAME, render_folder

HEADING = "## Cells of this grid without a row"


def _row(key, label, seed):
    return {"recipe_key": key, "label": label, "seed": seed,
            "recipe": {"seed": seed, "model": {"layers": ["attention"]}, "task": {"seq_len": 16}},
            "metrics": {"test_accuracy": random.random(), "params": 10, "state_size": 4, "steps": 5,
                        "train_seconds": random.uniform(1, 2)}}


def _folder(tmp_path, planned: dict[str, list[int]], ran: dict[str, list[int]], extra_rows=()):
    layout = {"title": "g", "cells": [{"key": f"{label}-{seed}", "label": label}
                                      for label, seeds in planned.items() for seed in seeds]}
    rows = [_row(f"{label}-{seed}", label, seed) for label, seeds in ran.items() for seed in seeds]
    random.shuffle(rows)  # cells finish in any order
    (tmp_path / LAYOUT_NAME).write_text(json.dumps(layout))
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, *extra_rows]))
    return rows


def test_a_grid_with_runs_missing_names_them_in_results_md_and_the_printed_text(tmp_path):
    seeds = sorted(random.sample(range(10), 3))
    skipped = random.choice(seeds)
    planned = {"a": seeds, "b": [seeds[0]], "c": seeds[:2]}
    _folder(tmp_path, planned, {"a": [s for s in seeds if s != skipped], "c": seeds[:2]})
    printed = render_folder(tmp_path, plot=False)
    text = (tmp_path / "results.md").read_text()
    for shown in (text, printed):
        assert HEADING in shown
        note = shown.split(HEADING, 1)[1]
        assert "`a` (1 of 3 runs)" in note and "`b` (1 of 1 run)" in note and "`c`" not in note
    # the tables hold the finished runs only, and the seed summary says which seeds a rests on
    before = text.split(HEADING, 1)[0]
    kept = [s for s in seeds if s != skipped]
    assert f"| 2 ({kept[0]}, {kept[1]}) " in before
    assert "| b " not in before
    # results.csv stays the table of finished rows alone
    assert len((tmp_path / "results.csv").read_text().splitlines()) == 1 + 2 + 2


def test_the_note_comes_before_the_other_rows_and_a_complete_grid_has_none(tmp_path):
    eval_row = {**_row("a-0", "a eval", 0), "trained_recipe_key": "a-0"}
    _folder(tmp_path, {"a": [0], "b": [0]}, {"a": [0]}, [eval_row])
    render_folder(tmp_path, plot=False)
    text = (tmp_path / "results.md").read_text()
    assert text.index(HEADING) < text.index("## Other rows in results.jsonl")
    complete = tmp_path / "complete"
    complete.mkdir()
    _folder(complete, {"a": [0, 1], "b": [0]}, {"a": [0, 1], "b": [0]}, [eval_row])
    render_folder(complete, plot=False)
    assert HEADING not in (complete / "results.md").read_text()
