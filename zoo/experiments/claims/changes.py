"""Claims about a change (length, budget, size): the rule must state the change, and must not hold without it.

A claim whose point is what happens between two settings (a test length far beyond the training length, a
larger budget, a larger model or memory) declares ``change: {kind: length | budget | size, base: {...}}``.
Two checks refuse a rule that could pass with no change at all:

- each verdict kind (``reproduced``, ``partly``) must have a condition that **states the change**: for
  ``length``, a cell at a test length against the same cell at the training length (``per seed:
  attn.test_accuracy@4096 <= attn.test_accuracy - 0.2``: every seed of attn falls by 0.2); for ``budget`` and
  ``size``, a cell against its base (``base: {m64: m16}``: the cell of the larger setting -> the cell of the
  smaller one; a key starting with ``@`` maps a metric's setting, ``{"@num_iter=30": "@num_iter=0"}``);
- the **base reading** of each verdict kind (every metric read at the training length for ``length``; every
  cell and setting replaced by its base for ``budget`` and ``size``) must not hold on the committed rows: a
  rule that holds there would pass on the rows of the base setting alone.
"""
from __future__ import annotations

import re
from dataclasses import replace

from .conditions import Condition, Term, evaluate
from .errors import ClaimsError

KINDS = ("length", "budget", "size")
#: the base reading of a length claim: the training length
_AT_LENGTH = re.compile(r"@(\d+|all)$")
BASE_WORDS = {"length": "the training length", "budget": "the base budget", "size": "the base size"}


def parse_change(spec: dict, aliases, where: str) -> dict | None:
    """The claim's ``change``, checked, or None."""
    change = spec.get("change")
    if change is None:
        return None
    if not isinstance(change, dict) or change.get("kind") not in KINDS:
        raise ClaimsError(f"{where}: change must be {{kind: {' | '.join(KINDS)}, base: ...}} (the change the claim is "
                          f"about), got {change!r}")
    base = change.get("base") or {}
    if change["kind"] != "length" and not base:
        raise ClaimsError(f"{where}: change.base must map each cell of the larger {change['kind']} to the cell of the "
                          f"smaller one (or a metric setting '@x' to its base '@y')")
    if not isinstance(base, dict):
        raise ClaimsError(f"{where}: change.base must be a mapping")
    for key, value in base.items():
        if not str(key).startswith("@") and (key not in aliases or value not in aliases):
            raise ClaimsError(f"{where}: change.base {key!r}: {value!r} must map a cell of the claim to another")
    return change


def _base_metric(metric: str, change: dict) -> str:
    if change["kind"] == "length":
        return _AT_LENGTH.sub("", metric)
    for key, value in (change.get("base") or {}).items():
        if str(key).startswith("@") and metric.endswith(str(key)):
            return metric[:-len(str(key))] + str(value)
    return metric


def base_term(term: Term, change: dict) -> Term:
    """``term`` read in the base setting."""
    if term.alias is None:
        return term
    alias = (change.get("base") or {}).get(term.alias, term.alias) if change["kind"] != "length" else term.alias
    return replace(term, alias=alias, metric=_base_metric(term.metric, change))


def base_condition(cond: Condition, change: dict) -> Condition:
    return replace(cond, text=f"{cond.text} (base reading)", left=base_term(cond.left, change),
                   right=base_term(cond.right, change))


def states_change(cond: Condition, change: dict) -> bool:
    """Whether ``cond`` compares a cell in the changed setting with the same quantity in the base setting."""
    sides = [t for t in (cond.left, cond.right) if t.alias is not None]
    if len(sides) != 2:
        return False
    a, b = sides
    return any((x.alias, x.metric) != (y.alias, y.metric) and (base_term(x, change).alias, base_term(x, change).metric)
               == (y.alias, y.metric) for x, y in ((a, b), (b, a)))


def check_change(claim, kinds, where: str) -> None:
    """Refuse a rule of a change claim that does not state the change, or that holds in the base setting."""
    change = claim.change
    if change is None:
        return
    for kind in kinds:
        conds = claim.rule.get(kind) or []
        if not conds:
            continue
        if not any(states_change(c, change) for c in conds):
            example = ("per seed: <cell>.test_accuracy@<test length> <= <cell>.test_accuracy - <margin>"
                       if change["kind"] == "length" else "<cell>.<metric> >= <base cell>.<metric> + <margin>")
            raise ClaimsError(f"{where}: the claim is about a change of {change['kind']}, but rule.{kind} states no "
                              f"change (no condition compares a cell with itself at {BASE_WORDS[change['kind']]}); "
                              f"add one, e.g. '{example}'")
        based = [base_condition(c, change) for c in conds]
        if not all(claim.cells[a].rows for c in based for a in c.aliases()):
            continue
        try:
            outcomes = [evaluate(c, claim.cells) for c in based]
        except ClaimsError:
            continue  # the base setting lacks a metric: the rule cannot hold there
        if all(o.holds for o in outcomes):
            shown = "; ".join(f"`{c.text}`: {o.detail}" for c, o in zip(based, outcomes))
            raise ClaimsError(f"{where}: rule.{kind} holds on the rows at {BASE_WORDS[change['kind']]} alone "
                              f"({shown}), so it would pass with no change of {change['kind']}; state the change "
                              f"the claim makes, with a margin that the base setting fails")
