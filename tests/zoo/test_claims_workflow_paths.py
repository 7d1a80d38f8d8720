"""The claims workflow on the paths a researcher hits beside the happy one: ``zoo claims --untrained`` on a table
that awaits its rows, a ``code_changes.json`` or ``untrained.json`` a merge left broken, a committed
``claims.yaml`` that is not YAML (fixed in the working tree), a row at a commit this history does not have, and
``zoo claims --vouch`` on a cell whose rows ran at several commits (or record none). Each is answered in one
line that names what to do, never with a traceback, and no probe's outcome is dropped from the report."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from zoo.cli import main
from zoo.experiments import untrained, vouch
from zoo.experiments.freshness import Staleness
from zoo.experiments.preregistration import registration, rule_commit

from .test_claims import _synthetic_root, _values


def _git(root: Path, *args) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


def _commit(root: Path, message: str) -> str:
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)
    return _git(root, "rev-parse", "HEAD")


def _repo(tmp_path) -> Path:
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)})
    _git(root, "init", "-q")
    _commit(root, "a table and its claim")
    return root


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# ------------------------------------------------------------------------------------------- step 0
def test_untrained_of_a_table_awaiting_its_rows_is_refused_in_one_line(tmp_path, capsys):
    """A table listed with ``awaiting_rows`` has no folder yet: there is nothing to evaluate (it crashed writing
    ``untrained.json`` into a folder that does not exist)."""
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)})
    data = yaml.safe_load((root / "claims.yaml").read_text())
    data["tables"]["t"]["awaiting_rows"] = "needs a GPU"
    (root / "claims.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (root / "tables" / "t" / "results.jsonl").unlink()
    (root / "tables" / "t").rmdir()
    assert main(["claims", "--root", str(root), "--untrained", "t"]) == 2
    err = _one_line_error(capsys)
    assert "tables/t/results.jsonl does not exist" in err and "no row to evaluate" in err
    assert not (root / "tables" / "t").exists()


@pytest.mark.parametrize("text", ['{"commit": "x", "cells": {', '{"commit": "x", "cells": {"a": {"zero": {}}}}',
                                  '{"commit": "x", "cells": ["a"]}', '["a"]'])
def test_a_broken_untrained_json_is_named_not_a_traceback(tmp_path, capsys, text):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)})
    (root / "tables" / "t" / "untrained.json").write_text(text)
    assert main(["claims", "--root", str(root), "--check"]) == 2
    err = _one_line_error(capsys)
    assert "untrained.json" in err and "zoo claims --untrained t" in err


def test_a_well_formed_untrained_json_still_reads(tmp_path):
    root = _synthetic_root(tmp_path, {"a": _values(3, 0.95), "b": _values(3, 0.1)})
    (root / "tables" / "t" / "untrained.json").write_text(
        json.dumps({"commit": "x", "cells": {"old": {"0": {"test_accuracy": 0.1}}}}))
    found = untrained.load(root, "t")
    assert found["old"] == {0: {"test_accuracy": 0.1}} and sorted(found["a"]) == [0, 1, 2]


# ------------------------------------------------------------------------------------------- vouching
@pytest.mark.parametrize("text", ['{\n<<<<<<< HEAD\n "a": {}\n=======\n}\n', '["a"]', '{"a": {"abc": "keeps"}}'])
def test_a_broken_code_changes_json_is_named_not_a_traceback(tmp_path, capsys, text):
    root = _repo(tmp_path)
    (root / "tables" / "t" / "code_changes.json").write_text(text)
    assert main(["claims", "--root", str(root), "--check"]) == 2
    err = _one_line_error(capsys)
    assert "code_changes.json" in err and "zoo claims --vouch t" in err


def _fake_vouch(monkeypatch, root: Path, probes: dict[str, dict]):
    """Every cell stale, and the probe at the checkout of a row commit (a worktree named by it) returning
    ``probes[commit]``, at HEAD's (``now``) ``probes["now"]``; the files each probe saw in ``probes["seen"]``."""
    monkeypatch.setattr(vouch, "cell_staleness", lambda root, label, rows, *_: Staleness(label, {"x": ["p"]}, []))
    seen = probes.setdefault("seen", {})

    def run_probe(checkout: Path, recipes: list[dict]) -> list[dict]:
        seen[checkout.name] = {p.name: p.read_text() for p in checkout.glob("*.txt")}
        return [probes[checkout.name]] * len(recipes)
    monkeypatch.setattr(vouch, "_run_probe", run_probe)


def _stamp(root: Path, commits: dict[str, str]) -> None:
    """Record each row of table t as computed at ``commits[<label> <seed>]`` (a missing key: no commit)."""
    path = root / "tables" / "t" / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    out = []
    for r in rows:
        commit = commits.get(f"{r['label']} {r['seed']}", commits.get(r["label"]))
        out.append({**r, "versions": {"git": commit}} if commit is not None else r)
    path.write_text("".join(json.dumps(r) + "\n" for r in out))


PROBE = {"data": "d", "schedule": [1.0], "decayed": [], "loss": 2.0, "grads": {"w": 1.0}}


def test_vouching_reports_every_row_commit_of_a_cell_not_only_the_last_one(tmp_path, monkeypatch):
    """Seed 0 of cell a re-run at a later commit: its rows ran at two commits. The code since the first changed
    the numbers, since the second it did not; the report named one of them only (the last by hash), so it
    could read "keeps" for a cell that stays stale."""
    root = _repo(tmp_path)
    (root / "notes.txt").write_text("code\n")
    first = _commit(root, "code at which the table ran")
    (root / "notes.txt").write_text("a change\n")
    second = _commit(root, "code at which seed 0 of a ran again")
    _stamp(root, {"a": first[:7], "a 0": second[:7], "b": first[:7]})   # rows record short commits
    _commit(root, "rows")
    _fake_vouch(monkeypatch, root, {first[:7]: {**PROBE, "loss": 3.0}, second[:7]: PROBE, "now": PROBE})
    found = vouch.vouch(root, ["t"])["t"]
    assert found["b"].startswith("the loss differs")
    assert f"rows at {first[:7]}: the loss differs" in found["a"] and f"rows at {second[:7]}: keeps" in found["a"]
    records = vouch.load(root, "t")["a"]
    assert records[second]["outcome"] == "keeps" and records[first]["outcome"].startswith("the loss differs")


def test_vouching_rows_without_a_commit_or_at_an_unknown_one_says_which(tmp_path, monkeypatch):
    root = _repo(tmp_path)
    _stamp(root, {"b": "deadbee"})  # a's rows record no commit
    _commit(root, "rows")
    _fake_vouch(monkeypatch, root, {"now": PROBE})
    found = vouch.vouch(root, ["t"])["t"]
    assert found["a"] == "not comparable (at the rows' commit: the rows record no commit (versions.git))"
    assert found["b"] == "not comparable (at the rows' commit: commit deadbee is not in this history)"


def test_a_probe_error_now_is_named_as_now():
    assert vouch.compare(PROBE, {"error": "boom"}) == "not comparable (now: boom)"
    assert vouch.compare({"error": "old"}, PROBE) == "not comparable (at the rows' commit: old)"


def test_vouching_compares_the_untrained_model_at_each_test_time_knob_value(monkeypatch):
    """gka_budget's claims read ``test_accuracy@num_iter=<n>``, the trained model evaluated at each value of
    ``eval.test_time_sweep``. A change that breaks only the test-time path (the knob's value ignored at
    evaluation) leaves training and the evaluation at the trained value as they were; the probe read no knob
    value, so such a change was vouched for as keeping the table's numbers."""
    from mixers.base import Mixer
    from zoo.experiments import probe
    from zoo.recipes import resolve
    plain = resolve(Path(__file__).parent / "recipes" / "tiny.yaml",
                    ["model.layers=[gka]", "eval.test_time_sweep={num_iter: [0, 10]}"]).plain
    before = probe.probe(plain)
    assert {"num_iter=0", "num_iter=10"} <= set(before["evaluation"])
    assert vouch.compare(before, probe.probe(plain)) == vouch.KEEPS
    monkeypatch.setattr(Mixer, "knob", lambda self, name: getattr(self.options, name))  # overrides ignored
    after = probe.probe(plain)
    assert after["loss"] == before["loss"] and after["grads"] == before["grads"]
    assert vouch.compare(before, after).startswith("the untrained loss on the evaluation data num_iter=0 differs")
    # a commit whose layers declare no such knob (or without test-time knobs) is not compared on it
    older = {**before, "evaluation": {k: v for k, v in before["evaluation"].items() if "=" not in k}}
    assert vouch.compare(older, after) == vouch.KEEPS


# ------------------------------------------------------------------------------------------- pre-registration
SPEC = {"id": "c1", "table": "t", "rule": "a.test_accuracy >= 0.9", "cells": ["a", "b"]}


@pytest.mark.parametrize("broken", ["claims:\n  - {id: c1\n", "- id: c1\n  rule: x\n"])
def test_a_committed_claims_yaml_that_is_not_a_mapping_of_claims_is_not_the_rules_form(tmp_path, broken):
    """A merge committed claims.yaml with conflict markers (or as a list); the working tree holds it fixed. The
    rule's current form is not committed (it crashed reading HEAD's file)."""
    _git(tmp_path, "init", "-q")
    good = yaml.safe_dump({"claims": [SPEC]})
    (tmp_path / "claims.yaml").write_text(good)
    ruled = _commit(tmp_path, "the rule")
    rows = [{"label": "a", "versions": {"git": ruled}}]
    assert rule_commit(tmp_path, SPEC) == ruled
    (tmp_path / "claims.yaml").write_text(broken)
    _commit(tmp_path, "a broken claims.yaml")
    (tmp_path / "claims.yaml").write_text(good)
    assert rule_commit(tmp_path, SPEC) is None
    found = registration(tmp_path, SPEC, rows)
    assert found.post_hoc and found.text == "post hoc: the rule's current form is not committed"
    fixed = _commit(tmp_path, "claims.yaml fixed")
    assert rule_commit(tmp_path, SPEC) == fixed


def test_rows_run_while_claims_yaml_held_conflict_markers_show_no_pre_registration(tmp_path):
    """A merge conflict in claims.yaml, committed, holds both versions of a rule; rows computed there, and the
    conflict then resolved to one of them. The rule took its form when it was resolved, not before the
    conflict: the module's own account ("the oldest commit from which claims.yaml gives the claim the same rule
    up to now"). The unreadable commit was skipped, so the rule dated from before it and the rows read as
    pre-registered."""
    _git(tmp_path, "init", "-q")
    good = yaml.safe_dump({"claims": [SPEC]})
    (tmp_path / "claims.yaml").write_text(good)
    _commit(tmp_path, "the rule")
    other = yaml.safe_dump({"claims": [{**SPEC, "rule": "a.test_accuracy >= 0.5"}]})
    (tmp_path / "claims.yaml").write_text(f"<<<<<<< HEAD\n{good}=======\n{other}>>>>>>> side\n")
    conflict = _commit(tmp_path, "a merge committed with its conflict")
    (tmp_path / "claims.yaml").write_text(good)
    resolved = _commit(tmp_path, "the conflict resolved")
    assert rule_commit(tmp_path, SPEC) == resolved
    found = registration(tmp_path, SPEC, [{"label": "a", "versions": {"git": conflict[:7]}}])
    assert found.post_hoc and f"rows computed at {conflict[:7]}" in found.text, found.text


def test_a_row_at_an_unknown_commit_is_not_said_to_come_before_the_rule(tmp_path):
    """A commit this history does not have (a shallow clone, a rewritten history) is post hoc, but the text said
    the rule came "after the code of rows computed at" it, which nothing here shows."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump({"claims": [SPEC]}))
    ruled = _commit(tmp_path, "the rule")
    (tmp_path / "notes.txt").write_text("later\n")
    later = _commit(tmp_path, "code after the rule")
    found = registration(tmp_path, SPEC, [{"label": "a", "versions": {"git": later}},
                                          {"label": "b", "versions": {"git": "deadbee"}}, {"label": "b"}])
    assert found.post_hoc and ruled[:7] in found.text
    assert "after the code" not in found.text
    assert "rows computed at unrecorded, deadbee (a commit this history does not have" in found.text
    # a row that is known to predate the rule is still named as such, beside the unknown one
    (tmp_path / "claims.yaml").write_text(yaml.safe_dump({"claims": [{**SPEC, "rule": "a.test_accuracy >= 0.8"}]}))
    reruled = _commit(tmp_path, "the rule tightened after a row")
    found = registration(tmp_path, {**SPEC, "rule": "a.test_accuracy >= 0.8"},
                         [{"label": "a", "versions": {"git": later}}, {"label": "b", "versions": {"git": "deadbee"}}])
    assert found.text == (f"post hoc: rule committed in {reruled[:7]}, after the code of rows computed at {later}; "
                          f"rows computed at deadbee (a commit this history does not have, or none recorded) cannot "
                          f"show they came after it")


def test_in_a_shallow_clone_the_registration_says_the_history_stops_short(tmp_path):
    """A CI checkout is often shallow: the rows' commits are cut off, and the rule seems committed in the one
    commit there is. The verdict stays post hoc (nothing here shows the order) and the text says why."""
    origin = tmp_path / "origin"
    origin.mkdir()
    _git(origin, "init", "-q")
    (origin / "claims.yaml").write_text(yaml.safe_dump({"claims": [SPEC]}))
    _commit(origin, "the rule")
    (origin / "notes.txt").write_text("code\n")
    code = _commit(origin, "code the rows ran")
    (origin / "more.txt").write_text("later\n")
    _commit(origin, "later")
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{origin}", str(shallow)], check=True)
    rows = [{"label": "a", "versions": {"git": code[:7]}}]
    assert not registration(origin, SPEC, rows).post_hoc
    found = registration(shallow, SPEC, rows)
    assert found.post_hoc and "shallow clone" in found.text and "git fetch --unshallow" in found.text


def test_vouching_a_table_with_nothing_to_vouch_for_says_so(tmp_path, monkeypatch, capsys):
    """``--vouch`` printed nothing for a table none of whose cells was stale: the researcher could not tell it
    from a table it skipped."""
    root = _repo(tmp_path)
    monkeypatch.setattr(vouch, "vouch", lambda root, tables: {})
    assert main(["claims", "--root", str(root), "--vouch", "t"]) == 0
    assert "tables/t: no cell to vouch for" in capsys.readouterr().out


def test_the_ledger_refuses_a_shallow_clone_in_one_line(tmp_path, capsys):
    """In a shallow clone the rows' commits are missing: ``--check`` failed as if CLAIMS.md had been edited and a
    plain ``zoo claims`` rewrote it with every cell stale; both now stop before reading anything, saying how to
    fetch the history, and write nothing."""
    root = _repo(tmp_path)
    assert main(["claims", "--root", str(root)]) == 0
    _commit(root, "the ledger, so that a clone of depth 1 leaves the first commit out")
    clone = tmp_path / "shallow"
    _git(tmp_path, "clone", "-q", "--depth", "1", f"file://{root}", str(clone))
    before = (clone / "CLAIMS.md").read_text()
    for args in (["--check"], []):
        assert main(["claims", "--root", str(clone), *args]) == 2
        err = _one_line_error(capsys)
        assert "shallow clone" in err and "git fetch --unshallow" in err
    assert (clone / "CLAIMS.md").read_text() == before
    _git(clone, "fetch", "-q", "--unshallow")
    assert main(["claims", "--root", str(clone), "--check"]) == 0


def test_vouching_probes_the_committed_code_not_the_working_tree(tmp_path, monkeypatch):
    """The record says the code up to HEAD keeps a cell's numbers; the probe of "now" ran on the working tree, which
    may differ from HEAD outside the code paths whose changes are refused (the training loop, the recipes)."""
    root = _repo(tmp_path)
    (root / "notes.txt").write_text("code at which the table ran\n")
    first = _commit(root, "code at which the table ran")
    _stamp(root, {"a": first[:7], "b": first[:7]})
    (root / "notes.txt").write_text("committed code\n")
    head = _commit(root, "rows and a change")
    (root / "notes.txt").write_text("uncommitted code\n")   # not under the code paths: vouching goes ahead
    probes = {first[:7]: PROBE, "now": PROBE}
    _fake_vouch(monkeypatch, root, probes)
    assert vouch.vouch(root, ["t"])["t"] == {"a": "keeps", "b": "keeps"}
    assert probes["seen"]["now"] == {"notes.txt": "committed code\n"}
    assert probes["seen"][first[:7]] == {"notes.txt": "code at which the table ran\n"}
    assert {r["until"] for r in vouch.load(root, "t")["a"].values()} == {head}
