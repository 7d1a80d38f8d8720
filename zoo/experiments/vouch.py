"""Evidence that a code change keeps a table's numbers, so that it does not make the table stale by code.

``zoo claims --vouch <table>`` checks out the commit of each stale cell's rows (``git worktree``) and runs
:mod:`zoo.experiments.probe` there and in the current checkout (committed, clean) on one row of the cell.
The code changes in between keep the cell's numbers when both generate the same task data (the same bytes),
decay the same parameters, follow the same learning-rate schedule, and give the untrained model the same
loss (within :data:`LOSS_RTOL`) and the same gradient norm for every parameter (within :data:`GRAD_RTOL`) on
that data, and the same data and untrained loss for what the end-of-run evaluation reads beyond it (every
``eval.seq_lens`` length, every ``eval.tasks`` entry, every ``eval.test_time_sweep`` value; compared where both
commits can compute it), and the same
end-of-run metrics of the untrained model on the first test sequences (:func:`_compare_metrics`): they are then
refactors up to fp32 rounding. Rounding differences can still move a training run a
little, so a re-run may differ from the committed row in its last digits; no bit-equality is claimed.

The outcome is written to ``tables/<name>/code_changes.json``
(``{cell label: {row commit: {"until": commit, "outcome": "keeps" or why not}}}``) and read by
:mod:`zoo.experiments.freshness`: a cell's changes up to ``until`` are vouched for when the outcome is "keeps". A
later probe that fails keeps that record and adds ``failed_at`` (the commit) and ``failed`` (why), so the stale
list names only the changes after ``until``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import UserError
from ..rows import read_rows
from .claims.errors import ClaimsError, read_record
from .freshness import CODE_PATHS, cell_staleness
from .preregistration import git
from .results import group_by_cell

FILENAME = "code_changes.json"
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5
KEEPS = "keeps"
PROBE = Path(__file__).with_name("probe.py")


def path_of(root: Path, table: str) -> Path:
    return root / "tables" / table / FILENAME


def load(root: Path, table: str) -> dict[str, dict[str, dict]]:
    """The table's recorded probes (empty when there are none); a file that is not such a record (a merge left
    conflict markers in it, a hand edit) is refused naming it, never read as no record."""
    path = path_of(root, table)
    fix = f"repair it, or delete it and run zoo claims --vouch {table} again"
    data = read_record(path, fix)
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(by_commit, dict) and all(isinstance(r, dict) for r in
                                                                                  by_commit.values())
                                             for by_commit in data.values()):
        raise ClaimsError(f"{path}: not {{cell label: {{row commit: {{\"until\": ..., \"outcome\": ...}}}}}}; {fix}")
    return data


def _run_probe(checkout: Path, recipes: list[dict]) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", PROBE.read_text()], input=json.dumps(recipes), cwd=checkout,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"})
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [{"error": f"the probe failed at this commit: {tail}"}] * len(recipes)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


def compare(before: dict, after: dict) -> str:
    """``"keeps"``, or the first difference between two probes of one cell."""
    for name, probe in (("at the rows' commit", before), ("now", after)):
        if "error" in probe:
            return f"not comparable ({name}: {probe['error']})"
    if before["data"] != after["data"]:
        return "the task data differ"
    if before.get("schedule") != after.get("schedule"):
        return "the learning-rate schedule differs"
    if before["decayed"] != after["decayed"]:
        changed = sorted(set(before["decayed"]) ^ set(after["decayed"]))
        return f"weight decay differs for {', '.join(changed[:3])}"
    if not _close(before["loss"], after["loss"], LOSS_RTOL):
        return f"the loss differs ({before['loss']!r} vs {after['loss']!r})"
    if set(before["grads"]) != set(after["grads"]):
        return "the parameters differ"
    for name, g in before["grads"].items():
        if not _close(g, after["grads"][name], GRAD_RTOL):
            return f"the gradient of {name} differs ({g:.6g} vs {after['grads'][name]:.6g})"
    metrics = _compare_metrics(before.get("metrics") or {}, after.get("metrics") or {})
    if metrics:
        return metrics
    for label, a in (before.get("evaluation") or {}).items():
        b = (after.get("evaluation") or {}).get(label)
        if b is None or "error" in a or "error" in b:
            continue    # an entry one of the commits cannot compute (an older layout) is not compared
        if a["data"] != b["data"]:
            return f"the evaluation data {label} differ"
        if not _close(a["loss"], b["loss"], LOSS_RTOL):
            return f"the untrained loss on the evaluation data {label} differs ({a['loss']!r} vs {b['loss']!r})"
    return KEEPS


def _compare_metrics(a: dict, b: dict) -> str:
    """'' when two probes' end-of-run metrics agree: losses, bits per byte and perplexity within
    :data:`LOSS_RTOL`; an accuracy within one position (one row for the sequence accuracy), as far as a near-tie
    in an argmax can move it between two computations that agree to rounding. A side without metrics (an older
    layout, or an error) is not compared."""
    if not a or not b or "error" in a or "error" in b:
        return ""
    if (a.get("positions"), a.get("rows")) != (b.get("positions"), b.get("rows")):
        return "the end-of-run evaluation counts different supervised positions"
    for key in sorted(set(a) | set(b)):
        if key in ("positions", "rows"):
            continue
        if key not in a or key not in b:
            return f"the end-of-run evaluation reports {key} at one commit only"
        x, y = a[key], b[key]
        if x != x and y != y:   # both NaN (a diverged untrained model is not expected, but agrees)
            continue
        if key.endswith("accuracy"):
            unit = 1 / max(a["rows"] if key.endswith("sequence_accuracy") else a["positions"], 1)
            if abs(x - y) > 1.01 * unit:
                return f"the end-of-run {key} of the untrained model differs ({x!r} vs {y!r})"
        elif not _close(x, y, LOSS_RTOL):
            return f"the end-of-run {key} of the untrained model differs ({x!r} vs {y!r})"
    return ""


def _stale_rows(root: Path, table: str, recorded: dict) -> dict[str, dict[str, dict]]:
    """``{row commit: {label: one row}}`` of the table's stale cells."""
    out: dict[str, dict[str, dict]] = {}
    for label, rows in group_by_cell(read_rows(root / "tables" / table / "results.jsonl")).items():
        if cell_staleness(root, label, rows, {}, recorded).stale:
            for row in rows:
                commit = (row.get("versions") or {}).get("git") or ""
                out.setdefault(commit, {}).setdefault(label, row)
    return out


def vouch(root: Path, tables: list[str]) -> dict[str, dict[str, str]]:
    """Probe every stale cell of ``tables`` at its rows' commit and at HEAD, record the outcomes in
    each table's ``code_changes.json`` and return ``{table: {label: outcome}}`` (a cell whose rows ran at several
    commits that probe differently: the outcome of each, ``rows at <commit>: <outcome>``, joined by ``; ``)."""
    head = (git(root, "rev-parse", "HEAD") or "").strip()
    if not head:
        raise UserError("zoo claims --vouch: needs a git checkout with at least one commit")
    if (git(root, "status", "--porcelain", "--", *CODE_PATHS) or "").strip():
        raise UserError("zoo claims --vouch: the code has uncommitted changes; commit them first, so that what is "
                        "vouched for is a commit")
    work = Path(tempfile.mkdtemp(prefix="zoo-vouch-"))
    found: dict[tuple[str, str], dict[str, str]] = {}   # (table, label) -> {row commit: outcome}
    try:
        records = {t: load(root, t) for t in tables}
        todo = {t: _stale_rows(root, t, records[t]) for t in tables}
        jobs = [(commit, t, label, row) for t, by_commit in todo.items() for commit, rows in by_commit.items()
                for label, row in rows.items()]
        now_tree = work / "now"   # HEAD, what the record says it vouches for, not the working tree (which may
        # hold changes outside the code paths refused above, e.g. to the training loop or the recipes' resolver)
        if jobs and git(root, "worktree", "add", "--detach", "--quiet", str(now_tree), head) is None:
            raise UserError(f"zoo claims --vouch: could not check out HEAD into {now_tree} (git worktree add)")
        now = iter(_run_probe(now_tree, [row["recipe"] for *_, row in jobs]) if jobs else [])  # once for every cell
        after = {(commit, t, label): next(now) for commit, t, label, _ in jobs}
        for commit in sorted({c for c, *_ in jobs}):
            mine = [(t, label, row) for c, t, label, row in jobs if c == commit]
            checkout = work / commit
            full = (git(root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}") or "").strip()
            if full and git(root, "worktree", "add", "--detach", "--quiet", str(checkout), full) is not None:
                before = _run_probe(checkout, [row["recipe"] for *_, row in mine])
            else:
                why = f"commit {commit} is not in this history" if commit else "the rows record no commit (versions.git)"
                before, full = [{"error": why}] * len(mine), commit
            for (table, label, _), b in zip(mine, before):
                outcome = compare(b, after[(commit, table, label)])
                found.setdefault((table, label), {})[commit] = outcome
                prior = records[table].setdefault(label, {}).get(full) or {}
                if outcome != KEEPS and prior.get("outcome") == KEEPS:   # the changes it vouched for stay vouched
                    records[table][label][full] = {**prior, "failed_at": head, "failed": outcome}
                else:
                    records[table][label][full] = {"until": head, "outcome": outcome}
            for table in {t for t, *_ in mine}:  # written after each commit, so an interrupted run keeps its probes
                path_of(root, table).write_text(json.dumps(records[table], indent=1, sort_keys=True) + "\n")
        out: dict[str, dict[str, str]] = {}
        for (table, label), by_commit in found.items():
            outcomes = set(by_commit.values())
            out.setdefault(table, {})[label] = outcomes.pop() if len(outcomes) == 1 else "; ".join(
                f"rows at {c or 'no recorded commit'}: {o}" for c, o in sorted(by_commit.items()))
        return out
    finally:
        for checkout in work.iterdir():
            git(root, "worktree", "remove", "--force", str(checkout))
        shutil.rmtree(work, ignore_errors=True)
