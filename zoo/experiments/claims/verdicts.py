"""The verdict pipeline: every claim of ``claims.yaml`` bound to its table's cells and judged by its rule.

- every cell a rule reads needs at least :data:`MIN_SEEDS` seeds, else the verdict is "not tested (N seeds;
  needs 3)"; otherwise "reproduced" when every ``reproduced`` condition holds, "partly" when every ``partly``
  condition holds, else "not reproduced";
- the learned guard (:mod:`.guard`) checks seed by seed that every cell the verdict judges left its table's
  no-learning level (every table declares one); a condition that reads a cell with a seed at that level is
  inconclusive (every verdict condition is, for a cell the claim lists in ``learned`` that none of them reads),
  and so is a verdict that depends on it: "inconclusive (a judged seed did not learn)", or
  "partly (reproduced: inconclusive)" / "not reproduced (partly: inconclusive)" where the other kind decides;
  a cell in ``learned`` needs :data:`MIN_SEEDS` seeds like a cell the rule reads;
- a claim about a change (length, budget, size) must state it, and its rule must not hold in the base
  setting alone (:mod:`.changes`);
- ``exploration`` conditions (other cells or settings than the paper's) are evaluated and shown, never a
  verdict;
- every verdict condition is also evaluated on the untrained models of its cells (step 0), and a verdict the
  untrained models would already get is vacuous unless the claim accounts for it;
- pre-registration is read from git (:mod:`zoo.experiments.preregistration`): a verdict whose rule took its
  current form after any row of a cell it judges (present now or since replaced) is marked ", post hoc", and
  so is one whose claim discloses runs that informed the rule (``calibration``); one that reads cells whose
  code changed since their rows (:mod:`zoo.experiments.freshness`) is marked ", stale by code";
- a claim with ``pending: <why>`` (no table yet) is "not tested (<why>)"; a claim whose table has no rows yet
  (its ``awaiting_rows: <why>`` in ``tables``) is bound, checked and pre-registered like any other, and is
  "not tested (no rows yet: <why>)" until its rows come; a claim checked by a unit test says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mixers.options import nearest

from ..ablate import row_seed
from ..freshness import Staleness, cell_staleness
from ..preregistration import Registration, in_git_checkout, registration
from ..untrained import load as load_untrained
from ..vouch import load as load_vouches
from .cells import CellStats, recipe_cells, table_cells
from .changes import check_change, parse_change
from .conditions import ConditionResult, evaluate
from .errors import ClaimsError
from .guard import check_learning, guarded
from .schema import VERDICT_KINDS, Claim, bind_cells, check_spec, check_unit_test, parse_rule, vouched

#: seeds every cell a verdict reads must have
MIN_SEEDS = 3
#: the verdict when a judged seed did not learn and nothing else decides
INCONCLUSIVE = "inconclusive (a judged seed did not learn)"
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
            self.cells[table] = table_cells(self.root, table, self.specs[table].get("awaiting_rows"))
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
            _refuse_pending_with_rows(spec, where, tables)
            claim.verdict = f"not tested ({spec['pending']})"
        elif spec.get("unit_test"):
            check_unit_test(root, spec["unit_test"], where)
            # a unit test asserts what is measured here; where that differs from the paper's number, say so
            claim.verdict = UNIT_TEST_VERDICTS[bool(spec.get("unit_test_differs"))]
        else:
            _judge_by_table(claim, where, root, tables)
        out.append(claim)
    return out


def _refuse_pending_with_rows(spec: dict, where: str, tables: _Tables) -> None:
    """A pending claim (a rule written before its table runs) whose table now holds rows of a cell it names: the
    rule must judge them, not be silenced."""
    table = spec.get("table")
    if table not in tables.specs or not isinstance(spec.get("cells"), dict):
        return
    cells, _planned = tables.load(table)
    present = sorted(label for label in spec["cells"].values() if label in cells and cells[label].rows)
    if present:
        raise ClaimsError(f"{where}: pending ({spec['pending']}), but tables/{table} holds rows of its cells "
                          f"{present}; remove pending so that its rule judges them")


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
    claim.change = parse_change(claim.spec, claim.cells, where)
    check_change(claim, VERDICT_KINDS, where)
    claim.guarded = guarded(claim.spec, _condition_aliases(claim), claim.cells, where)
    claim.unlearned = check_learning(claim, spec.get("no_learning") or {}, where)
    try:  # a condition the cells cannot answer (per seed on other seeds, @all on other lengths)
        verdict = _judge(claim)
        _check_step0(claim, tables.untrained(table), where)
    except ClaimsError as err:
        raise ClaimsError(str(err) if str(err).startswith(where) else f"{where}: {err}") from None
    if spec.get("awaiting_rows") and not any(cell.rows for cell in claim.cells.values()):
        verdict = f"not tested (no rows yet: {' '.join(str(spec['awaiting_rows']).split())})"
    judged = _judged_aliases(claim)
    claim.registration = _disclosed(claim.spec, registration(
        root, claim.spec, [r for a in judged for r in claim.cells[a].rows], table,
        tuple(claim.cells[a].label for a in judged)))
    claim.stale = _stale_cells(root, claim, spec, where)
    flags = [flag for flag, on in (("post hoc", claim.registration.post_hoc), ("stale by code", claim.stale)) if on]
    claim.verdict = verdict if verdict.startswith("not tested") else ", ".join([verdict, *flags])


def _disclosed(spec: dict, found: Registration) -> Registration:
    """The registration, post hoc when the claim discloses runs made before its rule (``calibration``)."""
    runs = spec.get("calibration")
    if not runs:
        return found
    if not isinstance(runs, str):
        raise ClaimsError(f"claims.yaml: {spec['id']}: calibration must say in words which runs informed the rule")
    runs = " ".join(runs.split())
    if found.post_hoc or not found.checked:
        return Registration(found.checked, found.post_hoc, f"{found.text}; runs before the rule: {runs}")
    return Registration(True, True, f"post hoc: {found.text.removeprefix('pre-registered: ')}, but runs before "
                                    f"the rule informed it: {runs}")


def _mark(claim: Claim, conds, results: list[ConditionResult], verdict: bool = True) -> list[ConditionResult]:
    """The outcomes of ``conds``, inconclusive where a condition reads a cell with an unlearned seed; for the
    conditions of a ``verdict``, every one of them where a cell that must have learned (``learned``) but that no
    verdict condition reads did not: the verdict as a whole rests on that cell."""
    bad: dict[str, set[str]] = {}
    for u in claim.unlearned:
        bad.setdefault(u.alias, set()).add(str(u.seed))
    everywhere = [a for a in bad if a not in _condition_aliases(claim)] if verdict else []
    for cond, result in zip(conds, results):
        result.inconclusive = "; ".join(f"{a} seed{'s' * (len(bad[a]) > 1)} {', '.join(sorted(bad[a]))} did not "
                                        f"learn" for a in dict.fromkeys([*cond.aliases(), *everywhere]) if a in bad)
    return results


def _status(results: list[ConditionResult]) -> str:
    """``holds``, ``fails`` (a conclusive condition fails, or there is none) or ``inconclusive``."""
    if not results or any(not r.holds and not r.inconclusive for r in results):
        return "fails"
    return "inconclusive" if any(r.inconclusive for r in results) else "holds"


def _verdict(reproduced: str, partly: str) -> str:
    """The verdict from the status of the ``reproduced`` and ``partly`` conditions."""
    if reproduced == "holds":
        return "reproduced"
    if partly == "holds":
        return "partly" if reproduced == "fails" else "partly (reproduced: inconclusive)"
    if reproduced == "fails":
        return "not reproduced" if partly == "fails" else "not reproduced (partly: inconclusive)"
    return INCONCLUSIVE


def _judge(claim: Claim) -> str:
    """``claim.outcomes`` by the claim's rule, and the verdict they give."""
    read = min(claim.cells[a].n for a in _condition_aliases(claim))
    claim.outcomes = {kind: _mark(claim, conds, [evaluate(c, claim.cells) for c in conds], kind in VERDICT_KINDS)
                      if read else [] for kind, conds in claim.rule.items()}
    # a cell that must have learned counts like one the rule reads: with no rows, nothing shows that it learned
    fewest = min(claim.cells[a].n for a in _judged_aliases(claim))
    if fewest < MIN_SEEDS:
        return f"not tested ({fewest} seed{'s' * (fewest != 1)}; needs {MIN_SEEDS})"
    return _verdict(_status(claim.outcomes["reproduced"]), _status(claim.outcomes["partly"]))


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

    A verdict is not vacuous when one of its conditions reads a cell that must have learned (a guarded cell:
    untrained models then give "inconclusive"), or when the claim says why a condition is meant to hold at
    step 0 (``step0_ok: {<condition>: <why>}``)."""
    ok = claim.spec.get("step0_ok") or {}
    if not isinstance(ok, dict) or not all(isinstance(v, str) and v.strip() for v in ok.values()):
        raise ClaimsError(f"{where}: step0_ok must map a rule condition to why it may hold at step 0")
    cells = _step0_cells(claim, untrained)
    if claim.step0_missing:
        return
    for kind in VERDICT_KINDS:
        conds = [c for c in claim.rule[kind] if all(cells[a].rows for a in c.aliases())]
        outcomes = [evaluate(c, cells) for c in conds]
        claim.step0_holds += [f"{kind}: `{c.text}` ({o.detail})" for c, o in zip(conds, outcomes) if o.holds]
        accounted = any(set(c.aliases()) & set(claim.guarded) or c.text in ok for c in conds)
        if conds and len(conds) == len(claim.rule[kind]) and all(o.holds for o in outcomes) and not accounted:
            claim.vacuous.append(f"every {kind} condition holds at step 0")


def _condition_aliases(claim: Claim) -> set[str]:
    """The cells the ``reproduced`` / ``partly`` conditions read."""
    return {a for kind in VERDICT_KINDS for c in claim.rule[kind] for a in c.aliases()}


def _judged_aliases(claim: Claim) -> list[str]:
    """The cells a verdict rests on: those its conditions read and those that must have learned. Exploration
    cells are shown, never judged, so their rows neither make a verdict post hoc nor stale."""
    return sorted(_condition_aliases(claim) | set(claim.guarded))


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
