"""The verdict pipeline: every claim of ``claims.yaml`` bound to its table's cells and judged by its rule.

- every cell a rule reads needs at least :data:`MIN_SEEDS` seeds, else the verdict is "not tested (N seeds;
  needs 3)"; otherwise "reproduced" when every ``reproduced`` condition holds, "partly" when every ``partly``
  condition holds, else "not reproduced";
- a claim lists in ``learned`` the ``<cell>.<metric>`` terms that must have left the table's declared
  no-learning level (``no_learning`` of the table: chance, or the level of an answer that ignores the
  binding) by :data:`LEARNING_MARGIN`; when one has not, the verdict is "inconclusive (nothing learned)",
  whatever the rule says: a baseline that never learned its training task cannot be beaten;
- ``exploration`` conditions (other cells or settings than the paper's) are evaluated and shown, never a
  verdict;
- every verdict condition is also evaluated on the untrained models of its cells (step 0), and a verdict the
  untrained models would already get is vacuous unless the claim accounts for it;
- pre-registration is read from git (:mod:`zoo.experiments.preregistration`): a verdict whose rule took its
  current form after the code of any row it judges is marked ", post hoc"; one that reads cells whose code
  changed since their rows (:mod:`zoo.experiments.freshness`) is marked ", stale by code";
- a claim with ``pending: <why>`` (no table yet) is "not tested (<why>)"; a claim checked by a unit test
  says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mixers.options import nearest

from ..ablate import row_seed
from ..freshness import Staleness, cell_staleness
from ..preregistration import in_git_checkout, registration
from ..untrained import load as load_untrained
from ..vouch import load as load_vouches
from .cells import CellStats, num, recipe_cells, table_cells
from .conditions import evaluate, parse_term
from .errors import ClaimsError
from .schema import VERDICT_KINDS, Claim, bind_cells, check_spec, check_unit_test, parse_rule, vouched

#: seeds every cell a verdict reads must have
MIN_SEEDS = 3
#: a cell has learned its training task when its mean is above the table's no-learning level by this much
LEARNING_MARGIN = 0.05
#: the verdict of a claim checked by a unit test, by whether the test measures another number than the paper's
UNIT_TEST_VERDICTS = {False: "exact property: checked by a unit test, not by a table",
                      True: "partly: checked by a unit test that measures another number than the paper's"}


@dataclass
class _Tables:
    """What the claims read of each table, loaded once: its cells, the labels its recipe plans, its step 0."""
    root: Path
    specs: dict
    cells: dict[str, dict[str, CellStats]] = field(default_factory=dict)
    planned: dict[str, set[str]] = field(default_factory=dict)
    step0: dict[str, dict] = field(default_factory=dict)

    def load(self, table: str) -> tuple[dict[str, CellStats], set[str]]:
        if table not in self.cells:
            self.cells[table] = table_cells(self.root, table)
            self.planned[table] = {c.label for c in recipe_cells(self.root, self.specs[table]["recipe"])}
        return self.cells[table], self.planned[table]

    def untrained(self, table: str) -> dict:
        if table not in self.step0:
            self.step0[table] = load_untrained(self.root, table)
        return self.step0[table]


def evaluate_claims(data: dict, root: Path) -> list[Claim]:
    """Every claim of ``data`` (claims.yaml), checked and judged, in order."""
    papers, tables = data.get("papers") or {}, _Tables(root, data.get("tables") or {})
    out, ids = [], set()
    for i, spec in enumerate(data["claims"]):
        where = f"claims.yaml: claims.{i}" + (f" ({spec.get('id')})" if isinstance(spec, dict) and spec.get("id") else "")
        check_spec(spec, where, papers, ids)
        claim = Claim(spec)
        if spec.get("pending"):
            claim.verdict = f"not tested ({spec['pending']})"
        elif spec.get("unit_test"):
            check_unit_test(root, spec["unit_test"], where)
            # a unit test asserts what is measured here; where that differs from the paper's number, say so
            claim.verdict = UNIT_TEST_VERDICTS[bool(spec.get("unit_test_differs"))]
        else:
            _judge_by_table(claim, where, root, tables)
        out.append(claim)
    return out


def _judge_by_table(claim: Claim, where: str, root: Path, tables: _Tables) -> None:
    """Bind the claim to its table's cells, judge it by its rule, and qualify the verdict (step 0, post hoc,
    stale by code)."""
    table = claim.spec.get("table")
    if table not in tables.specs:
        raise ClaimsError(f"{where}: table {table!r} is not listed under tables{nearest(table, tables.specs)} "
                          f"(tables: {', '.join(tables.specs)})")
    spec = tables.specs[table]
    bind_cells(claim, where, table, spec["recipe"], *tables.load(table))
    parse_rule(claim, where)
    claim.unlearned = _unlearned(claim, spec, where)
    verdict = _judge(claim)
    _check_step0(claim, tables.untrained(table), where)
    claim.registration = registration(root, claim.spec, [r for a in _judged_aliases(claim) for r in claim.cells[a].rows])
    claim.stale = _stale_cells(root, claim, spec, where)
    flags = [flag for flag, on in (("post hoc", claim.registration.post_hoc), ("stale by code", claim.stale)) if on]
    claim.verdict = verdict if verdict.startswith("not tested") else ", ".join([verdict, *flags])


def _unlearned(claim: Claim, table_spec: dict, where: str) -> list[str]:
    """The claim's ``learned`` terms whose cell mean is not above its table's no-learning level by the margin.

    A table declares ``no_learning: {<cell label or '*'>: {<metric>: level}}`` (chance, or the level of an
    answer that ignores the binding); a claim lists in ``learned`` the ``<cell>.<metric>`` terms that must have
    risen above it for its comparison to mean anything (a baseline that never learned its training task
    cannot be beaten)."""
    levels = table_spec.get("no_learning") or {}
    out = []
    for text in claim.spec.get("learned") or []:
        term = parse_term(text, f"{where}: learned")
        if term.alias not in claim.cells:
            raise ClaimsError(f"{where}: learned names cell {term.alias!r}, which is not in cells")
        cell = claim.cells[term.alias]
        level = (levels.get(cell.label) or levels.get("*") or {}).get(term.metric)
        if level is None:
            raise ClaimsError(f"{where}: learned {text!r}: table {cell.table} declares no no_learning level of "
                              f"{term.metric} for cell {cell.label!r} (or '*')")
        if cell.rows and not cell.mean(term.metric) > level + LEARNING_MARGIN:
            out.append(f"{text} = {num(cell.mean(term.metric))} <= {num(level)} + {LEARNING_MARGIN}")
    return out


def _judge(claim: Claim) -> str:
    """``claim.outcomes`` by the claim's rule, and the verdict they give."""
    fewest = min(claim.cells[a].n for a in _condition_aliases(claim))
    claim.outcomes = {kind: [evaluate(c, claim.cells) for c in conds] if fewest else []
                      for kind, conds in claim.rule.items()}
    if fewest < MIN_SEEDS:
        return f"not tested ({fewest} seed{'s' * (fewest != 1)}; needs {MIN_SEEDS})"
    if claim.unlearned:
        return "inconclusive (nothing learned)"
    if all(o.holds for o in claim.outcomes["reproduced"]):
        return "reproduced"
    if claim.outcomes["partly"] and all(o.holds for o in claim.outcomes["partly"]):
        return "partly"
    return "not reproduced"


def _step0_cells(claim: Claim, untrained: dict[str, dict[int, dict]]) -> dict[str, CellStats]:
    """The claim's cells as their untrained models score them; ``claim.step0_missing``: the cells with rows
    whose seeds have no step-0 evaluation."""
    cells, missing = {}, set()
    for alias, cell in claim.cells.items():
        seeds = untrained.get(cell.label, {})
        rows = [{"seed": s, "metrics": m, "recipe": {"seed": s}} for s, m in sorted(seeds.items())]
        if cell.rows and {row_seed(r) for r in cell.rows} - set(seeds):
            missing.add(cell.label)
        cells[alias] = CellStats(cell.table, cell.label, rows)
    claim.step0_missing = sorted(missing)
    return cells


def _check_step0(claim: Claim, untrained: dict[str, dict[int, dict]], where: str) -> None:
    """``claim.step0_holds``: the verdict conditions that already hold on the untrained models of their cells;
    ``claim.vacuous``: the verdicts (reproduced, partly) that the untrained models would already get.

    A verdict is not vacuous when one of its conditions reads a cell that must have learned (the claim's
    ``learned``: untrained models then give "inconclusive"), or when the claim says why a condition is meant
    to hold at step 0 (``step0_ok: {<condition>: <why>}``)."""
    ok = claim.spec.get("step0_ok") or {}
    if not isinstance(ok, dict) or not all(isinstance(v, str) and v.strip() for v in ok.values()):
        raise ClaimsError(f"{where}: step0_ok must map a rule condition to why it may hold at step 0")
    guarded = {parse_term(t, f"{where}: learned").alias for t in claim.spec.get("learned") or []}
    cells = _step0_cells(claim, untrained)
    if claim.step0_missing:
        return
    for kind in VERDICT_KINDS:
        conds = [c for c in claim.rule[kind] if all(cells[a].rows for a in c.aliases())]
        outcomes = [evaluate(c, cells) for c in conds]
        claim.step0_holds += [f"{kind}: `{c.text}` ({o.detail})" for c, o in zip(conds, outcomes) if o.holds]
        accounted = any(set(c.aliases()) & guarded or c.text in ok for c in conds)
        if conds and len(conds) == len(claim.rule[kind]) and all(o.holds for o in outcomes) and not accounted:
            claim.vacuous.append(f"every {kind} condition holds at step 0")


def _condition_aliases(claim: Claim) -> set[str]:
    """The cells the ``reproduced`` / ``partly`` conditions read."""
    return {a for kind in VERDICT_KINDS for c in claim.rule[kind] for a in c.aliases()}


def _judged_aliases(claim: Claim) -> list[str]:
    """The cells a verdict rests on: those its conditions read and those that must have learned. Exploration
    cells are shown, never judged, so their rows neither make a verdict post hoc nor stale."""
    learned = {parse_term(t, "learned").alias for t in claim.spec.get("learned") or []}
    return sorted(_condition_aliases(claim) | learned)


def _stale_cells(root: Path, claim: Claim, table_spec: dict, where: str) -> list[Staleness]:
    """The cells the verdict reads whose code changed since their rows, in a change the table does not vouch for."""
    if not in_git_checkout(root):
        return []
    changes = vouched(table_spec, where)
    probed = load_vouches(root, claim.spec["table"])
    out = []
    for alias in _judged_aliases(claim):
        cell = claim.cells[alias]
        if cell.rows:
            found = cell_staleness(root, cell.label, cell.rows, changes, probed)
            if found.stale:
                out.append(found)
    return out
