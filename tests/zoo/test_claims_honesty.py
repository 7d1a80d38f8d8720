"""The ledger's honesty checks: a rule committed after the rows it judges is reported post hoc (read from git),
and a claim whose cells never left their no-learning level is inconclusive, whatever its rule says."""
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from zoo.experiments import claims as ledger

from .test_claims import _synthetic_root, _values


def _git(root: Path, *args) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


def _commit(root: Path, message: str) -> str:
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return _git(root, "rev-parse", "--short", "HEAD")


def _stamp_rows(root: Path, commit: str) -> None:
    """Record in every row of table t that it was computed at ``commit``."""
    path = root / "tables" / "t" / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "versions": {"git": commit}}) + "\n" for r in rows))


def _claim(root: Path) -> ledger.Claim:
    return ledger.evaluate_claims(ledger.load(root), root)[0]


def _repo(tmp_path) -> Path:
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)})
    _git(root, "init", "-q")
    return root


def test_a_rule_committed_after_its_rows_is_post_hoc(tmp_path):
    root = _repo(tmp_path)
    rule = (root / "claims.yaml").read_text()
    (root / "claims.yaml").unlink()
    code = _commit(root, "code and recipe")                # the rows are computed here ...
    _stamp_rows(root, code)
    _commit(root, "rows")
    (root / "claims.yaml").write_text(rule)
    rule_commit = _commit(root, "the rule, written after the numbers")  # ... and the rule comes later
    claim = _claim(root)
    assert claim.registration.post_hoc and claim.verdict == "reproduced, post hoc"
    assert rule_commit in claim.registration.text and code in claim.registration.text
    ledger.write(root)
    assert "**reproduced, post hoc**" in (root / "CLAIMS.md").read_text()


def test_a_rule_committed_before_its_rows_is_pre_registered_until_it_is_edited(tmp_path):
    root = _repo(tmp_path)
    rows = (root / "tables" / "t" / "results.jsonl").read_text()
    (root / "tables" / "t" / "results.jsonl").unlink()
    rule_commit = _commit(root, "the rule, before any row")
    (root / "tables" / "t" / "results.jsonl").write_text(rows)
    _stamp_rows(root, rule_commit)                         # the rows run on the code of the rule's commit
    _commit(root, "rows")
    claim = _claim(root)
    assert not claim.registration.post_hoc and claim.verdict == "reproduced"
    assert claim.registration.text.startswith(f"pre-registered: rule committed in {rule_commit}")

    data = yaml.safe_load((root / "claims.yaml").read_text())
    data["claims"][0]["show"] = ["b.test_accuracy"]         # an edit that is not the rule keeps the registration
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    _commit(root, "show another number")
    assert not _claim(root).registration.post_hoc

    data["claims"][0]["rule"]["reproduced"][0] = "a.test_accuracy >= 0.8"  # a changed rule is new
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    assert _claim(root).registration.text == "post hoc: the rule's current form is not committed"
    _commit(root, "loosen the rule after seeing the rows")
    assert _claim(root).verdict == "reproduced, post hoc"


def test_a_row_without_a_recorded_commit_cannot_show_pre_registration(tmp_path):
    root = _repo(tmp_path)
    _commit(root, "rule and rows together, rows without a commit")
    assert "unrecorded" in _claim(root).registration.text and _claim(root).registration.post_hoc


def test_outside_git_nothing_is_claimed_about_registration(tmp_path):
    claim = _claim(_synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)}))
    assert not claim.registration.checked and claim.verdict == "reproduced"


def _with_levels(tmp_path, a, b, level, learned):
    root = _synthetic_root(tmp_path, {"a": a, "b": b}, claim={"learned": learned})
    data = yaml.safe_load((root / "claims.yaml").read_text())
    data["tables"]["t"]["no_learning"] = {"*": {"test_accuracy": level}}
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return root


@pytest.mark.parametrize("b_centre, expect", [(0.12, "inconclusive (nothing learned)"), (0.5, "partly")])
def test_a_baseline_at_its_no_learning_level_makes_the_claim_inconclusive(tmp_path, b_centre, expect):
    # a beats b by a wide margin, but a comparison with a b that learned nothing says nothing
    root = _with_levels(tmp_path, _values(3, 0.95), _values(3, b_centre, 0.01), 0.1, ["a.test_accuracy",
                                                                                     "b.test_accuracy"])
    claim = _claim(root)
    assert claim.verdict == expect
    assert bool(claim.unlearned) == (expect.startswith("inconclusive"))
    if claim.unlearned:
        assert claim.unlearned[0].startswith("b.test_accuracy = ")


def test_a_level_must_be_declared_for_every_learned_term(tmp_path):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)},
                           claim={"learned": ["a.test_accuracy"]})
    with pytest.raises(ledger.ClaimsError, match="declares no no_learning level"):
        _claim(root)


def test_exploration_conditions_are_shown_but_never_give_the_verdict(tmp_path):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.5), "b": _values(3, 0.1)},
                           rule={"reproduced": ["a.test_accuracy >= 0.9"], "exploration": ["a.test_accuracy >= 0.3"]})
    claim = _claim(root)
    assert claim.verdict == "not reproduced" and claim.outcomes["exploration"][0].holds
    ledger.write(root)
    assert "- exploration: `a.test_accuracy >= 0.3`" in (root / "CLAIMS.md").read_text()
