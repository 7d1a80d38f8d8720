"""The ledger's schema: ``claims.yaml`` read and checked, and a claim bound to the cells and rule it names.

``claims.yaml`` (repository root) holds the ledger's definition as data: the papers (title and id), the tables
(the recipe that produces each, its no-learning levels, which every table must declare, the code changes it
vouches for) and, for every claim,
the paper, the claim in one line, the paper's number and setting, the table and the cells of it that test the
claim (short name -> cell label), the rule (:mod:`.conditions`) that turns their numbers into a verdict, and a
paragraph on any discrepancy. A claim with ``pending: <why>`` has no table yet; a claim that is an exact
property rather than a training result names the unit test that checks it (``unit_test``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mixers.options import nearest

from ..freshness import Staleness
from ..preregistration import Registration
from ..results import cell_of
from .cells import CellStats
from .conditions import Condition, ConditionResult, Term, check_fraction, expand, parse_term
from .errors import ClaimsError

#: a rule's lists of conditions: the two that bear the verdict, and exploration (other cells or settings than
#: the paper's, evaluated and shown, never a verdict)
RULE_KINDS = ("reproduced", "partly", "exploration")
VERDICT_KINDS = ("reproduced", "partly")
REQUIRED = ("id", "paper", "claim", "paper_result")
#: claims.yaml fields of a claim beyond REQUIRED (a misspelt field is refused rather than ignored)
OPTIONAL = ("quote", "section", "source", "setting", "table", "cells", "show", "rule", "learned", "unguarded",
            "change", "step0_ok", "discrepancy", "pending", "unit_test", "unit_test_differs", "budget_needed",
            "calibration")


@dataclass
class Claim:
    spec: dict
    cells: dict[str, CellStats] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    rule: dict[str, list[Condition]] = field(default_factory=dict)
    outcomes: dict[str, list[ConditionResult]] = field(default_factory=dict)
    verdict: str = ""
    registration: Registration | None = None
    change: dict | None = None  # the change the claim is about (changes.py), or None
    guarded: dict[str, list[str]] = field(default_factory=dict)  # cells the learned guard checks -> metrics
    unlearned: list = field(default_factory=list)  # guard.Unlearned: the judged seeds at their no-learning level
    stale: list[Staleness] = field(default_factory=list)  # verdict cells whose code changed since their rows
    step0_holds: list[str] = field(default_factory=list)  # verdict conditions that hold on the untrained models
    vacuous: list[str] = field(default_factory=list)  # verdicts the untrained models would get
    step0_missing: list[str] = field(default_factory=list)  # verdict cells with no step-0 evaluation


def load(root: Path) -> dict:
    path = root / "claims.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ClaimsError(f"{path}: no such file (the ledger's definition)") from None
    except yaml.YAMLError as err:
        raise ClaimsError(f"{path}: YAML error: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("claims"), list):
        raise ClaimsError(f"{path}: expected a mapping with papers, tables and a list of claims")
    return data


def _check_levels(name: str, levels) -> None:
    """A table's ``no_learning``: ``{<cell label or '*'>: {<metric>: level}}``, at least one level."""
    ok = isinstance(levels, dict) and levels and all(
        isinstance(v, dict) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v.values())
        for v in levels.values())
    if not ok:
        raise ClaimsError(f"claims.yaml: tables.{name}: declare no_learning: {{<cell label or '*'>: {{<metric>: "
                          f"level}}}}, the score of a model that learned nothing (chance, or an answer that "
                          f"ignores the binding); every table needs one, so that every verdict can check per seed "
                          f"that its cells learned")
    for label, metrics in levels.items():
        for metric, level in metrics.items():
            check_fraction(metric, float(level), f"claims.yaml: tables.{name}.no_learning.{label}", "level")


def check_tables(data: dict) -> None:
    """The papers and tables sections: mappings, every table with its recipe, its no-learning levels, a
    valid ``ray_workers`` and, for a table not run yet, why (``awaiting_rows``)."""
    for key in ("papers", "tables"):
        if not isinstance(data.get(key), dict):
            raise ClaimsError(f"claims.yaml: {key} must be a mapping")
    for name, spec in data["tables"].items():
        if not isinstance(spec, dict) or not spec.get("recipe"):
            raise ClaimsError(f"claims.yaml: tables.{name}: give the recipe that produces the table")
        _check_levels(name, spec.get("no_learning"))
        awaiting = spec.get("awaiting_rows")
        if awaiting is not None and not (isinstance(awaiting, str) and awaiting.strip()):
            raise ClaimsError(f"claims.yaml: tables.{name}.awaiting_rows: say in words why the table has no rows "
                              f"yet (e.g. what it needs to run), or remove it")
        workers = spec.get("ray_workers")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ClaimsError(f"claims.yaml: tables.{name}.ray_workers: expected a whole number of workers >= 1 "
                              f"(the runs --executor ray puts side by side), got {workers!r}")


def command(data: dict, table: str) -> str:
    """The command that produces ``tables/<table>``."""
    spec = data["tables"][table]
    ray = " --executor ray" if spec.get("ray_workers") else ""
    return f"zoo ablate {spec['recipe']} --out tables/{table} --no-progress{ray}"


def check_spec(spec, where: str, papers: dict, ids: set) -> None:
    """The fields every claim has: a mapping with an unused id and a known paper."""
    if not isinstance(spec, dict):
        raise ClaimsError(f"{where}: a claim is a mapping (id, paper, claim, paper_result, ...)")
    for key in REQUIRED:
        if not spec.get(key):
            raise ClaimsError(f"{where}: missing {key!r}")
    unknown = sorted(set(spec) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ClaimsError(f"{where}: unknown field {unknown[0]!r}{nearest(unknown[0], REQUIRED + OPTIONAL)}")
    if spec["id"] in ids:
        raise ClaimsError(f"{where}: the id {spec['id']!r} is used twice")
    ids.add(spec["id"])
    if spec["paper"] not in papers or not {"title", "id"} <= set(papers[spec["paper"]] or {}):
        raise ClaimsError(f"{where}: unknown paper {spec['paper']!r}{nearest(spec['paper'], papers)} "
                          f"(papers, each with a title and an id: {', '.join(papers)})")
    _check_quote(spec, where)


def _check_quote(spec: dict, where: str) -> None:
    """What ``paper_result`` rests on: the paper's exact sentence or table cell (``quote``) and where it is
    (``section``), or, for a number or sentence that is not in the paper, ``source`` saying where it is from."""
    if bool(spec.get("quote")) != bool(spec.get("section")):
        raise ClaimsError(f"{where}: give quote (the paper's exact sentence or table cell) and section (where it "
                          f"is) together")
    if not spec.get("quote") and not spec.get("source"):
        raise ClaimsError(f"{where}: give the exact sentence or table cell of the paper that paper_result rests on "
                          f"(quote) and its section, or, when the number or sentence is not in the paper, say "
                          f"where it comes from (source)")


def check_unit_test(root: Path, ref: str, where: str) -> None:
    """``unit_test``: ``path/to/test_x.py::test_name`` names a test function of that file."""
    path, _, name = str(ref).partition("::")
    file = root / path
    if not file.is_file() or not name or not re.search(rf"^def {re.escape(name)}\(", file.read_text(), re.M):
        raise ClaimsError(f"{where}: unit_test {ref!r} names no test function (write path/to/test_x.py::test_name)")


def bind_cells(claim: Claim, where: str, table: str, recipe_path: str, present: dict, planned: set) -> None:
    """``claim.cells``: each alias's cell of the table (an empty one for a cell not run yet)."""
    spec = claim.spec
    if not isinstance(spec.get("cells"), dict) or not spec["cells"]:
        raise ClaimsError(f"{where}: cells must map short names to cell labels of tables/{table}")
    for alias, label in spec["cells"].items():
        label = cell_of(str(label))
        if label in present:
            claim.cells[alias] = present[label]
        elif label in planned:  # in the recipe, not run yet
            claim.cells[alias] = CellStats(table, label, [])
        else:
            known = sorted(set(present) | planned)
            raise ClaimsError(f"{where}: cells.{alias}: no cell {label!r} in tables/{table}/results.jsonl or in "
                              f"{recipe_path}{nearest(label, known)}")
        claim.labels[alias] = label


def _parse_conditions(claim: Claim, rule: dict, where: str) -> None:
    """``claim.rule``: the parsed conditions of each kind, every named cell checked."""
    for kind in RULE_KINDS:
        conds = rule.get(kind) or []
        if not isinstance(conds, list):
            raise ClaimsError(f"{where}: rule.{kind} must be a list of conditions ([<cell>.<metric> <op> ...]), got "
                              f"{conds!r}")
        claim.rule[kind] = [Condition.parse(c, f"{where}: rule.{kind}.{j}") for j, c in enumerate(conds)]
        for c in claim.rule[kind]:
            for alias in c.aliases():
                if alias not in claim.cells:
                    raise ClaimsError(f"{where}: rule condition {c.text!r} names cell {alias!r}, which is not "
                                      f"in cells{nearest(alias, claim.cells)} ({', '.join(claim.cells)})")


def parse_rule(claim: Claim, where: str) -> None:
    """``claim.rule``: the parsed conditions of each verdict, every named cell and metric checked."""
    rule = claim.spec.get("rule")
    if not isinstance(rule, dict) or not rule.get("reproduced"):
        raise ClaimsError(f"{where}: rule.reproduced must list the conditions of a reproduced claim")
    unknown = set(rule) - set(RULE_KINDS)
    if unknown:
        raise ClaimsError(f"{where}: rule has unknown keys {sorted(unknown)}; use {', '.join(RULE_KINDS)}")
    _parse_conditions(claim, rule, where)
    for j, name in enumerate(claim.spec.get("show") or []):
        term = parse_term(name, f"{where}: show")
        if term.alias not in claim.cells:
            raise ClaimsError(f"{where}: show names cell {term.alias!r}, which is not in cells")
        if term.offset:
            raise ClaimsError(f"{where}: show.{j}: {name!r} adds an offset; show lists <cell>.<metric> terms as "
                              f"measured")
        _check_metric(claim, term, f"{where}: show.{j}")
    for kind, conds in claim.rule.items():  # every metric a rule names must exist (checked below 3 seeds too)
        for j, c in enumerate(conds):
            for t in (c.left, c.right):
                _check_metric(claim, t, f"{where}: rule.{kind}.{j}")


def _check_metric(claim: Claim, term: Term, where: str) -> None:
    """The metric a cell term reads exists in every row of its cell (a cell without rows is not checked)."""
    if term.alias is not None and claim.cells[term.alias].rows:
        try:
            expand(term, claim.cells)
        except ClaimsError as err:
            raise ClaimsError(f"{where}: {err}") from None


def vouched(table_spec: dict, where: str) -> dict:
    """The table's ``code_changes``: commit -> why the change keeps the table's numbers."""
    found = table_spec.get("code_changes") or {}
    if not isinstance(found, dict) or not all(isinstance(v, str) and v.strip() for v in found.values()):
        raise ClaimsError(f"{where}: its table's code_changes must map commits to the reason each change keeps the "
                          f"table's numbers")
    numbers = [c for c in found if not isinstance(c, str)]
    if numbers:     # YAML reads an all-digit hash as a number (one with a leading 0 and digits 0-7 as octal)
        raise ClaimsError(f"{where}: its table's code_changes has commits YAML read as numbers ({numbers}); quote "
                          f"each commit hash, e.g. '{numbers[0]}': <why>")
    return found


def claimed_cells(root: Path | str, table: str) -> set[str]:
    """The labels of ``table``'s cells that some claim reads."""
    data = load(Path(root))
    if table not in (data.get("tables") or {}):
        raise ClaimsError(f"claims.yaml: no table {table!r}{nearest(table, data.get('tables') or {})}")
    return {cell_of(str(label)) for spec in data["claims"] if isinstance(spec, dict) and spec.get("table") == table
            and not spec.get("pending") for label in (spec.get("cells") or {}).values()}
