"""A table's plot where the rows do not all have the same metrics: a grid mixing a language model with an
accuracy task, or seeds of one cell evaluated at different test lengths. Each point is the mean over the rows
that have the metric (as the seed table counts them), a cell without it is left out, and the table is written."""
from __future__ import annotations

import json
import statistics

import pytest
import torch

from zoo.experiments import results

from .test_plot_headline_metric import _drawn_figure


def _row(label: str, seed: int, metrics: dict, key: str = "k") -> dict:
    return {"recipe_key": f"{key}{seed}", "label": label, "seed": seed, "metrics": metrics,
            "recipe": {"seed": seed, "model": {"layers": ["attention"]}, "task": {"seq_len": 32}}}


def test_a_grid_mixing_a_language_model_and_an_accuracy_task_plots_the_cells_with_bits_per_byte(tmp_path, monkeypatch):
    drawn = _drawn_figure(monkeypatch)
    bpb = (1 + torch.rand(3)).tolist()
    acc = torch.rand(2).tolist()
    rows = [_row("lm", s, {"val_bpb": b, "state_size": 64}, "lm") for s, b in enumerate(bpb)]
    rows += [_row("recall", s, {"test_accuracy": a, "state_size": 256}, "mq") for s, a in enumerate(acc)]
    with open(tmp_path / "results.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    text = results.render_folder(tmp_path)
    assert "recall" in text and "lm" in text  # the table holds both cells
    assert (tmp_path / "results.png").stat().st_size > 1000
    by_bars, by_state = drawn["fig"].axes
    assert [t.get_text() for t in by_bars.get_xticklabels()] == ["lm"]
    assert [p.get_height() for p in by_bars.patches] == pytest.approx([statistics.mean(bpb)])
    assert [c.get_label() for c in by_state.containers] == ["lm"]
    assert by_state.containers[0].lines[0].get_ydata()[0] == pytest.approx(statistics.mean(bpb))


def test_a_length_some_seeds_lack_is_the_mean_over_the_seeds_that_have_it(tmp_path, monkeypatch):
    drawn = _drawn_figure(monkeypatch)
    acc, at_64 = torch.rand(3).tolist(), torch.rand(2).tolist()
    rows = [_row("a", s, {"test_accuracy": acc[s], **({"test_accuracy@64": at_64[s]} if s < 2 else {})})
            for s in range(3)]
    rows.insert(0, rows.pop())  # the seed without the length comes first
    results.plot_rows(rows, tmp_path / "p.png", "t")
    (ax,) = drawn["fig"].axes
    (container,) = ax.containers
    assert list(container.lines[0].get_xdata()) == [32, 64]
    assert list(container.lines[0].get_ydata()) == pytest.approx([statistics.mean(acc), statistics.mean(at_64)])
    segments = container.lines[2][0].get_segments()  # the error bars: sample std over the seeds at each length
    spreads = [(seg[1][1] - seg[0][1]) / 2 for seg in segments]
    assert spreads == pytest.approx([statistics.stdev(acc), statistics.stdev(at_64)])
