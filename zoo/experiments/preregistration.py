"""Pre-registration, checked from git: was a claim's rule committed before any row of the cells it judges?

A claim's rule "takes its current form" in the oldest commit from which ``claims.yaml`` gives the claim the
same rule and the same cells up to now (later edits elsewhere in the file do not count). Every results row
records the commit its code was at (``versions.git``). A row *predates* the rule when the rule's commit is not
an ancestor of (or equal to) the row's commit, or when the row was in the table's ``results.jsonl`` in a
commit that does not descend from the rule's commit. Rows are read from the whole git history of the file,
not only from the rows present now: a cell re-run after its rule was written still had numbers before it, and
the rule could have been chosen knowing them. A verdict that judges a cell with such a row is marked
**post hoc**. A rule not committed yet, a row without a recorded commit or with a commit unknown to this
history cannot show pre-registration either. A rule whose cells have no row yet, now or in the table's history,
is not post hoc, committed or not (the ledger regenerated and committed with the rule reads the same before and
after that commit); its rows will show whether it was committed first. Outside a git checkout nothing can be
checked, and the ledger says so.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

from .results import cell_of

#: the claims.yaml fields whose change gives a rule a new form (what must have learned or may fail to, the change a
#: claim states and which step-0 outcomes are accepted decide a verdict as much as the conditions do)
RULE_FIELDS = ("rule", "cells", "learned", "unguarded", "change", "step0_ok")


def git(root: Path, *args: str) -> str | None:
    """The output of ``git -C root args``, or None when git fails or is missing."""
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def shallow_clone(root: Path) -> bool:
    """Whether ``root`` is a shallow clone (``git clone --depth``), whose history stops short."""
    return (git(root, "rev-parse", "--is-shallow-repository") or "").strip() == "true"


def in_git_checkout(root: Path) -> bool:
    return (git(root, "rev-parse", "--is-inside-work-tree") or "").strip() == "true"


def rule_form(spec: dict) -> str:
    return json.dumps({k: spec.get(k) for k in RULE_FIELDS}, sort_keys=True, default=str)


def head(root: Path) -> str:
    """The checkout's HEAD commit ('' without one): the key of the caches of history below."""
    return (git(root, "rev-parse", "HEAD") or "").strip()


def _forms(text: str | None) -> dict[str, str] | None:
    """``{claim id: rule form}`` of a claims.yaml text; None when it is not YAML (a commit with conflict markers)."""
    try:
        data = yaml.safe_load(text or "") or {}
    except yaml.YAMLError:
        return None
    claims = data.get("claims") if isinstance(data, dict) else None
    return {c["id"]: rule_form(c) for c in claims if isinstance(c, dict) and c.get("id")} \
        if isinstance(claims, list) else {}


@lru_cache(maxsize=8)
def _history(root: str, at: str) -> tuple[tuple[str, dict], ...]:
    """``(commit, {claim id: rule form})`` for every commit that changed claims.yaml up to ``at``, newest
    first. A commit whose claims.yaml is not YAML (a merge's conflict markers, which hold two versions of a rule)
    gives no claim a rule: a rule takes its form after it, never across it."""
    log = git(Path(root), "log", "--format=%H", at, "--", "claims.yaml") or ""
    return tuple((commit, _forms(git(Path(root), "show", f"{commit}:claims.yaml")) or {}) for commit in log.split())


def rule_commit(root: Path, spec: dict) -> str | None:
    """The commit where the claim's rule took its current form; None when the current form is not committed
    (HEAD's claims.yaml, even one that is not YAML or not a mapping, does not give the claim this form)."""
    form = rule_form(spec)
    history = _history(str(root), head(root))
    committed = git(root, "show", "HEAD:claims.yaml")
    if not history or committed is None:
        return None
    if (_forms(committed) or {}).get(spec["id"]) != form:
        return None  # edited since the last commit
    found = None
    for commit, forms in history:
        if forms.get(spec["id"]) != form:
            break
        found = commit
    return found


@lru_cache(maxsize=4096)
def _is_ancestor(root: str, ancestor: str, commit: str) -> bool | None:
    """True/False, or None when either commit is unknown here."""
    full = git(Path(root), "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    if full is None:
        return None
    try:
        done = subprocess.run(["git", "-C", root, "merge-base", "--is-ancestor", ancestor, full.strip()],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: True, 1: False}.get(done.returncode)


@dataclass(frozen=True)
class PastRow:
    """A row that ``tables/<table>/results.jsonl`` held in some commit: its cell, its code commit, the commit."""
    cell: str
    code: str
    commit: str


@lru_cache(maxsize=64)
def table_history(root: str, table: str, at: str) -> tuple[PastRow, ...]:
    """Every row of ``tables/<table>/results.jsonl`` in every commit up to ``at`` that changed the file (once
    per commit)."""
    rel = f"tables/{table}/results.jsonl"
    out = []
    for commit in (git(Path(root), "log", "--format=%H", at, "--", rel) or "").split():
        for line in (git(Path(root), "show", f"{commit}:{rel}") or "").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "label" in row:
                out.append(PastRow(cell_of(str(row["label"])), (row.get("versions") or {}).get("git") or "", commit))
    return tuple(out)


def _after(root: Path, rule: str, commit: str) -> bool:
    return _is_ancestor(str(root), rule, commit) is True


def _early_past_rows(root: Path, rule: str, table: str, cells: set[str]) -> list[PastRow]:
    """The rows of ``cells`` in the history of the table that predate the rule's commit."""
    return [r for r in table_history(str(root), table, head(root)) if r.cell in cells
            and (not r.code or not _after(root, rule, r.code) or not _after(root, rule, r.commit))]


#: the registration of a rule whose cells have no row, now or in the table's history: nothing can have informed
#: it, and the text does not name the rule's commit, so that a ledger committed with its rule is not stale there
NO_ROW_YET = "no row yet (a rule committed before its cells run is pre-registered)"


@dataclass
class Registration:
    """Whether a claim's rule was committed before every row it judges."""
    checked: bool
    post_hoc: bool
    text: str


def _past_text(rows: list[PastRow]) -> str:
    """``cell (in the table at <commits>)`` for each cell of ``rows``."""
    by_cell: dict[str, set[str]] = {}
    for r in rows:
        by_cell.setdefault(r.cell, set()).add(r.commit[:7])
    return "; ".join(f"{cell!r} (in the table at {', '.join(sorted(c))})" for cell, c in sorted(by_cell.items()))


def registration(root: Path, spec: dict, rows: list[dict], table: str | None = None,
                 labels: tuple[str, ...] = ()) -> Registration:
    """Whether the claim's rule (``spec``) was committed before every row of the cells it judges: ``rows``
    (those present now) and, when ``table`` is given, every row that the table's history holds of the cells
    ``labels`` (default: the cells of ``rows``)."""
    if not in_git_checkout(root):
        return Registration(False, False, "not checked: not a git checkout")
    cells = {cell_of(str(label)) for label in labels} or {cell_of(str(r.get("label", ""))) for r in rows}
    if not rows and not (table and any(r.cell in cells for r in table_history(str(root), table, head(root)))):
        return Registration(True, False, NO_ROW_YET)  # the same before and after the commit of the rule
    commit = rule_commit(root, spec)
    if commit is None:
        return Registration(True, True, "post hoc: the rule's current form is not committed")
    row_commits = sorted({(r.get("versions") or {}).get("git") or "" for r in rows})
    after = {c: _is_ancestor(str(root), commit, c) if c else None for c in row_commits}
    early = [c for c, known in after.items() if known is False]
    unknown = [c or "unrecorded" for c, known in after.items() if known is None]
    if early or unknown:
        why = [f"after the code of rows computed at {', '.join(early)}"] if early else []
        if unknown:  # not known to be earlier, but a row of an unknown or unrecorded commit cannot show it is later
            why.append(f"rows computed at {', '.join(unknown)} (a commit this history does not have, or none "
                       f"recorded) cannot show they came after it")
            if shallow_clone(root):
                why.append("this is a shallow clone, whose history stops short: git fetch --unshallow reads all of it")
        return Registration(True, True, f"post hoc: rule committed in {commit[:7]}, {'; '.join(why)}")
    past = _early_past_rows(root, commit, table, cells) if table else []
    if past:
        return Registration(True, True, f"post hoc: rule committed in {commit[:7]}; before it the table already "
                                        f"held rows of cells it judges (since replaced or not): {_past_text(past)}")
    if not row_commits:  # rows of its cells came and went after the rule
        return Registration(True, False, f"pre-registered: rule committed in {commit[:7]}; no row yet")
    return Registration(True, False, f"pre-registered: rule committed in {commit[:7]}, before every row it judges "
                                     f"({', '.join(row_commits)})")
