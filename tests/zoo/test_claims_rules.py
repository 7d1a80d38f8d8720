"""Rules that can fail: per-seed conditions against a hand computation, and a claim about a change (length,
size) refused when its rule states no change or would hold on the rows of the base setting alone."""
import json

import pytest
import torch
import yaml

from zoo.experiments.claims import ledger
from zoo.experiments.claims.cells import CellStats
from zoo.experiments.claims.conditions import Condition, evaluate
from zoo.experiments.claims.errors import ClaimsError
from zoo.experiments.claims.schema import load
from zoo.experiments.claims.verdicts import evaluate_claims

from .test_claims import _synthetic_root, _values


def _cell(label, values):
    rows = [{"seed": s, "recipe": {"seed": s}, "metrics": {"test_accuracy": v}} for s, v in enumerate(values)]
    return CellStats("t", label, rows)


def test_a_per_seed_condition_holds_only_when_every_seed_holds():
    a = [0.5 + 0.4 * torch.rand(()).item() for _ in range(3)]
    b = [x - 0.2 + 0.1 * torch.rand(()).item() for x in a]   # every seed of b at least 0.1 below a's
    cells = {"a": _cell("a", a), "b": _cell("b", b)}
    cond = Condition.parse("per seed: b.test_accuracy <= a.test_accuracy - 0.1", "test")
    result = evaluate(cond, cells)
    assert result.holds, (a, b)
    assert result.detail.startswith(f"seed 0: {b[0]:.3f} <= {a[0] - 0.1:.3f}")
    b[1] = a[1]                                               # one seed does not fall ...
    cells["b"] = _cell("b", b)
    assert not evaluate(cond, cells).holds                    # ... and the condition fails,
    mean_cond = Condition.parse("b.test_accuracy <= a.test_accuracy - 0.05", "test")
    assert sum(b) / 3 <= sum(a) / 3 - 0.05 and evaluate(mean_cond, cells).holds  # where the means still pass
    assert evaluate(Condition.parse("per seed: a.test_accuracy >= 0.5", "test"), cells).holds


def _length_root(tmp_path, a_long, b_train, b_long, rule, change=None):
    """Table t with cells a (keeps at T = 64) and b (trained to ``b_train``, ``b_long`` at 64), per seed."""
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95, 0.01), "b": b_train}, rule=rule,
                           claim={"change": change or {"kind": "length"}})
    path = root / "tables" / "t" / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        r["metrics"]["test_accuracy@64"] = a_long[r["seed"]] if r["label"] == "a" else b_long[r["seed"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _judge(root):
    return evaluate_claims(load(root), root)[0]


def test_a_length_rule_that_holds_at_the_training_length_alone_is_refused(tmp_path):
    keeps = _values(3, 0.95, 0.01)
    b_train, b_long = _values(3, 0.5, 0.02), _values(3, 0.05, 0.02)
    # the margin rule of a length-transfer claim: it already holds at the training length (0.95 vs 0.5)
    margins = {"reproduced": ["a.test_accuracy@64 >= b.test_accuracy@64 + 0.3"]}
    with pytest.raises(ClaimsError, match="states no change"):
        _judge(_length_root(tmp_path / "1", keeps, b_train, b_long, margins))
    # a 'keeps' condition states the change but, with the margins, still holds at the training length
    keeps_rule = {"reproduced": ["per seed: a.test_accuracy@64 >= a.test_accuracy - 0.05",
                                 "a.test_accuracy@64 >= b.test_accuracy@64 + 0.3"]}
    with pytest.raises(ClaimsError, match="holds on the rows at the training length alone"):
        _judge(_length_root(tmp_path / "2", keeps, b_train, b_long, keeps_rule))
    # stating that b falls, seed by seed, makes the rule fail where b does not fall
    falls = {"reproduced": ["a.test_accuracy@64 >= b.test_accuracy@64 + 0.3",
                            "per seed: b.test_accuracy@64 <= b.test_accuracy - 0.2"]}
    assert _judge(_length_root(tmp_path / "3", keeps, b_train, b_long, falls)).verdict == "reproduced"
    b_flat = list(b_long)
    b_flat[2] = b_train[2] - 0.1                              # seed 2 of b falls by 0.1 only
    claim = _judge(_length_root(tmp_path / "4", keeps, b_train, b_flat, falls))
    assert claim.verdict == "not reproduced"
    ledger.write(claim_root := tmp_path / "4" / "repo")
    assert "A claim about a change of length" in (claim_root / "CLAIMS.md").read_text()


def test_a_size_rule_must_compare_a_cell_with_its_base(tmp_path):
    size = {"kind": "size", "base": {"a": "b"}}
    grows = {"reproduced": ["a.test_accuracy >= b.test_accuracy + 0.2"]}
    root = _synthetic_root(tmp_path / "1", {"a": _values(3, 0.95), "b": _values(3, 0.3)}, rule=grows,
                           claim={"change": size})
    assert _judge(root).verdict == "reproduced"
    level = {"reproduced": ["a.test_accuracy >= 0.9", "b.test_accuracy >= 0.2"]}  # no comparison of a with b
    root = _synthetic_root(tmp_path / "2", {"a": _values(3, 0.95), "b": _values(3, 0.3)}, rule=level,
                           claim={"change": size})
    with pytest.raises(ClaimsError, match="change of size, but rule.reproduced states no change"):
        _judge(root)


def test_the_change_is_part_of_the_rule_form(tmp_path):
    from zoo.experiments.preregistration import rule_form
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.3)})
    spec = yaml.safe_load((root / "claims.yaml").read_text())["claims"][0]
    assert rule_form(spec) != rule_form({**spec, "change": {"kind": "length"}})
    assert rule_form(spec) != rule_form({**spec, "unguarded": {"b": "why"}})


def test_a_condition_or_learned_term_given_as_a_string_is_refused_as_such(tmp_path):
    """A string where a list belongs was read character by character ("cannot read condition 'a'")."""
    cells = {"a": _values(3, 0.95), "b": _values(3, 0.1)}
    root = _synthetic_root(tmp_path / "1", cells, rule={"reproduced": "a.test_accuracy >= 0.9"})
    with pytest.raises(ClaimsError, match=r"rule.reproduced must be a list of conditions .*'a.test_accuracy >= 0.9'"):
        _judge(root)
    root = _synthetic_root(tmp_path / "2", cells, claim={"learned": "a.test_accuracy"})
    with pytest.raises(ClaimsError, match=r"learned must be a list of <cell>.<metric> terms, got 'a.test_accuracy'"):
        _judge(root)


def test_a_pending_claim_whose_cells_have_rows_is_refused(tmp_path):
    """pending holds a rule written before its table ran; once the table has rows of its cells, the rule judges
    them (pending silenced a rule with three seeds of rows)."""
    cells = {"a": _values(3, 0.95), "b": _values(3, 0.1)}
    root = _synthetic_root(tmp_path / "1", cells, claim={"pending": "later"})
    with pytest.raises(ClaimsError, match=r"pending \(later\), but tables/t holds rows of its cells \['a', 'b'\]"):
        _judge(root)
    waiting = {"pending": "later", "cells": {"a": "planned", "b": "planned"}, "show": ["a.test_accuracy"],
               "rule": {"reproduced": ["a.test_accuracy >= 0.9"]}}
    assert _judge(_synthetic_root(tmp_path / "2", cells, claim=waiting)).verdict == "not tested (later)"
