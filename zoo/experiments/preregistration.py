"""Pre-registration, checked from git: was a claim's rule committed before the rows it judges were computed?

A claim's rule "takes its current form" in the oldest commit from which ``claims.yaml`` gives the claim the
same rule and the same cells up to now (later edits elsewhere in the file do not count). Every results row
records the commit its code was at (``versions.git``). A row *predates* the rule when the rule's commit is not
an ancestor of (or equal to) the row's commit: the numbers existed before the rule that judges them, so the
rule could have been chosen knowing them, and the verdict is marked **post hoc**. A rule not committed yet, a
row without a recorded commit or with a commit unknown to this history cannot show pre-registration either.
Outside a git checkout nothing can be checked, and the ledger says so.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

#: the claims.yaml fields whose change gives a rule a new form (what must have learned, and which step-0
#: outcomes are accepted, decide a verdict as much as the conditions do)
RULE_FIELDS = ("rule", "cells", "learned", "step0_ok")


def git(root: Path, *args: str) -> str | None:
    """The output of ``git -C root args``, or None when git fails or is missing."""
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def in_git_checkout(root: Path) -> bool:
    return (git(root, "rev-parse", "--is-inside-work-tree") or "").strip() == "true"


def rule_form(spec: dict) -> str:
    return json.dumps({k: spec.get(k) for k in RULE_FIELDS}, sort_keys=True, default=str)


@lru_cache(maxsize=8)
def _history(root: str) -> tuple[tuple[str, dict], ...]:
    """``(commit, {claim id: rule form})`` for every commit that changed claims.yaml, newest first."""
    log = git(Path(root), "log", "--format=%H", "--", "claims.yaml") or ""
    out = []
    for commit in log.split():
        text = git(Path(root), "show", f"{commit}:claims.yaml")
        try:
            data = yaml.safe_load(text or "") or {}
        except yaml.YAMLError:
            continue
        claims = data.get("claims") if isinstance(data, dict) else None
        forms = {c["id"]: rule_form(c) for c in claims or [] if isinstance(c, dict) and c.get("id")}
        out.append((commit, forms))
    return tuple(out)


def rule_commit(root: Path, spec: dict) -> str | None:
    """The commit where the claim's rule took its current form; None when the current form is not committed."""
    form = rule_form(spec)
    history = _history(str(root))
    committed = git(root, "show", "HEAD:claims.yaml")
    if not history or committed is None:
        return None
    head_claims = (yaml.safe_load(committed) or {}).get("claims") or []
    if form not in {rule_form(c) for c in head_claims if isinstance(c, dict) and c.get("id") == spec["id"]}:
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


@dataclass
class Registration:
    """Whether a claim's rule was committed before every row it judges."""
    checked: bool
    post_hoc: bool
    text: str


def registration(root: Path, spec: dict, rows: list[dict]) -> Registration:
    if not in_git_checkout(root):
        return Registration(False, False, "not checked: not a git checkout")
    commit = rule_commit(root, spec)
    if commit is None:
        return Registration(True, True, "post hoc: the rule's current form is not committed")
    row_commits = sorted({(r.get("versions") or {}).get("git") or "" for r in rows})
    early = [c or "unrecorded" for c in row_commits if not c or _is_ancestor(str(root), commit, c) is not True]
    if early:
        return Registration(True, True, f"post hoc: rule committed in {commit[:7]}, after the code of rows "
                                        f"computed at {', '.join(early)}")
    if not row_commits:
        return Registration(True, False, f"pre-registered: rule committed in {commit[:7]}; no row yet")
    return Registration(True, False, f"pre-registered: rule committed in {commit[:7]}, before every row it judges "
                                     f"({', '.join(row_commits)})")
