"""The claims ledger (zoo/experiments/claims/, claims.yaml -> CLAIMS.md) and seeds in ablation recipes.

The committed CLAIMS.md and tables/README.md must equal the regenerated text; rules are checked on synthetic
results with fresh random numbers against verdicts and means worked out here by hand; bad definitions fail
with a message naming the problem.
"""
import json
import statistics
from pathlib import Path

import pytest
import torch
import yaml

from zoo.cli import main
from zoo.errors import UserError
from zoo.experiments.ablate import completed_rows, run_ablation
from zoo.experiments.claims import ledger
from zoo.experiments.claims.cells import recipe_cells, table_cells
from zoo.experiments.claims.conditions import Condition, evaluate
from zoo.experiments.claims.costs import table_estimates
from zoo.experiments.claims.errors import ClaimsError
from zoo.experiments.claims.schema import load
from zoo.experiments.claims.verdicts import evaluate_claims
from zoo.experiments.results import cell_of, render
from zoo.recipes import resolve
from zoo.rows import read_rows

ROOT = Path(__file__).resolve().parents[2]
TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


def test_committed_ledger_equals_the_regenerated_one():
    assert ledger.check(ROOT) == [], "run `zoo claims` and commit CLAIMS.md and tables/README.md"


def test_check_names_a_hand_edit(tmp_path, capsys):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)})
    ledger.write(root)
    assert ledger.check(root) == []
    path = root / "CLAIMS.md"
    text = path.read_text()
    path.write_text(text.replace("**reproduced**", "**partly**", 1))
    problems = ledger.check(root)
    assert len(problems) == 1 and "CLAIMS.md differs" in problems[0] and "partly" in problems[0]
    assert main(["claims", "--check", "--root", str(root)]) == 1
    assert "CLAIMS.md differs" in capsys.readouterr().err
    assert main(["claims", "--root", str(root)]) == 0 and ledger.check(root) == []


# --------------------------------------------------------------------------------------- synthetic tables
def _values(n, centre, spread=0.02):
    """n accuracies drawn around ``centre`` (fresh each run), clipped to [0, 1]."""
    return [min(1.0, max(0.0, centre + spread * (2 * torch.rand(()).item() - 1))) for _ in range(n)]


def _row(label, seed, acc, extra=None):
    metrics = {"test_accuracy": acc, "test_accuracy@64": acc * 0.99, "steps": 10, "train_seconds": 2.0 * (1 + seed)}
    metrics.update(extra or {})
    untrained = {k: 0.0 if k.startswith("test_accuracy") else v for k, v in metrics.items()}  # at step 0
    return {"recipe_key": f"{label}-{seed}", "label": label, "seed": seed,
            "recipe": {"seed": seed, "model": {"layers": [label]}}, "metrics": metrics, "step0_metrics": untrained}


def _synthetic_root(tmp_path, cells, rule=None, claim=None):
    """A repository root with one table ``t`` whose cells have the given per-seed accuracies."""
    root = tmp_path / "repo"
    (root / "tables" / "t").mkdir(parents=True)
    (root / "recipes").mkdir()
    # each cell its own learning rate: two cells of one recipe would be refused
    grid = [{"label": label, "train.lr": 1e-3 * (i + 1)} for i, label in enumerate([*cells, "planned"])]
    recipe = yaml.safe_load(TINY.read_text()) | {"grid": grid, "seeds": [0, 1, 2]}
    (root / "recipes" / "t.yaml").write_text(yaml.safe_dump(recipe))
    with open(root / "tables" / "t" / "results.jsonl", "w") as fh:
        for label, accs in cells.items():
            for seed, acc in enumerate(accs):
                fh.write(json.dumps(_row(label, seed, acc)) + "\n")
    spec = {"id": "c", "paper": "p", "claim": "a beats b", "paper_result": "1.0 vs 0.1", "quote": "a: 1.0, b: 0.1",
            "section": "Table 1", "table": "t",
            "cells": {"a": "a", "b": "b"}, "show": ["a.test_accuracy"],
            "rule": rule or {"reproduced": ["a.test_accuracy >= 0.9", "b.test_accuracy <= 0.2"],
                             "partly": ["a.test_accuracy >= b.test_accuracy + 0.3"]}}
    spec.update(claim or {})
    data = {"papers": {"p": {"title": "A paper", "id": "arXiv 0000.00000"}},
            "tables": {"t": {"recipe": "recipes/t.yaml", "measured": "1 s", "no_learning": {"*": {"test_accuracy": 0.0}}}},
            "claims": [spec]}
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return root


def _verdict(root):
    data = load(root)
    return evaluate_claims(data, root)[0]


@pytest.mark.parametrize("a, b, n, expect", [
    (0.95, 0.10, 3, "reproduced"),
    (0.70, 0.30, 3, "partly"),       # a below 0.9, but 0.3 or more above b
    (0.50, 0.40, 3, "not reproduced"),
    (0.95, 0.10, 2, "not tested (2 seeds; needs 3)"),
    (0.95, 0.10, 1, "not tested (1 seed; needs 3)"),
])
def test_rule_gives_the_verdict(tmp_path, a, b, n, expect):
    root = _synthetic_root(tmp_path, {"a": _values(n, a), "b": _values(3, b)})
    assert _verdict(root).verdict == expect


def test_a_planned_cell_without_rows_is_not_tested(tmp_path):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)},
                           claim={"cells": {"a": "a", "b": "planned"}})
    assert _verdict(root).verdict == "not tested (0 seeds; needs 3)"


def test_mean_and_spread_over_seeds_match_a_hand_computation(tmp_path):
    accs = _values(4, 0.6, spread=0.3)
    root = _synthetic_root(tmp_path, {"a": accs, "b": _values(3, 0.1)})
    claim = _verdict(root)
    cell = claim.cells["a"]
    assert cell.seeds == [0, 1, 2, 3] and cell.n == 4
    assert cell.mean("test_accuracy") == pytest.approx(sum(accs) / 4, abs=1e-12)
    expected = f"{statistics.mean(accs):.3f} ± {statistics.stdev(accs):.3f} (4 seeds)"
    assert cell.summary("test_accuracy") == expected
    assert expected in ledger.build(root)["CLAIMS.md"]
    # @all: the training length and every test length, each compared with the threshold
    cond = Condition.parse("a.test_accuracy@all >= 0.0", "test")
    outcome = evaluate(cond, claim.cells)
    assert outcome.holds and outcome.detail.count(">=") == 2


def test_legacy_seed_labels_group_with_the_cell_and_nan_means_diverged(tmp_path):
    root = _synthetic_root(tmp_path, {"a": _values(1, 0.95), "b": _values(3, 0.1)},
                           rule={"reproduced": ["a.test_loss == nan"]})
    path = root / "tables" / "t" / "results.jsonl"
    rows = read_rows(path)
    rows[0]["metrics"]["test_loss"] = 1.0 + torch.rand(()).item()
    rows[0]["step0_metrics"]["test_loss"] = 3.0
    rows += [_row(f"a seed={seed}", seed, 0.9, {"test_loss": 2.0}) for seed in (1, 2)]  # "<cell> seed=N" replicates
    for r in rows:
        r["recipe"]["model"]["layers"] = [cell_of(r["label"])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    claim = _verdict(root)
    assert claim.cells["a"].seeds == [0, 1, 2]
    assert claim.verdict == "not reproduced"  # every loss finite
    rows[-1]["metrics"]["test_loss"] = float("nan")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _verdict(root).verdict == "reproduced"  # the mean over seeds is nan: a seed diverged
    assert cell_of("s3 seed=1 deltaproduct n_h=2 [-1,1]") == "s3 deltaproduct n_h=2 [-1,1]"
    assert cell_of("m=1 no norm") == "m=1 no norm"


@pytest.mark.parametrize("change, message", [
    ({"cells": {"a": "nope", "b": "b"}}, "no cell 'nope' in tables/t/results.jsonl"),
    ({"rule": {"reproduced": ["a.test_acuracy >= 0.9"]}}, "no metric 'test_acuracy'; did you mean 'test_accuracy'"),
    ({"rule": {"reproduced": ["c.test_accuracy >= 0.9"]}}, "names cell 'c', which is not in cells"),
    ({"rule": {"reproduced": ["a.test_accuracy => 0.9"]}}, "cannot read"),
    ({"rule": {"partly": ["a.test_accuracy >= 0.9"]}}, "rule.reproduced must list"),
    ({"table": "missing"}, "table 'missing' is not listed under tables"),
    ({"paper": "q"}, "unknown paper 'q'"),
    ({"unit_test": "tests/nothing.py::test_x"}, "names no test function"),
    ({"quote": None, "section": None}, "give the exact sentence or table cell"),
    ({"section": None}, "give quote (the paper's exact sentence or table cell) and section"),
    ({"unguarded": {"a": ""}}, "unguarded must map a cell to why"),
    ({"learned": ["a.test_accuracy"], "unguarded": {"a": "predicted"}}, "both in learned and in unguarded"),
    ({"soruce": "x"}, "unknown field 'soruce'; did you mean 'source'"),
    ({"rule": {"reproduced": ["per seed: a.test_accuracy@all >= 0.9"]}}, "per-seed condition reads one length"),
    ({"change": {"kind": "speed"}}, "change must be"),
    ({"change": {"kind": "size"}}, "change.base must map"),
])
def test_bad_definitions_raise_a_clear_error(tmp_path, change, message):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)}, claim=change)
    with pytest.raises(ClaimsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ledger.build(root)


def test_missing_table_and_mixed_rows_raise(tmp_path):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)})
    (root / "tables" / "t" / "results.jsonl").unlink()
    with pytest.raises(ClaimsError, match=r"tables/t/results.jsonl: no such file"):
        ledger.build(root)
    root = _synthetic_root(tmp_path / "2", {"a": _values(3, 0.95), "b": _values(3, 0.1)})
    path = root / "tables" / "t" / "results.jsonl"
    rows = read_rows(path)
    rows[1]["recipe"]["model"]["layers"] = ["other"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ClaimsError, match="differ in more than the seed"):
        ledger.build(root)
    rows[1] = dict(rows[0])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ClaimsError, match="more than one row for seed 0"):
        ledger.build(root)


# --------------------------------------------------------------------------------------- seeds in recipes
def _grid_recipe(tmp_path, extra):
    data = yaml.safe_load(TINY.read_text()) | extra
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_seeds_cross_every_labelled_cell_and_keep_the_label(tmp_path):
    seeds = sorted({int(s) for s in torch.randint(0, 1000, (3,))})
    grid = [{"label": "attn", "model.layers": ["attention"]}, {"label": "m2", "model.layers": ["mamba2"]}]
    recipe = resolve(_grid_recipe(tmp_path, {"grid": grid, "seeds": seeds}))
    assert [(c.label, c.recipe.seed) for c in recipe.cells] == [(lab, s) for lab in ("attn", "m2") for s in seeds]
    assert len({c.recipe.key for c in recipe.cells}) == len(recipe.cells)
    # a cell of the seeded recipe has the same key as the same cell written with its seed by hand (old tables)
    single = resolve(_grid_recipe(tmp_path, {"grid": [{"label": "attn", "model.layers": ["attention"],
                                                        "seed": seeds[0]}]}))
    assert single.cells[0].recipe.key == recipe.cells[0].recipe.key
    product = resolve(_grid_recipe(tmp_path, {"grid": {"train.lr": [1e-3, 2e-3]}, "seeds": seeds}))
    assert len(product.cells) == 2 * len(seeds)
    alone = resolve(_grid_recipe(tmp_path, {"seeds": seeds}))
    assert [(c.label, c.recipe.seed) for c in alone.cells] == [("base", s) for s in seeds]


@pytest.mark.parametrize("extra, message", [
    ({"grid": [{"label": "x", "seed": 4}], "seeds": [0, 1]}, "sets seed: 4, but the recipe runs every cell with seeds"),
    ({"grid": {"seed": [0, 1]}, "seeds": [0, 1]}, "sets seed"),
    ({"grid": [{"label": "x"}], "seeds": [0, 0, 1]}, "more than once"),
    ({"grid": [{"label": "x"}], "seeds": []}, "seeds is empty"),
    ({"grid": [{"label": "x"}], "seeds": [-1]}, "out of range"),
])
def test_bad_seeds_are_refused(tmp_path, extra, message):
    with pytest.raises(UserError, match=message):
        resolve(_grid_recipe(tmp_path, extra))


def test_completed_rows_tell_seeds_of_one_label_apart(tmp_path):
    recipe = resolve(_grid_recipe(tmp_path, {"grid": [{"label": "x"}], "seeds": [0, 1]}))
    row = {"recipe_key": recipe.cells[0].recipe.key, "label": "x", "seed": 0, "recipe": recipe.cells[0].recipe.plain}
    assert set(completed_rows([row], recipe.cells)) == {row["recipe_key"]}  # seed 1 is simply not done yet
    changed = resolve(_grid_recipe(tmp_path, {"grid": [{"label": "x", "train.lr": 0.01}], "seeds": [0, 1]}))
    with pytest.raises(UserError, match=r"cell 'x \(seed 0\)' already has a finished row"):
        completed_rows([row], changed.cells)


def test_three_seed_ablation_renders_mean_and_spread(tmp_path):
    recipe = resolve(_grid_recipe(tmp_path, {"grid": [{"label": "m2", "model.layers": ["mamba2"]}],
                                             "seeds": [0, 1, 2]}), ["train.steps=2"])
    out = tmp_path / "out"
    rows = run_ablation(recipe, out, progress=False, plot=False, echo=lambda *a: None)
    assert [r["seed"] for r in rows] == [0, 1, 2] and {r["label"] for r in rows} == {"m2"}
    accs = [r["metrics"]["test_accuracy"] for r in rows]
    md = (out / "results.md").read_text()
    assert f"{statistics.mean(accs):.4f} ± {statistics.stdev(accs):.4f}" in md and "3 (0, 1, 2)" in md
    assert len((out / "results.csv").read_text().splitlines()) == 1 + 3  # per-seed rows kept
    again = run_ablation(recipe, out, progress=False, plot=False, echo=lambda *a: None)
    assert [r["recipe_key"] for r in again] == [r["recipe_key"] for r in rows]
    assert len(read_rows(out / "results.jsonl")) == 3


def test_render_without_repeated_cells_has_no_summary(tmp_path):
    rows = [dict(_row(lab, 0, 0.5), recipe={"seed": 0, "model": {"layers": [lab]}, "task": {"seq_len": 32}})
            for lab in ("a", "b")]
    render(rows, tmp_path, plot=False)
    assert "Mean ± sample standard deviation" not in (tmp_path / "results.md").read_text()


def test_a_ray_table_gets_the_ray_command_and_a_per_worker_estimate(tmp_path):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)})
    serial = [line for line in ledger.build(root)["tables/README.md"].splitlines() if line.startswith("| `tables/t`")]
    data = yaml.safe_load((root / "claims.yaml").read_text())
    data["tables"]["t"]["ray_workers"] = 2
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    ray = [line for line in ledger.build(root)["tables/README.md"].splitlines() if line.startswith("| `tables/t`")]
    minutes = lambda row, column: float(row[0].split(" | ")[column].split(" min")[0])  # noqa: E731
    assert "--no-progress --executor ray`" in ray[0] and "--executor" not in serial[0]
    # the recipe's cells a, b (3 seeds each) are measured; "planned" is not: the estimate is half the serial one
    assert minutes(ray, 5) == pytest.approx(minutes(serial, 5) / 2, abs=0.051) and minutes(serial, 5) > 0
    assert "on 2 Ray workers" in ray[0]
    data["tables"]["t"]["ray_workers"] = 0
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ClaimsError, match=r"tables.t.ray_workers: expected a whole number of workers >= 1"):
        ledger.build(root)


def test_the_estimate_uses_a_committed_run_s_own_time_and_the_step_rate_otherwise(tmp_path):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)})
    recipe = yaml.safe_load((root / "recipes" / "t.yaml").read_text())
    for i, cell in enumerate(recipe["grid"]):  # three different recipes, so that each row can match one cell only
        cell["train.lr"] = 1e-3 * (i + 1)
    (root / "recipes" / "t.yaml").write_text(yaml.safe_dump(recipe))
    keys = {(c.label, c.recipe.seed): c.recipe.key for c in recipe_cells(root, "recipes/t.yaml")}
    path = root / "tables" / "t" / "results.jsonl"
    rows = read_rows(path)
    for row in rows:  # cell a's rows are runs of the recipe as written; b's come from an older recipe
        if row["label"] == "a":
            row["recipe_key"] = keys[("a", row["seed"])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    est = table_estimates(root, "recipes/t.yaml", table_cells(root, "t"))
    steps = resolve(TINY).train.steps
    rate = sum(2.0 * (1 + s) / 10 for s in range(3)) / 3  # b's mean seconds per step (10 steps per row)
    assert est["total"] == pytest.approx((2.0 + 4.0 + 6.0) + 3 * rate * steps)
    assert est["missing"] == pytest.approx(3 * rate * steps) and est["n_missing"] == 3 + 3  # b's and planned's
    assert est["unmeasured"] == 3 and est["stale"] == 3
