"""When a claim's rule took its current form, read from a small git history of ``claims.yaml`` written here: a
rule edited and then edited back takes its form again at the commit that restored it, not at the first commit
that once held the same text, so rows computed while the rule read otherwise show the verdict is post hoc; a change
of any field that decides a verdict (rule, cells, learned, unguarded, change, step0_ok) gives the rule a new form,
and an edit of another field does not."""
from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from zoo.experiments.preregistration import registration, rule_commit


def _git(root: Path, *args) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


def _commit_rule(root: Path, rule: str, message: str) -> str:
    spec = {"id": "c1", "table": "t", "rule": rule, "cells": ["a", "b"]}
    (root / "claims.yaml").write_text(yaml.safe_dump({"claims": [spec]}))
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return _git(root, "rev-parse", "HEAD")


def test_a_rule_edited_and_restored_takes_its_form_at_the_restoring_commit(tmp_path):
    rng = random.Random(torch.initial_seed())
    threshold = round(rng.uniform(0.5, 0.9), 2)
    rule, other = f"a.test_accuracy >= {threshold}", f"a.test_accuracy >= {threshold - 0.2:.2f}"
    _git(tmp_path, "init", "-q")
    first = _commit_rule(tmp_path, rule, "the rule")
    edited = _commit_rule(tmp_path, other, "the rule loosened")
    (tmp_path / "notes.txt").write_text("rows computed here\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a run while the rule read otherwise")
    rows_at = _git(tmp_path, "rev-parse", "HEAD")
    restored = _commit_rule(tmp_path, rule, "the rule as it first was")
    spec = {"id": "c1", "table": "t", "rule": rule, "cells": ["a", "b"]}
    assert rule_commit(tmp_path, spec) == restored != first
    assert rule_commit(tmp_path, {**spec, "rule": other}) is None  # not the form committed now
    verdict = registration(tmp_path, spec, [{"label": "a", "versions": {"git": rows_at}}])
    assert verdict.checked and verdict.post_hoc, verdict.text
    assert restored[:7] in verdict.text and rows_at in verdict.text and edited != restored


@pytest.mark.parametrize("field, before, after", [
    ("rule", "a.test_accuracy >= 0.9", "a.test_accuracy >= 0.8"), ("cells", ["a", "b"], ["a"]),
    ("learned", ["a"], ["a", "b"]), ("unguarded", None, ["b"]), ("change", "a beats b", "b beats a"),
    ("step0_ok", None, ["b"])])
def test_a_change_of_any_field_that_decides_the_verdict_gives_the_rule_a_new_form(tmp_path, field, before, after):
    base = {"id": "c1", "table": "t", "rule": "a.test_accuracy >= 0.9", "cells": ["a", "b"]}
    _git(tmp_path, "init", "-q")
    commits = []
    for value in (before, after):
        spec = {**base, field: value} if value is not None else {k: v for k, v in base.items() if k != field}
        (tmp_path / "claims.yaml").write_text(yaml.safe_dump({"claims": [spec]}))
        _git(tmp_path, "add", "-A")
        _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", f"{field}: {value}")
        commits.append(_git(tmp_path, "rev-parse", "HEAD"))
    assert rule_commit(tmp_path, spec) == commits[1]
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump({"claims": [{**spec, "note": "wording"}]}))
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "a field that decides nothing")
    assert rule_commit(tmp_path, spec) == commits[1]


def _commit_all(root: Path, message: str) -> str:
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return _git(root, "rev-parse", "HEAD")


def _write_rows(root: Path, rows: list[dict]) -> None:
    (root / "tables" / "t").mkdir(parents=True, exist_ok=True)
    (root / "tables" / "t" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


SPEC = {"id": "c1", "table": "t", "rule": "a.test_accuracy >= 0.9", "cells": ["a", "b"]}


def test_a_row_at_a_commit_unknown_here_cannot_show_pre_registration(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump({"claims": [SPEC]}))
    rule = _commit_all(tmp_path, "the rule")
    (tmp_path / "code.txt").write_text("later code\n")
    later = _commit_all(tmp_path, "code after the rule")
    unknown = f"{random.Random(torch.initial_seed()).getrandbits(160):040x}"
    assert registration(tmp_path, SPEC, [{"label": "a", "versions": {"git": later}}]).post_hoc is False
    verdict = registration(tmp_path, SPEC, [{"label": "a", "versions": {"git": later}},
                                            {"label": "b", "versions": {"git": unknown}}])
    assert verdict.post_hoc and unknown in verdict.text and rule[:7] in verdict.text


def test_rows_of_the_judged_cells_the_table_held_before_the_rule_make_it_post_hoc(tmp_path):
    _git(tmp_path, "init", "-q")
    _write_rows(tmp_path, [{"label": "a seed=0", "versions": {"git": ""}}])
    early = _commit_all(tmp_path, "a first run of cell a")
    _write_rows(tmp_path, [])
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump({"claims": [SPEC]}))
    _commit_all(tmp_path, "the rule; the early rows taken out")
    verdict = registration(tmp_path, SPEC, [], table="t", labels=("a",))
    assert verdict.post_hoc and early[:7] in verdict.text, verdict.text
    assert not registration(tmp_path, SPEC, [], table="t", labels=("b",)).post_hoc


def test_a_row_merged_into_the_table_from_a_branch_without_the_rule_is_post_hoc(tmp_path):
    _git(tmp_path, "init", "-q", "-b", "main")
    (tmp_path / "readme.txt").write_text("start\n")
    _commit_all(tmp_path, "start")
    _git(tmp_path, "branch", "side")
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump({"claims": [SPEC]}))
    _commit_all(tmp_path, "the rule")
    (tmp_path / "code.txt").write_text("code after the rule\n")
    code = _commit_all(tmp_path, "code after the rule")
    _git(tmp_path, "checkout", "-q", "side")
    row = {"label": "a", "versions": {"git": code}}
    _write_rows(tmp_path, [row])  # the table filled on a branch that never had the rule
    side = _commit_all(tmp_path, "rows on a branch without the rule")
    _git(tmp_path, "checkout", "-q", "main")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "merge", "-q", "--no-edit", "side")
    verdict = registration(tmp_path, SPEC, [row], table="t")
    assert verdict.post_hoc and side[:7] in verdict.text, verdict.text
