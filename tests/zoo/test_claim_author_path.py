"""A claim author's path through the ledger, as README.md describes it: the table's entry and the claim's rule
committed first (the ledger regenerated and committed with them), then the rows; and the mistakes an author
makes on the way (a rule that reads no cell, a threshold written in percent, a metric no row has), each
stopped by ``zoo claims`` in one line that names the claim, the field and the fix."""
import random
import statistics

import pytest
import yaml

from zoo.experiments.claims import ledger
from zoo.experiments.claims.errors import ClaimsError
from zoo.experiments.claims.schema import load
from zoo.experiments.claims.verdicts import evaluate_claims

from .cli_errors import one_line_error
from .test_claims import _synthetic_root, _values
from .test_claims_honesty import _commit, _git, _stamp_rows


def _edit(root, change) -> None:
    """Rewrite claims.yaml with ``change(data)`` applied."""
    data = yaml.safe_load((root / "claims.yaml").read_text())
    change(data)
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


def _error(root, capsys) -> str:
    """The one-line error of ``zoo claims`` on ``root`` (also raised by the ledger as a ClaimsError)."""
    with pytest.raises(ClaimsError):
        ledger.build(root)
    return one_line_error(capsys, "claims", "--check", "--root", root)


# ------------------------------------------------------------------------------- the documented flow
def test_the_ledger_committed_with_its_rule_and_then_with_its_rows_passes_check(tmp_path):
    """README: write the claim, run ``zoo claims`` and commit; run the table, remove ``awaiting_rows``, run
    ``zoo claims`` and commit. Each commit's ledger equals the one regenerated there (it said 'post hoc: the
    rule's current form is not committed' in the commit that committed the rule)."""
    a, b = _values(3, 0.95), _values(3, 0.1)
    root = _synthetic_root(tmp_path, {"a": a, "b": b})
    path = root / "tables" / "t" / "results.jsonl"
    rows = path.read_text()
    path.unlink()
    _edit(root, lambda d: d["tables"]["t"].update(awaiting_rows="runs next"))
    _git(root, "init", "-q")
    ledger.write(root)
    rule_commit = _commit(root, "the rule and its ledger, before any row")
    assert ledger.check(root) == []
    assert "**not tested (no rows yet: runs next)**" in (root / "CLAIMS.md").read_text()

    path.write_text(rows)
    _stamp_rows(root, rule_commit)  # the rows run on the code of the rule's commit
    _edit(root, lambda d: d["tables"]["t"].pop("awaiting_rows"))
    ledger.write(root)
    _commit(root, "the rows and the ledger")
    assert ledger.check(root) == []
    # the rule by hand: a >= 0.9 and b <= 0.2 on the means over seeds
    expected = "reproduced" if sum(a) / 3 >= 0.9 and sum(b) / 3 <= 0.2 else "not reproduced"
    claim = evaluate_claims(load(root), root)[0]
    assert claim.verdict == expected and not claim.registration.post_hoc
    assert f"rule committed in {rule_commit}" in claim.registration.text


# ------------------------------------------------------------------------------- mistakes of a claim author
def test_a_rule_condition_that_reads_no_cell_is_refused_in_one_line(tmp_path, capsys):
    """``0.5 > 0.3`` is a constant: it ended in a ValueError traceback (min() of no cells)."""
    x, y = sorted(random.sample(range(1, 100), 2))
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)},
                           rule={"reproduced": [f"{y / 100} > {x / 100}"]})
    err = _error(root, capsys)
    assert "claims.0 (c)" in err and "rule.reproduced.0" in err and "<cell>.<metric>" in err


@pytest.mark.parametrize("field", ["threshold", "offset", "no_learning"])
def test_an_accuracy_threshold_in_percent_is_refused_not_judged(tmp_path, capsys, field):
    """Accuracies are fractions: ``a.test_accuracy >= 90`` could never hold and gave 'not reproduced', and a
    no-learning level of 25 made every seed 'not learned' (an inconclusive verdict), both without a word."""
    percent = random.randint(2, 100)
    rule = {"threshold": {"reproduced": [f"a.test_accuracy >= {percent}"]},
            "offset": {"reproduced": [f"a.test_accuracy >= b.test_accuracy + {percent}"]}}.get(field)
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)}, rule=rule)
    if field == "no_learning":
        _edit(root, lambda d: d["tables"]["t"].update(no_learning={"*": {"test_accuracy": percent}}))
    err = _error(root, capsys)
    assert "fraction" in err and f"{percent / 100:g}" in err
    assert ("tables.t.no_learning" in err) if field == "no_learning" else ("claims.0 (c): rule.reproduced.0" in err)


def test_thresholds_within_a_metrics_scale_are_judged(tmp_path):
    """The scale check refuses only what cannot be a fraction: 0 and 1 themselves, and numbers above 1 on a
    metric that is not an accuracy (steps), are judged as written."""
    steps = random.randint(2, 9)  # every row of the synthetic table ran 10 steps
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)},
                           rule={"reproduced": ["a.test_accuracy <= 1", "b.test_accuracy >= 0",
                                                f"a.steps > {steps}", "per seed: a.test_accuracy > b.test_accuracy"]})
    assert evaluate_claims(load(root), root)[0].verdict == "reproduced"


@pytest.mark.parametrize("field", ["rule", "show", "no_learning"])
def test_a_metric_no_row_has_names_the_claim_and_the_field(tmp_path, capsys, field):
    """A misspelt metric was reported as 'tables/t: cell 'a' (seed 0) has no metric ...', without the claim or
    the place in claims.yaml to correct."""
    typo = random.choice(["test_acc", "test_acuracy", "tset_accuracy"])
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)})
    where = {"rule": "rule.partly.0", "show": "show.0", "no_learning": "tables.t.no_learning"}[field]
    if field == "rule":
        _edit(root, lambda d: d["claims"][0]["rule"]["partly"].__setitem__(0, f"a.{typo} >= 0.5"))
    elif field == "show":
        _edit(root, lambda d: d["claims"][0].update(show=[f"b.{typo}"]))
    else:
        _edit(root, lambda d: d["tables"]["t"].update(no_learning={"*": {typo: 0.05}}))
    err = _error(root, capsys)
    assert "claims.0 (c)" in err and where in err and repr(typo) in err and "did you mean 'test_accuracy'" in err


def test_a_per_seed_condition_on_cells_with_other_seeds_names_the_claim(tmp_path, capsys):
    """The seeds of the two sides differ (one cell ran a fourth seed): the error named the condition but not
    the claim it belongs to."""
    extra = random.randint(4, 6)
    root = _synthetic_root(tmp_path, {"a": _values(extra, 0.95), "b": _values(3, 0.1)},
                           rule={"reproduced": ["per seed: a.test_accuracy > b.test_accuracy"]})
    err = _error(root, capsys)
    assert "claims.0 (c)" in err and "per seed" in err and ", ".join(map(str, range(extra))) in err


def test_show_at_all_shows_every_length_and_an_offset_is_refused(tmp_path, capsys):
    """``show: [a.test_accuracy@all]`` passed the checks and then ended in 'cell a has no metric
    test_accuracy@all' while rendering; ``a.test_accuracy + 0.1`` was shown without its offset."""
    a = _values(3, 0.8, spread=0.1)
    root = _synthetic_root(tmp_path, {"a": a, "b": _values(3, 0.1)}, claim={"show": ["a.test_accuracy@all"]})
    text = ledger.build(root)["CLAIMS.md"]
    for metric, values in (("test_accuracy", a), ("test_accuracy@64", [x * 0.99 for x in a])):
        mean, std = statistics.mean(values), statistics.stdev(values)
        assert f"a {metric}: {mean:.3f} ± {std:.3f} (3 seeds)" in text
    _edit(root, lambda d: d["claims"][0].update(show=["a.test_accuracy + 0.1"]))
    err = _error(root, capsys)
    assert "claims.0 (c)" in err and "show.0" in err and "offset" in err
