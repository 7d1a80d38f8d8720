"""The ledger on language-model tables: a cost (bits per byte) passes the learned guard by falling below its
no-learning level (the unigram level), and a table whose rows have not come yet renders its claims, rules
already checked, as not tested (no rows yet)."""
import json
import math

import pytest
import torch
import yaml

from zoo.experiments.claims import ledger
from zoo.experiments.claims.errors import ClaimsError
from zoo.experiments.claims.guard import LEARNING_MARGIN, is_cost
from zoo.experiments.claims.schema import load
from zoo.experiments.claims.verdicts import evaluate_claims

from .test_claims import _row, _synthetic_root, _values

UNIGRAM = 4.6  # a validation text's unigram bits per byte (the level of a model that learned nothing)
UNTRAINED = math.log2(257)  # a byte model at step 0: uniform over 256 bytes and EOS


def _claim(root):
    return evaluate_claims(load(root), root)[0]


def _bpb_root(tmp_path, bpb: dict[str, list[float]]):
    """Table t whose cells have the given per-seed ``val_bpb``, a val_bpb no-learning level and a rule that
    a is at least 0.2 bits per byte below b."""
    root = _synthetic_root(tmp_path, {label: _values(len(v), 0.5) for label, v in bpb.items()},
                           rule={"reproduced": ["a.val_bpb <= b.val_bpb - 0.2"]}, claim={"show": ["a.val_bpb"]})
    rows = []
    for label, values in bpb.items():
        for seed, value in enumerate(values):
            row = _row(label, seed, 0.5, {"val_bpb": value})
            row["step0_metrics"]["val_bpb"] = UNTRAINED
            rows.append(row)
    (root / "tables" / "t" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = yaml.safe_load((root / "claims.yaml").read_text())
    data["tables"]["t"]["no_learning"] = {"*": {"val_bpb": UNIGRAM}}
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return root


def _near(centre, n=3, spread=0.05):
    return [centre + spread * (2 * torch.rand(()).item() - 1) for _ in range(n)]


def test_costs_are_the_metrics_that_learn_downwards():
    assert is_cost("val_bpb") and is_cost("val_bpb@8192") and is_cost("test_loss") and is_cost("val_ppl")
    assert is_cost("val_loss@pos0-511")
    assert not is_cost("test_accuracy") and not is_cost("test_accuracy@4096")
    assert not is_cost("test_sequence_accuracy") and not is_cost("test_accuracy@task=niah")


def test_bits_per_byte_well_below_the_unigram_level_have_learned(tmp_path):
    # far below the level, as a model that learned does: an accuracy-style guard would call every seed unlearned
    a, b = _near(2.0), _near(2.5)
    claim = _claim(_bpb_root(tmp_path, {"a": a, "b": b}))
    assert claim.unlearned == [] and claim.verdict == "reproduced"
    mean_a, mean_b = sum(a) / 3, sum(b) / 3
    assert f"{mean_a:.3f}" in claim.outcomes["reproduced"][0].detail
    assert f"{mean_b - 0.2:.3f}" in claim.outcomes["reproduced"][0].detail


@pytest.mark.parametrize("offset, learned", [(-LEARNING_MARGIN - 0.02, True), (-LEARNING_MARGIN + 0.02, False),
                                             (+0.3, False)])
def test_a_seed_at_the_unigram_level_makes_the_comparison_inconclusive(tmp_path, offset, learned):
    b = _near(2.5)
    b[1] = UNIGRAM + offset + 0.01 * (2 * torch.rand(()).item() - 1)  # seed 1 of b near (or at) the level
    root = _bpb_root(tmp_path, {"a": _near(1.5), "b": b})
    claim = _claim(root)
    if learned:
        assert claim.unlearned == [] and claim.verdict == "reproduced"
        return
    assert [(u.alias, u.seed, u.metric) for u in claim.unlearned] == [("b", 1, "val_bpb")]
    assert claim.verdict == "inconclusive (a judged seed did not learn)"
    assert claim.unlearned[0].text() == f"b seed 1: val_bpb = {b[1]:.3f} >= {UNIGRAM:.3f} - {LEARNING_MARGIN}"
    ledger.write(root)
    assert f"val_bpb = {b[1]:.3f} >= {UNIGRAM:.3f} - {LEARNING_MARGIN}" in (root / "CLAIMS.md").read_text()


def test_a_diverged_seed_has_not_learned(tmp_path):
    b = _near(2.5)
    b[0] = float("nan")
    claim = _claim(_bpb_root(tmp_path, {"a": _near(1.5), "b": b}))
    assert [(u.alias, u.seed) for u in claim.unlearned] == [("b", 0)]


# ------------------------------------------------------------------------------ a table not run yet
def _awaiting(tmp_path, why="needs one GPU", claim=None):
    """Table t without results.jsonl, its claims.yaml entry saying why."""
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)}, claim=claim)
    (root / "tables" / "t" / "results.jsonl").unlink()
    data = yaml.safe_load((root / "claims.yaml").read_text())
    data["tables"]["t"]["awaiting_rows"] = why
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return root


def test_a_claim_on_a_table_awaiting_its_rows_is_not_tested_and_says_why(tmp_path):
    root = _awaiting(tmp_path)
    claim = _claim(root)
    assert claim.verdict == "not tested (no rows yet: needs one GPU)"
    assert all(cell.n == 0 for cell in claim.cells.values()) and not claim.unlearned
    files = ledger.build(root)
    assert "**not tested (no rows yet: needs one GPU)**" in files["CLAIMS.md"]
    assert "- reproduced: `a.test_accuracy >= 0.9`: not evaluated (no rows)" in files["CLAIMS.md"]
    assert "- Step 0: not evaluated (no rows yet)" in files["CLAIMS.md"]
    line = next(x for x in files["tables/README.md"].splitlines() if x.startswith("| `tables/t`"))
    assert "| no rows yet: needs one GPU |" in line


@pytest.mark.parametrize("claim, message", [
    ({"cells": {"a": "a", "b": "nope"}}, "no cell 'nope' in tables/t/results.jsonl or in recipes/t.yaml"),
    ({"learned": ["a.val_bpb"]}, "declares no no_learning level of val_bpb"),
    ({"rule": {"reproduced": ["c.test_accuracy >= 0.9"]}}, "names cell 'c', which is not in cells"),
])
def test_a_claim_awaiting_rows_is_still_checked(tmp_path, claim, message):
    # the rule is committed before the rows: its cells, metrics' levels and names are checked now
    with pytest.raises(ClaimsError, match=message):
        ledger.build(_awaiting(tmp_path, claim=claim))


def test_awaiting_rows_must_say_why_and_must_go_once_rows_come(tmp_path):
    with pytest.raises(ClaimsError, match="awaiting_rows: say in words why"):
        ledger.build(_awaiting(tmp_path, why=" "))
    root = _synthetic_root(tmp_path / "rows", {"a": _values(3, 0.95), "b": _values(3, 0.1)})
    data = yaml.safe_load((root / "claims.yaml").read_text())
    data["tables"]["t"]["awaiting_rows"] = "needs one GPU"
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ClaimsError, match="tables/t has rows now; remove awaiting_rows"):
        ledger.build(root)
