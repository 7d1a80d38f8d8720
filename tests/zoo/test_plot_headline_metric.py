"""A table's plot draws the metric its table leads with: bits per byte for language models (lower is better, no
accuracy axis limits), test accuracy otherwise; each point is the mean over a cell's seeds."""
from __future__ import annotations

import contextlib
import statistics

import pytest
import torch

from zoo.experiments import results


def _drawn_figure(monkeypatch) -> dict:
    drawn, real_figure = {}, results.figure

    @contextlib.contextmanager
    def keep_figure(path, **kwargs):
        with real_figure(path, **kwargs) as (fig, axes):
            drawn["fig"] = fig
            yield fig, axes

    monkeypatch.setattr(results, "figure", keep_figure)
    return drawn


def test_a_language_model_table_plots_bits_per_byte_by_length_and_state(tmp_path, monkeypatch):
    drawn = _drawn_figure(monkeypatch)
    bpb = {label: (1.5 + torch.rand(3)).tolist() for label in ("attention", "gla")}
    rows = [{"label": label, "seed": seed, "recipe": {"task": {"seq_len": 64}},
             "metrics": {"val_bpb": bpb[label][seed], "val_bpb@256": bpb[label][seed] + 0.25,
                         "test_accuracy": 0.3 + 0.1 * seed, "test_accuracy@256": 0.2,
                         "state_size": 512 if label == "gla" else 4096}}
            for label in bpb for seed in range(3)]
    results.plot_rows(rows, tmp_path / "p.png", "lm")
    by_length, by_state = drawn["fig"].axes
    assert "bits per byte" in by_length.get_ylabel() and "bits per byte" in by_state.get_ylabel()
    for container, label in zip(by_length.containers, bpb):
        assert list(container.lines[0].get_xdata()) == [64, 256]
        ys = container.lines[0].get_ydata()
        assert ys[0] == pytest.approx(statistics.mean(bpb[label]))
        assert ys[1] == pytest.approx(statistics.mean(bpb[label]) + 0.25)
    assert [c.lines[0].get_ydata()[0] for c in by_state.containers] == pytest.approx(
        [statistics.mean(bpb[label]) for label in bpb])
    for ax in (by_length, by_state):  # bits per byte above 1 are inside the axes, not clipped at accuracy's 1.02
        drawn_ys = [y for c in ax.containers for y in c.lines[0].get_ydata()]
        assert ax.get_ylim()[1] >= max(drawn_ys) > 1.02


def test_a_table_without_bits_per_byte_plots_test_accuracy(tmp_path, monkeypatch):
    drawn = _drawn_figure(monkeypatch)
    acc = torch.rand(4).tolist()
    rows = [{"label": f"c{i}", "seed": 0, "recipe": {"task": {"seq_len": 32}}, "metrics": {"test_accuracy": a}}
            for i, a in enumerate(acc)]
    results.plot_rows(rows, tmp_path / "p.png", "t")
    (ax,) = drawn["fig"].axes
    assert "test accuracy" in ax.get_ylabel() and ax.get_ylim() == (0, 1.02)
    assert [patch.get_height() for patch in ax.patches] == pytest.approx(acc)


def test_the_plot_shows_each_cell_once_at_its_mean_over_seeds(tmp_path, monkeypatch):
    drawn = _drawn_figure(monkeypatch)
    acc = {label: torch.rand(3).tolist() for label in ("a", "b")}
    rows = [{"label": label, "seed": seed, "recipe": {"task": {"seq_len": 32}},
             "metrics": {"test_accuracy": acc[label][seed], "test_accuracy@64": acc[label][seed] / 2,
                         "state_size": 100 if label == "a" else 1000}}
            for label in acc for seed in range(3)]
    results.plot_rows(rows, tmp_path / "p.png", "t")
    fig = drawn["fig"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a", "b"]  # a cell, not a row, per entry
    by_length, by_state = fig.axes  # the states differ, so the second panel is drawn
    for container, label in zip(by_length.containers, "ab"):
        ys = container.lines[0].get_ydata()
        assert ys[0] == pytest.approx(statistics.mean(acc[label]))
        assert ys[1] == pytest.approx(statistics.mean(acc[label]) / 2)
    assert [c.lines[0].get_xdata()[0] for c in by_state.containers] == [100, 1000]
    assert (tmp_path / "p.png").stat().st_size > 1000
