"""The ledger's honesty checks: a rule committed after the rows it judges is reported post hoc (read from git),
and a claim whose cells never left their no-learning level is inconclusive, whatever its rule says."""
import json
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from zoo.experiments.claims import ledger
from zoo.experiments.claims.errors import ClaimsError
from zoo.experiments.claims.schema import Claim, load
from zoo.experiments.claims.verdicts import evaluate_claims

from .test_claims import TINY, _synthetic_root, _values


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


def _claim(root: Path) -> Claim:
    return evaluate_claims(load(root), root)[0]


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


def test_re_running_the_cells_after_the_rule_keeps_the_verdict_post_hoc(tmp_path):
    root = _repo(tmp_path)
    path = root / "tables" / "t" / "results.jsonl"
    rule, rows = (root / "claims.yaml").read_text(), path.read_text()
    (root / "claims.yaml").unlink()
    code = _commit(root, "code and recipe")
    _stamp_rows(root, code)
    first_rows = _commit(root, "one run of the cells, before any rule")
    (root / "claims.yaml").write_text(rule)
    rule_commit = _commit(root, "the rule, written knowing those rows")
    path.write_text(rows)                                   # every cell re-run after the rule ...
    _stamp_rows(root, rule_commit)
    _commit(root, "the cells re-run on the rule's code")
    claim = _claim(root)                                    # ... the rows present now all follow the rule,
    assert claim.registration.post_hoc and claim.verdict == "reproduced, post hoc"  # but the history does not
    assert first_rows in claim.registration.text and rule_commit in claim.registration.text
    assert "'a'" in claim.registration.text and "'b'" in claim.registration.text


def test_a_disclosed_calibration_makes_a_pre_registered_verdict_post_hoc(tmp_path):
    root = _repo(tmp_path)
    rows = (root / "tables" / "t" / "results.jsonl").read_text()
    (root / "tables" / "t" / "results.jsonl").unlink()
    data = yaml.safe_load((root / "claims.yaml").read_text())
    data["claims"][0]["calibration"] = "one seed of b, run to choose the budget"
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    rule_commit = _commit(root, "the rule, after a calibration run outside the table")
    (root / "tables" / "t" / "results.jsonl").write_text(rows)
    _stamp_rows(root, rule_commit)
    _commit(root, "rows")
    claim = _claim(root)
    assert claim.verdict == "reproduced, post hoc"
    assert claim.registration.text.endswith("but runs before the rule informed it: one seed of b, run to choose "
                                            "the budget")


@pytest.mark.parametrize("early_cell, post_hoc", [("b", False), ("a", True)])
def test_only_the_cells_a_verdict_reads_decide_its_registration(tmp_path, early_cell, post_hoc):
    # the verdict reads a; b is exploration: b's rows predating the rule do not make the verdict post hoc
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)},
                           rule={"reproduced": ["a.test_accuracy >= 0.9"], "exploration": ["b.test_accuracy <= 0.2"]})
    _git(root, "init", "-q")
    path = root / "tables" / "t" / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rule = (root / "claims.yaml").read_text()
    (root / "claims.yaml").unlink()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["label"] == early_cell))
    early = _commit(root, "the early cell's code")
    (root / "claims.yaml").write_text(rule)
    late = _commit(root, "the rule")
    stamped = [{**r, "versions": {"git": early if r["label"] == early_cell else late}} for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in stamped))
    _commit(root, "rows")
    claim = _claim(root)
    assert claim.registration.post_hoc == post_hoc
    assert claim.verdict == ("reproduced, post hoc" if post_hoc else "reproduced")


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


@pytest.mark.parametrize("b_seeds, expect", [
    ((0.06, 0.5, 0.5), "inconclusive (a judged seed did not learn)"),  # mean 0.35, but seed 0 learned nothing
    ((0.2, 0.5, 0.5), "partly"),
])
def test_a_comparison_with_a_seed_at_its_no_learning_level_is_inconclusive(tmp_path, b_seeds, expect):
    # a beats b by a wide margin, but a comparison with a seed of b that learned nothing says nothing
    b = [v + 0.01 * torch.rand(()).item() for v in b_seeds]
    root = _with_levels(tmp_path, _values(3, 0.95), b, 0.1, [])
    claim = _claim(root)
    assert claim.verdict == expect
    assert [(u.alias, u.seed) for u in claim.unlearned] == ([("b", 0)] if expect.startswith("inconclusive") else [])
    if claim.unlearned:
        assert claim.unlearned[0].text().startswith("b seed 0: test_accuracy = ")
        assert claim.outcomes["reproduced"][1].inconclusive == "b seed 0 did not learn"
        assert claim.outcomes["reproduced"][0].outcome == "holds"  # a.test_accuracy >= 0.9 reads a only
        ledger.write(root)
        assert "b seed 0 did not learn" in (root / "CLAIMS.md").read_text()


def test_an_unguarded_cell_is_read_as_written_and_its_reason_is_printed(tmp_path):
    root = _with_levels(tmp_path, _values(3, 0.95), _values(3, 0.05, 0.01), 0.1, [])
    assert _claim(root).verdict == "inconclusive (a judged seed did not learn)"
    data = yaml.safe_load((root / "claims.yaml").read_text())
    data["claims"][0]["unguarded"] = {"b": "the claim predicts that b learns nothing"}
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    claim = _claim(root)
    assert claim.verdict == "reproduced" and claim.unlearned == []
    ledger.write(root)
    assert "Not guarded, `b`: the claim predicts that b learns nothing" in (root / "CLAIMS.md").read_text()


@pytest.mark.parametrize("reproduced_b, partly_b, expect", [
    (True, False, "partly (reproduced: inconclusive)"),     # partly holds on a alone; reproduced needs b
    (False, True, "not reproduced (partly: inconclusive)"),  # reproduced fails on a alone; partly needs b
    (True, True, "inconclusive (a judged seed did not learn)"),
])
def test_the_verdict_is_decided_by_the_conclusive_conditions(tmp_path, reproduced_b, partly_b, expect):
    a_fails = "a.test_accuracy >= 0.99" if not reproduced_b else "a.test_accuracy >= 0.9"
    rule = {"reproduced": [a_fails] + (["b.test_accuracy <= 0.2"] if reproduced_b else []),
            "partly": ["a.test_accuracy >= 0.5"] + (["b.test_accuracy <= 0.2"] if partly_b else [])}
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95, 0.01), "b": _values(3, 0.05, 0.01)}, rule=rule)
    data = yaml.safe_load((root / "claims.yaml").read_text())
    data["tables"]["t"]["no_learning"] = {"*": {"test_accuracy": 0.1}}
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    assert _claim(root).verdict == expect


def test_a_table_without_a_no_learning_level_is_refused(tmp_path):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)})
    data = yaml.safe_load((root / "claims.yaml").read_text())
    del data["tables"]["t"]["no_learning"]
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ClaimsError, match="tables.t: declare no_learning"):
        ledger.build(root)


def test_a_level_must_be_declared_for_every_learned_term(tmp_path):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)},
                           claim={"learned": ["a.test_accuracy@64"]})
    with pytest.raises(ClaimsError, match="declares no no_learning level of test_accuracy@64"):
        _claim(root)


def test_exploration_conditions_are_shown_but_never_give_the_verdict(tmp_path):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.5), "b": _values(3, 0.1)},
                           rule={"reproduced": ["a.test_accuracy >= 0.9"], "exploration": ["a.test_accuracy >= 0.3"]})
    claim = _claim(root)
    assert claim.verdict == "not reproduced" and claim.outcomes["exploration"][0].holds
    ledger.write(root)
    assert "- exploration: `a.test_accuracy >= 0.3`" in (root / "CLAIMS.md").read_text()


# ------------------------------------------------------------------------------------------- step 0
def _without_step0(root: Path) -> None:
    """The rows as a table made before rows recorded their step-0 metrics."""
    path = root / "tables" / "t" / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "step0_metrics"}) + "\n" for r in rows))


def _untrained(root: Path, values: dict) -> None:
    _without_step0(root)
    cells = {label: {str(seed): {"test_accuracy": acc, "test_accuracy@64": acc} for seed, acc in enumerate(accs)}
             for label, accs in values.items()}
    (root / "tables" / "t" / "untrained.json").write_text(json.dumps({"commit": "x", "cells": cells}))


EQUAL_RULE = {"reproduced": ["a.test_accuracy >= b.test_accuracy - 0.05"]}
#: neither cell guarded: the rule is read as written, at step 0 too
UNGUARDED = {"unguarded": {"a": "exempt in this test", "b": "exempt in this test"}}


def test_a_condition_that_holds_on_the_untrained_models_is_flagged_and_fails_the_check(tmp_path):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.93)}, rule=EQUAL_RULE,
                           claim=UNGUARDED)
    _untrained(root, {"a": _values(3, 0.1, 0.01), "b": _values(3, 0.1, 0.01)})  # both guess at step 0
    claim = _claim(root)
    assert claim.verdict == "reproduced"
    assert claim.vacuous == ["every reproduced condition holds at step 0"]
    assert "a.test_accuracy >= b.test_accuracy - 0.05" in claim.step0_holds[0]
    ledger.write(root)
    assert "**Vacuous at step 0**" in (root / "CLAIMS.md").read_text()
    problems = ledger.check(root)
    assert any("vacuous at step 0" in p for p in problems), problems
    # a rule whose conditions fail at step 0 is not flagged
    _untrained(root, {"a": _values(3, 0.1, 0.01), "b": _values(3, 0.9, 0.01)})
    assert _claim(root).vacuous == [] and _claim(root).step0_holds == []
    # one condition holding at step 0 is listed, but the verdict is vacuous only when all of them hold
    data = yaml.safe_load((root / "claims.yaml").read_text())
    data["claims"][0]["rule"]["reproduced"] = ["a.test_accuracy >= 0.9", "b.test_accuracy <= 0.95"]
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    claim = _claim(root)
    assert claim.vacuous == [] and len(claim.step0_holds) == 1 and "b.test_accuracy <= 0.95" in claim.step0_holds[0]


def test_a_step0_condition_is_accepted_when_its_cells_must_have_learned_or_the_claim_says_why(tmp_path):
    for extra in ({"unguarded": {"b": "exempt in this test"}},  # a stays guarded
                  {**UNGUARDED,
                   "step0_ok": {"a.test_accuracy >= b.test_accuracy - 0.05": "equal at step 0 by construction"}}):
        root = _synthetic_root(tmp_path / str(len(extra)) / next(iter(extra)), {"a": _values(3, 0.95),
                               "b": _values(3, 0.93)}, rule=EQUAL_RULE, claim=extra)
        data = yaml.safe_load((root / "claims.yaml").read_text())
        data["tables"]["t"]["no_learning"] = {"*": {"test_accuracy": 0.1}}
        (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        _untrained(root, {"a": _values(3, 0.1, 0.01), "b": _values(3, 0.1, 0.01)})
        claim = _claim(root)
        assert claim.vacuous == [] and claim.verdict == "reproduced", claim.vacuous


def test_rows_record_their_step0_metrics_and_a_cell_without_them_is_reported(tmp_path):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)})
    _without_step0(root)
    claim = _claim(root)
    assert claim.step0_missing == ["a", "b"]
    assert any("no step-0 evaluation of a, b" in p for p in ledger.check(root))
    path = root / "tables" / "t" / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "step0_metrics": {"test_accuracy": 0.1, "test_accuracy@64": 0.1}})
                            + "\n" for r in rows))
    claim = _claim(root)
    assert claim.step0_missing == [] and claim.vacuous == []  # a at 0.1 fails a >= 0.9 at step 0
    assert len(claim.step0_holds) == 1 and "b.test_accuracy <= 0.2" in claim.step0_holds[0]


def test_an_ablation_row_records_the_untrained_models_metrics(tmp_path):
    from zoo.cli import main
    from zoo.experiments.untrained import untrained_metrics
    from zoo.recipes import resolve
    from zoo.rows import read_rows
    recipe = tmp_path / "grid.yaml"
    recipe.write_text(f"extends: {TINY}\ngrid: [{{label: a, train.steps: 30}}]\n")
    assert main(["ablate", str(recipe), "--out", str(tmp_path / "out"), "--no-plot", "--no-progress"]) == 0
    row = read_rows(tmp_path / "out" / "results.jsonl")[0]
    step0 = row["step0_metrics"]
    assert step0 == untrained_metrics(resolve(TINY, ["train.steps=30"]))  # the same model, rebuilt from the seed
    assert step0["params"] == row["metrics"]["params"] and step0["test_loss"] > row["metrics"]["test_loss"] + 0.1


# ------------------------------------------------------------------------------------------- stale by code
ATTENTION = Path(__file__).resolve().parents[2] / "mixers" / "attention.py"


def _code_repo(tmp_path, cells: dict | None = None, **claim) -> tuple[Path, str]:
    """A repository whose table rows ran the attention mixer of its own ``mixers/attention.py``: cells a and b
    (0.95 and 0.1 accurate) or ``cells``, with ``claim`` (``rule=``, ``claim=``) as :func:`_synthetic_root` takes."""
    from zoo.recipes import resolve
    root = _synthetic_root(tmp_path, cells or {"a": _values(3, 0.95), "b": _values(3, 0.1)}, **claim)
    (root / "mixers").mkdir()
    (root / "mixers" / "attention.py").write_text(ATTENTION.read_text())
    _git(root, "init", "-q")
    path = root / "tables" / "t" / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.unlink()
    code = _commit(root, "code and rule")
    plain = resolve(TINY, ["model.layers=[attention]"]).plain
    path.write_text("".join(json.dumps({**r, "recipe": {**plain, "seed": r["seed"]}, "versions": {"git": code},
                                        "step0_metrics": {"test_accuracy": 0.1, "test_accuracy@64": 0.1}}) + "\n"
                            for r in rows))
    _commit(root, "rows")
    return root, code


def test_a_table_whose_mixer_code_changed_after_its_rows_is_stale_by_code(tmp_path):
    root, _ = _code_repo(tmp_path)
    assert _claim(root).stale == [] and _claim(root).verdict == "reproduced"
    source = root / "mixers" / "attention.py"
    # wording, comments and import order are not code
    text = source.read_text()
    source.write_text(text.replace('"""', '"""Reworded. ', 1) + "\n# a comment\n")
    _commit(root, "docs only")
    assert _claim(root).stale == []
    source.write_text(source.read_text() + "\nSCALE_FIX = 2.0\n")
    change = _commit(root, "a change of code")
    claim = _claim(root)
    assert claim.verdict == "reproduced, stale by code"
    assert [s.label for s in claim.stale] == ["a", "b"] and change in claim.stale[0].text()
    assert "mixers/attention.py" in claim.stale[0].text()
    notes = []
    ledger.write(root, notes)
    assert notes and notes[0].startswith("c: stale by code: a: " + change)
    assert "Stale by code" in (root / "CLAIMS.md").read_text()
    # a change the table vouches for, with its reason, does not stale it
    data = yaml.safe_load((root / "claims.yaml").read_text())
    data["tables"]["t"]["code_changes"] = {change: "adds an unused constant"}
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    assert _claim(root).stale == [] and _claim(root).verdict == "reproduced"


@pytest.mark.parametrize("outcome", ["keeps", "differs: test_loss 0.5 -> 0.6"])
def test_a_probe_vouches_for_the_changes_up_to_its_commit_only_when_the_numbers_kept(tmp_path, outcome):
    """A recorded probe of a row's commit against a later one covers the code changes in between only when
    re-running there kept the numbers; any other outcome leaves the cell stale by those changes."""
    from zoo.experiments.freshness import cell_staleness
    root, code = _code_repo(tmp_path)
    source = root / "mixers" / "attention.py"
    source.write_text(source.read_text() + "\nSCALE_FIX = 2.0\n")
    change = _commit(root, "a change of code")
    full = {c: _git(root, "rev-parse", c).strip() for c in (code, change)}
    rows = [json.loads(line) for line in (root / "tables" / "t" / "results.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["label"].startswith("a")]
    probed = {"a": {full[code]: {"until": full[change], "outcome": outcome}}}
    staleness = cell_staleness(root, "a", rows, {}, probed)
    assert cell_staleness(root, "a", rows, {}, None).stale  # unprobed, the change stales the cell
    if outcome == "keeps":
        assert not staleness.stale
    else:
        assert staleness.stale and change[:7] in staleness.text()


def test_a_vouched_commit_written_without_quotes_that_yaml_reads_as_a_number_is_refused(tmp_path):
    import random
    root, _ = _code_repo(tmp_path)
    # an all-digit short hash: YAML reads it as an int, and one with a leading 0 and digits 0-7 as octal
    digits = "0" + "".join(random.choice("01234567") for _ in range(6))
    text = (root / "claims.yaml").read_text()
    data = yaml.safe_load(text)
    data["tables"]["t"]["code_changes"] = {"PLACEHOLDER": "adds an unused constant"}
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False).replace("PLACEHOLDER", digits))
    assert list(yaml.safe_load((root / "claims.yaml").read_text())["tables"]["t"]["code_changes"]) == [int(digits, 8)]
    with pytest.raises(ClaimsError, match=f"read as numbers .*quote each commit hash, e.g. '{int(digits, 8)}'"):
        _claim(root)
    # quoted, the same hash is a commit
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False).replace("PLACEHOLDER", f"'{digits}'"))
    assert _claim(root).verdict == "reproduced"


def _copy_of_the_code(tmp_path) -> tuple[Path, str]:
    """A repository holding a copy of this code, with table t's rows computed at its first commit."""
    import shutil
    root, _ = _code_repo(tmp_path)
    source = Path(__file__).resolve().parents[2]
    for package in ("kernels", "mixers", "zoo"):
        shutil.rmtree(root / package, ignore_errors=True)
        shutil.copytree(source / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    code = _commit(root, "the code")
    path = root / "tables" / "t" / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "versions": {"git": code}}) + "\n" for r in rows))
    _commit(root, "rows")
    return root, code


def test_vouching_probes_the_rows_commit_against_now_and_finds_a_change_of_numbers(tmp_path):
    from zoo.experiments import vouch
    root, _ = _copy_of_the_code(tmp_path)
    attention = root / "mixers" / "attention.py"
    # a refactor: the same numbers
    attention.write_text(attention.read_text() + "\n\ndef unused_helper():\n    return 1\n")
    _commit(root, "a refactor")
    assert [s.label for s in _claim(root).stale] == ["a", "b"]
    assert vouch.vouch(root, ["t"]) == {"t": {"a": "keeps", "b": "keeps"}}
    assert _claim(root).stale == [] and _claim(root).verdict == "reproduced"
    # a change of numbers: the embedding scaled in the hybrid stack
    (root / "zoo" / "model.py").write_text((root / "zoo" / "model.py").read_text().replace(
        "x = self.embed(ids)", "x = self.embed(ids) * 1.5", 1))
    _commit(root, "a change of numbers")
    assert [s.label for s in _claim(root).stale] == ["a", "b"]
    outcomes = vouch.vouch(root, ["t"])["t"]
    assert all("differs" in o for o in outcomes.values()), outcomes
    assert _claim(root).verdict == "reproduced, stale by code"
    # the refactor stays vouched for: the record keeps its "keeps" and names the failed commit beside it
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    for cell in json.loads(vouch.path_of(root, "t").read_text()).values():
        (record,) = cell.values()
        assert record["outcome"] == "keeps" and record["failed_at"] == head and "differs" in record["failed"]
    assert all(list(s.unvouched) == [head[:len(next(iter(s.unvouched)))]] for s in _claim(root).stale)


def test_vouching_compares_what_the_evaluation_reads_beyond_the_training_length_and_task(monkeypatch):
    """A change that acts only past the training length (or only on an eval.tasks entry) keeps the training
    probe but not the evaluation's: it is not vouched for. An entry one commit cannot compute is not compared."""
    from mixers.attention import Attention
    from zoo.experiments import probe, vouch
    from zoo.recipes import resolve
    plain = resolve(TINY, ["eval.seq_lens=[32]", "eval.tasks=[{label: k4, name: mqar, num_kv_pairs: 4}]"]).plain
    before = probe.probe(plain)
    assert sorted(before["evaluation"]) == ["@32", "task=k4", "task=k4@32"]
    forward = Attention.forward
    monkeypatch.setattr(Attention, "forward", lambda self, x, mask=None: forward(self, x, mask) *
                        (1.0 if x.shape[1] <= 16 else 0.5))
    after = probe.probe(plain)
    assert after["loss"] == before["loss"] and after["grads"] == before["grads"]
    assert vouch.compare(before, after).startswith("the untrained loss on the evaluation data @32 differs")
    renamed = {**after, "evaluation": {**before["evaluation"], "task=k4": {"data": "other", "loss": 0.0}}}
    assert vouch.compare(before, renamed) == "the evaluation data task=k4 differ"
    older = {**before, "evaluation": {label: {"error": "AttributeError: no seq_len"} for label in before["evaluation"]}}
    assert vouch.compare(older, before) == vouch.KEEPS


def test_vouching_compares_the_end_of_run_metrics_and_the_metric_code_belongs_to_every_cell(monkeypatch):
    """The metrics module computes every number of a row's test columns: its changes make every cell stale, and a
    probe compares what the commit's metric functions make of the untrained model. A change of how a metric is
    pooled is found; an accuracy one near-tie apart is not a change; a commit without the functions is not
    compared."""
    from zoo.experiments import freshness, probe, vouch
    from zoo.recipes import resolve
    from zoo.training import evaluation
    assert "zoo/training/evaluation.py" in freshness.EVERY_CELL and "zoo/training/evaluation.py" in str(
        freshness.CODE_PATHS)
    plain = resolve(TINY).plain
    before = probe.probe(plain)
    metrics = before["metrics"]
    assert {"loss", "accuracy", "sequence_accuracy", "positions", "rows"} <= set(metrics)
    assert vouch.compare(before, probe.probe(plain)) == vouch.KEEPS
    evaluate = evaluation.evaluate_data
    monkeypatch.setattr(evaluation, "evaluate_data", lambda *a, **k: {**evaluate(*a, **k),
                                                                      "loss": evaluate(*a, **k)["loss"] * 1.01})
    changed = probe.probe(plain)
    assert changed["loss"] == before["loss"]   # the training probe cannot see it
    assert vouch.compare(before, changed).startswith("the end-of-run loss of the untrained model differs")
    one_tie = {**before, "metrics": {**metrics, "accuracy": metrics["accuracy"] + 1 / metrics["positions"]}}
    assert vouch.compare(before, one_tie) == vouch.KEEPS
    two = {**before, "metrics": {**metrics, "accuracy": metrics["accuracy"] + 2 / metrics["positions"]}}
    assert vouch.compare(before, two).startswith("the end-of-run accuracy of the untrained model differs")
    older = {**before, "metrics": {"error": "ImportError: no zoo.training.evaluation"}}
    assert vouch.compare(older, changed) == vouch.KEEPS
