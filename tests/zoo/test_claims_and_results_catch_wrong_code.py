"""The ledger's reading of a table against numbers worked out by hand: a per-seed condition pairs each seed of
one cell with the same seed of the other whatever order the rows were written in, a missing value is a diverged
seed, an ``@all`` term against a number is read at every length, a seed summary is the mean and sample deviation,
rows at an unknown commit are stale, a Ray table's estimates are per worker, and claims.yaml refuses an id used
twice and reads a cell label with its seed word as the cell."""
from __future__ import annotations

import json
import math
import random
import statistics

import pytest
import yaml

from zoo.experiments.claims.cells import CellStats, num
from zoo.experiments.claims.conditions import Condition, evaluate
from zoo.experiments.claims.costs import TABLE_BUDGET_S, render_tables
from zoo.experiments.claims.errors import ClaimsError
from zoo.experiments.claims.schema import Claim, bind_cells, check_spec, load
from zoo.experiments.freshness import Staleness
from zoo.recipes import resolve

from .test_claims import TINY, _synthetic_root
from .test_ledger_arithmetic import _cell


def _unsorted(seeds: list[int]) -> list[int]:
    """``seeds`` in a random order that is not ascending."""
    order = random.sample(seeds, len(seeds))
    return order if order != sorted(order) else order[::-1]


# ------------------------------------------------------------------------------------- per-seed pairing
def test_a_per_seed_condition_pairs_the_same_seed_of_both_cells_whatever_the_row_order():
    """Each seed of a is compared with the same seed of b (rows are written in the order cells finish), and a cell
    without rows gives no seed on which a condition holds."""
    seeds = sorted(random.sample(range(20), 3))
    b = dict(zip(random.sample(seeds, 3), (0.1, 0.4, 0.7)))      # far apart: any wrong pairing fails
    a = {s: round(b[s] + random.uniform(0.06, 0.09), 6) for s in seeds}  # each seed of a beats b's by 0.05
    cells = {"a": _cell("a", {s: {"test_accuracy": a[s]} for s in seeds}, _unsorted(seeds)),
             "b": _cell("b", {s: {"test_accuracy": b[s]} for s in seeds}, _unsorted(seeds))}
    outcome = evaluate(Condition.parse("per seed: a.test_accuracy >= b.test_accuracy + 0.05", "test"), cells)
    assert outcome.holds
    assert outcome.detail == ", ".join(f"seed {s}: {num(a[s])} >= {num(b[s] + 0.05)}" for s in seeds)
    assert cells["a"].seeds == seeds and cells["a"].values("test_accuracy") == [a[s] for s in seeds]
    # a cell without rows has no seed on which the condition holds
    empty = {"a": CellStats("t", "a", [])}
    assert not evaluate(Condition.parse("per seed: a.test_accuracy >= 0.05", "test"), empty).holds
    # one seed of a falls to b's level: the condition fails on that seed alone
    low = random.choice(seeds)
    cells["a"] = _cell("a", {s: {"test_accuracy": b[s] if s == low else a[s]} for s in seeds}, _unsorted(seeds))
    assert not evaluate(Condition.parse("per seed: a.test_accuracy >= b.test_accuracy + 0.05", "test"), cells).holds


def test_a_missing_value_reads_as_a_diverged_seed():
    """A row whose metric is null (not finite when written) is a diverged seed: nan, never 0."""
    values = [random.uniform(0.2, 0.9) for _ in range(3)]
    gone = random.randrange(3)
    cell = _cell("a", {s: {"test_accuracy": None if s == gone else v} for s, v in enumerate(values)})
    read = cell.values("test_accuracy")
    assert math.isnan(read[gone]) and [v for i, v in enumerate(read) if i != gone] == [
        v for i, v in enumerate(values) if i != gone]
    assert math.isnan(cell.mean("test_accuracy"))
    assert cell.summary("test_accuracy") == "nan ± nan (3 seeds)"
    cells = {"a": cell}
    assert evaluate(Condition.parse("a.test_accuracy == nan", "test"), cells).holds
    assert not evaluate(Condition.parse("a.test_accuracy <= 0", "test"), cells).holds


def test_the_seed_summary_is_the_mean_and_sample_deviation():
    """``mean ± std (n seeds)`` with the sample standard deviation for two seeds or more; one seed: its value."""
    for n in (2, random.randint(3, 6)):
        values = [random.uniform(0, 1) for _ in range(n)]
        cell = _cell("a", {s: {"test_accuracy": v} for s, v in enumerate(values)}, _unsorted(list(range(n))))
        want = f"{num(statistics.fmean(values))} ± {num(statistics.stdev(values))} ({n} seeds)"
        assert cell.summary("test_accuracy") == want
    one = _cell("b", {7: {"test_accuracy": values[0]}})
    assert one.summary("test_accuracy") == f"{num(values[0])} (1 seed)"


# ------------------------------------------------------------------------------------- @all against a number
def test_an_all_lengths_term_against_a_number_holds_only_where_every_length_does():
    """``a.test_accuracy@all >= t`` is read at the training length and every test length, on either side."""
    lengths = sorted(random.sample([32, 64, 128, 256, 512, 1024], 3))
    per_seed = {s: {"test_accuracy": random.uniform(0.8, 1.0),
                    **{f"test_accuracy@{n}": random.uniform(0.6, 0.8) for n in lengths}} for s in range(3)}
    falls = random.choice(lengths)
    for s in per_seed:
        per_seed[s][f"test_accuracy@{falls}"] = random.uniform(0.1, 0.3)
    cells = {"a": _cell("a", per_seed, _unsorted(list(per_seed)))}
    keys = ["test_accuracy", *(f"test_accuracy@{n}" for n in lengths)]
    means = [statistics.fmean(per_seed[s][k] for s in per_seed) for k in keys]
    for text, holds in (("a.test_accuracy@all >= 0.5", False), ("0.5 <= a.test_accuracy@all", False),
                        ("a.test_accuracy@all >= 0.05", True), ("a.test_accuracy@all < 0.5", False)):
        outcome = evaluate(Condition.parse(text, "test"), cells)
        assert outcome.holds == holds, text
        assert len(outcome.detail.split(", ")) == len(keys), text
    shown = evaluate(Condition.parse("a.test_accuracy@all >= 0.5", "test"), cells).detail
    assert shown == ", ".join(f"{num(m)} >= 0.500" for m in means)


# ------------------------------------------------------------------------------------- stale by code
def test_rows_at_a_commit_this_history_lacks_are_stale():
    """A row whose commit is unknown here cannot be shown fresh: its cell is stale, and the text names the commit."""
    commit = "".join(random.choice("0123456789abcdef") for _ in range(7))
    found = Staleness("a", {}, [commit])
    assert found.stale and found.text() == f"a: rows at commits unknown here: {commit}"
    assert not Staleness("a", {}, []).stale
    changed = Staleness("a", {commit: ["mixers/m.py"]}, [])
    assert changed.stale and changed.text() == f"a: {commit} (mixers/m.py)"


# ------------------------------------------------------------------------------------- table costs
def test_a_table_run_on_ray_workers_divides_both_estimates_by_their_number(tmp_path):
    """No committed row of cells a and b has the recipe's key, so every run of theirs is still to compute, at its
    cell's mean seconds per step over the committed rows times the recipe's step budget."""
    workers = random.randint(2, 8)
    root = _synthetic_root(tmp_path, {"a": [0.9] * 3, "b": [0.1] * 3})
    data = yaml.safe_load((root / "claims.yaml").read_text())
    data["tables"]["t"]["ray_workers"] = workers
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    path = root / "tables" / "t" / "results.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for row in rows:  # long runs: minutes large enough that a wrong estimate shows after rounding
        row["metrics"]["train_seconds"] = random.uniform(600, 6000)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = resolve(TINY).train.steps
    per_run = {c: statistics.fmean(r["metrics"]["train_seconds"] / r["metrics"]["steps"] for r in rows
                                   if r["label"] == c) * steps for c in ("a", "b")}
    minutes = 3 * (per_run["a"] + per_run["b"]) / workers / 60  # the planned cell has no rows: unmeasured
    line = next(x for x in render_tables(load(root), root).splitlines() if x.startswith("| `tables/t`"))
    flag = " **over budget**" if minutes * 60 > TABLE_BUDGET_S else ""
    assert f"| {minutes:.1f} min on {workers} Ray workers + 3 unmeasured{flag} |" in line
    assert f"| 9, {minutes:.1f} min (" in line


# ------------------------------------------------------------------------------------- claims.yaml
def _spec(claim_id: str, cells: dict | None = None) -> dict:
    return {"id": claim_id, "paper": "p", "claim": "a beats b", "paper_result": "1.0", "source": "Table 1",
            "cells": cells or {}}


def test_an_id_used_twice_is_refused_and_a_seed_word_in_a_cell_label_names_the_cell():
    """Two claims with one id would share a line of the ledger; a label written with its ``seed=N`` word names the
    cell whose rows differ by seed."""
    claim_id, ids = f"c{random.randrange(1000)}", set()
    check_spec(_spec(claim_id), "claims.0", {"p": {"title": "A paper", "id": "arXiv 0000.00000"}}, ids)
    with pytest.raises(ClaimsError, match=f"the id '{claim_id}' is used twice"):
        check_spec(_spec(claim_id), "claims.1", {"p": {"title": "A paper", "id": "arXiv 0000.00000"}}, ids)
    seed = random.randrange(10)
    present = {"mamba d=16": _cell("mamba d=16", {seed: {"test_accuracy": random.random()}})}
    claim = Claim(_spec("x", {"m": f"mamba seed={seed} d=16"}))
    bind_cells(claim, "claims.0", "t", "recipes/t.yaml", present, set())
    assert claim.cells["m"] is present["mamba d=16"] and claim.labels["m"] == "mamba d=16"
