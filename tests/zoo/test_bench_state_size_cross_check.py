"""``zoo bench`` holds a mixer's ``state_size(T)`` (the count results tables report) against the state its prefill
returns: a mixer whose ``state_size`` undercounts its state gets a note in its row naming both counts, while its
``state KiB`` shows the bytes the state really holds; an honest mixer's row has no note."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from mixers import MIXERS, build_mixer, register_mixer
from tests.mixers.example_mixer import CumulativeMean
from zoo.benchmark import runner as bench
from zoo.benchmark.measure import measure, state_size_note
from zoo.experiments.results import render_bench


class ForgetsTheCount(CumulativeMean):
    """Counts the running sum but not the token count it also carries."""
    name = "bench_forgets_the_count"

    def state_size(self, seq_len: int) -> int:
        return self.options.d_inner


@pytest.fixture
def lying():
    register_mixer(ForgetsTheCount)
    yield ForgetsTheCount.name
    MIXERS.entries.pop(ForgetsTheCount.name, None)


def _measured(mixer, T: int, batch: int) -> dict:
    row = measure(mixer, T, batch, torch.device("cpu"), torch.float32, warmup=0, repeats=1, memory=False)
    return {**row, "T": T}


def test_an_undercounting_state_size_is_named_with_both_counts(lying):
    d_inner, T, batch = int(torch.randint(2, 9, ())), int(torch.randint(2, 12, ())), int(torch.randint(1, 4, ()))
    row = _measured(build_mixer(lying, 16, {"d_inner": d_inner}), T, batch)
    held = d_inner + 1                                   # the running sum and the token count
    assert row["state_size"] == d_inner and row["state_elements"] == held
    assert row["state_bytes"] == batch * held * 4        # fp32
    note = state_size_note(row)
    assert f"state_size({T}) = {d_inner} elements per sequence" in note and f"holds {held}" in note


def test_an_honest_state_size_gets_no_note():
    d_inner, T, batch = int(torch.randint(2, 9, ())), int(torch.randint(2, 12, ())), int(torch.randint(1, 4, ()))
    row = _measured(build_mixer("attention", 16, {"n_heads": 2}), T, batch)
    assert state_size_note(row) is None and row["state_elements"] == row["state_size"] == 2 * T * 16
    row = _measured(CumulativeMean(16, CumulativeMean.Options(d_inner=d_inner)), T, batch)
    assert state_size_note(row) is None and row["state_elements"] == row["state_size"] == d_inner + 1


def test_the_bench_table_notes_it_in_the_mixers_row(lying, tmp_path):
    parser = argparse.ArgumentParser()
    bench.configure_parser(parser)
    args = parser.parse_intermixed_args(["--mixers", f"attention,{lying}", "--seq-lens", "8", "model.d_model=16",
                                         "--repeats", "1", "--warmup", "0", "--threads", "1", "--no-progress",
                                         "--no-plot", "--out", str(tmp_path)])
    assert bench.run(args) == 0
    rows = {r["label"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    assert rows["attention"]["error"] is None
    assert "state_size(8) = 16 elements per sequence" in rows[lying]["error"]
    assert rows[lying]["fwd_ms"] > 0 and rows[lying]["decode_ms"] > 0   # the note loses no measurement
    line = [x for x in (tmp_path / "bench.md").read_text().splitlines() if x.startswith(f"| {lying} ")][0]
    assert "state_size(8) = 16 elements per sequence" in line


def test_the_bench_table_shows_a_parameter_count_of_zero(tmp_path):
    """A mixer without weights (0 parameters) shows 0 in the table, not a blank (which reads as not measured)."""
    count = int(torch.randint(1, 10_000, ()))
    rows = [{"label": "free", "T": 16, "fwd_ms": 1.0, "params": 0, "state_bytes": 64},
            {"label": "weighted", "T": 16, "fwd_ms": 2.0, "params": count, "state_bytes": 64},
            {"label": "unmeasured", "T": 16, "error": "forward: boom"}]
    result = {"machine": {"device_name": "cpu", "device": "cpu", "versions": {"torch": torch.__version__}},
              "config": {"threads": 1, "batch": 1, "d_model": 8, "dtype": "fp32", "repeats": 1, "warmup": 0}, "rows": rows}
    table = render_bench(result, tmp_path, plot=False)
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]]
             for line in table.splitlines() if line.startswith("| ") and not line.startswith("| mixer")}
    params = table.splitlines()[[i for i, line in enumerate(table.splitlines()) if line.startswith("| mixer")][0]]
    column = [c.strip() for c in params.split("|")[1:-1]].index("params")
    assert (cells["free"][column], cells["weighted"][column], cells["unmeasured"][column]) == ("0", str(count), "")
