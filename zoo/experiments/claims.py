"""The claims ledger: published claims, the committed tables that test them, and a verdict computed by rule.

``claims.yaml`` (repository root) holds the ledger's definition as data: for every claim the paper, the
claim in one line, the paper's number and setting, the table (``tables/<name>/results.jsonl``) and the
cells of it that test the claim (by label), the rule that turns their numbers into a verdict, and a
paragraph on any discrepancy. :func:`build` reads it with the committed results and returns the text
of ``CLAIMS.md`` and ``tables/README.md``; ``zoo claims`` writes them and ``zoo claims --check`` fails
when the committed files differ from the regenerated text, so neither can be edited by hand or drift
from the data.

How a verdict is computed:

- rows are grouped into cells by label (:func:`zoo.experiments.results.cell_of`: a ``seed=N`` word of an older label
  is ignored); every row of a cell must have the same resolved recipe apart from its seed (checked);
- a cell's number is the mean over its seeds, shown as mean ± sample standard deviation (n seeds), with
  the min-max and each seed's value in the claim's details;
- a rule is two lists of conditions on cell means, ``reproduced`` and (optionally) ``partly``; a
  condition reads ``<cell>.<metric> <op> <cell>.<metric> [+|- number]`` or ``... <op> <number>``
  (op one of ``>= <= > < ==``; ``nan`` is a number, and ``== nan`` asks for a diverged cell), with
  ``<metric>@all`` meaning the metric at the training length and at every test length (compared length
  by length when both sides say ``@all``);
- every cell a rule reads needs at least :data:`MIN_SEEDS` seeds, else the verdict is
  "not tested (N seeds; needs 3)"; otherwise "reproduced" when every ``reproduced`` condition holds,
  "partly" when every ``partly`` condition holds, else "not reproduced";
- a claim lists in ``learned`` the ``<cell>.<metric>`` terms that must have left the table's declared
  no-learning level (``no_learning`` of the table: chance, or the level of an answer that ignores the
  binding) by :data:`LEARNING_MARGIN`; when one has not, the verdict is "inconclusive (nothing learned)",
  whatever the rule says: a baseline that never learned its training task cannot be beaten;
- ``exploration`` conditions (other cells or settings than the paper's) are evaluated and shown, never a
  verdict;
- pre-registration is read from git (:mod:`zoo.experiments.preregistration`): a verdict whose rule took its
  current form after the code of any row it judges is marked ", post hoc";
- a claim with ``pending: <why>`` (no table yet) is "not tested (<why>)"; a claim that is an exact
  property rather than a training result names the unit test that checks it (``unit_test``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mixers.options import nearest

from ..errors import UserError
from ..recipes import recipe_differences, resolve
from .ablate import cells_of, row_seed
from .freshness import Staleness, cell_staleness
from .preregistration import Registration, in_git_checkout, registration
from .results import cell_of, group_by_cell, mean_std
from .rows import read_rows
from .untrained import load as load_untrained
from .vouch import load as load_vouches

#: seeds every cell a verdict reads must have
MIN_SEEDS = 3
#: a cell has learned its training task when its mean is above the table's no-learning level by this much
LEARNING_MARGIN = 0.05
#: a rule's lists of conditions: the two that bear the verdict, and exploration (other cells or settings than
#: the paper's, evaluated and shown, never a verdict)
RULE_KINDS = ("reproduced", "partly", "exploration")
VERDICT_KINDS = ("reproduced", "partly")
#: a table whose recipe is estimated to train longer than this (seconds) is flagged in tables/README.md
TABLE_BUDGET_S = 45 * 60
GENERATED = ("CLAIMS.md", "tables/README.md", "README.md")  # README.md: its results table only

_OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b,
        "==": lambda a, b: (math.isnan(a) and math.isnan(b)) or a == b}
_COND = re.compile(r"^\s*(?P<left>.+?)\s+(?P<op>>=|<=|==|>|<)\s+(?P<right>.+?)\s*$")
_TERM = re.compile(r"^(?:(?P<alias>[A-Za-z_][\w]*)\.(?P<metric>\S+?)(?:\s*(?P<sign>[+-])\s*(?P<offset>\S+))?"
                   r"|(?P<number>\S+))$")


class ClaimsError(Exception):
    """A problem in claims.yaml or in the results it reads, reported as one line naming the place."""


# --------------------------------------------------------------------------------------- cells
@dataclass
class CellStats:
    """The rows of one cell of a table (one per seed) and what the ledger reads from them."""
    table: str
    label: str
    rows: list[dict]

    @property
    def seeds(self) -> list[int]:
        return sorted(row_seed(r) for r in self.rows)

    @property
    def n(self) -> int:
        return len(self.rows)

    def metrics(self) -> set[str]:
        return {k for r in self.rows for k in _metrics(r)}

    def values(self, metric: str) -> list[float]:
        out = []
        for r in sorted(self.rows, key=row_seed):
            m = _metrics(r)
            if metric not in m:
                raise ClaimsError(f"tables/{self.table}: cell {self.label!r} (seed {row_seed(r)}) has no metric "
                                  f"{metric!r}{nearest(metric, m)} (its metrics: {', '.join(sorted(m))})")
            out.append(float("nan") if m[metric] is None else float(m[metric]))
        return out

    def mean(self, metric: str) -> float:
        values = self.values(metric)
        return mean_std(values)[0] if values else float("nan")

    def lengths(self, metric: str) -> list[str]:
        """``metric`` at the training length, then at every test length of the cell's rows."""
        # the length is what follows "<metric>@", so metrics with an "@" of their own (e.g.
        # test_accuracy@task=<label>) have lengths too
        found = sorted({int(k[len(metric) + 1:]) for k in self.metrics()
                        if k.startswith(metric + "@") and k[len(metric) + 1:].isdigit()})
        return [metric] + [f"{metric}@{length}" for length in found]

    def summary(self, metric: str) -> str:
        """``0.921 ± 0.012 (3 seeds)``: mean ± sample standard deviation, and the number of seeds."""
        if not self.rows:
            return "no rows (0 seeds)"
        values = self.values(metric)
        mean, std = mean_std(values)
        seeds = f"{self.n} seed{'s' * (self.n != 1)}"
        return f"{_num(mean)} ({seeds})" if self.n == 1 else f"{_num(mean)} ± {_num(std)} ({seeds})"


def _metrics(row: dict) -> dict:
    return dict(row.get("metrics", {}))


def _num(x: float) -> str:
    return "nan" if x != x else f"{x:.3f}"


def _without_seed(recipe: dict) -> dict:
    return {k: v for k, v in recipe.items() if k != "seed"}


def table_cells(root: Path, table: str) -> dict[str, CellStats]:
    """Every cell of ``tables/<table>/results.jsonl``, checked: one recipe per cell apart from the seed,
    and one row per seed."""
    path = root / "tables" / table / "results.jsonl"
    if not path.is_file():
        raise ClaimsError(f"{path.relative_to(root)}: no such file; run the table's recipe (zoo ablate ... --out "
                          f"tables/{table}) or correct the claim's table")
    cells = {}
    for label, rows in group_by_cell(read_rows(path)).items():
        first = rows[0]
        for r in rows[1:]:
            if _without_seed(r["recipe"]) != _without_seed(first["recipe"]):
                diff = "; ".join(recipe_differences(_without_seed(first["recipe"]), _without_seed(r["recipe"])))
                raise ClaimsError(f"tables/{table}: the rows of cell {label!r} differ in more than the seed ({diff}); "
                                  f"give the cells different labels")
        seeds = [row_seed(r) for r in rows]
        repeated = sorted({s for s in seeds if seeds.count(s) > 1})
        if repeated:
            raise ClaimsError(f"tables/{table}: cell {label!r} has more than one row for seed {repeated[0]}; "
                              f"keep one row per seed in results.jsonl")
        cells[label] = CellStats(table, label, rows)
    return cells


def recipe_cells(root: Path, recipe_path: str):
    """The cells (label, resolved recipe) of a table's recipe as written now."""
    try:
        return cells_of(resolve(root / recipe_path))
    except UserError as err:
        raise ClaimsError(f"{recipe_path}: {err}") from None


# --------------------------------------------------------------------------------------- rules
@dataclass
class Term:
    alias: str | None
    metric: str | None
    offset: float
    number: float | None


def parse_term(text: str, where: str) -> Term:
    m = _TERM.match(text.strip())
    if m is None:
        raise ClaimsError(f"{where}: cannot read {text!r}; write <cell>.<metric> [+|- number] or a number")
    if m.group("number") is not None:
        try:
            return Term(None, None, 0.0, float(m.group("number")))
        except ValueError:
            raise ClaimsError(f"{where}: {text!r} is neither a number nor <cell>.<metric>") from None
    offset = 0.0
    if m.group("offset") is not None:
        try:
            offset = float(m.group("offset")) * (1 if m.group("sign") == "+" else -1)
        except ValueError:
            raise ClaimsError(f"{where}: the offset in {text!r} is not a number") from None
    return Term(m.group("alias"), m.group("metric"), offset, None)


@dataclass
class Condition:
    text: str
    left: Term
    op: str
    right: Term

    @classmethod
    def parse(cls, text, where: str) -> "Condition":
        if not isinstance(text, str):
            raise ClaimsError(f"{where}: a condition is a string such as 'a.test_accuracy >= 0.9', got {text!r}")
        m = _COND.match(text)
        if m is None:
            raise ClaimsError(f"{where}: cannot read condition {text!r}; write <cell>.<metric> <op> <cell>.<metric> "
                              f"[+|- number] or <cell>.<metric> <op> <number>, op one of >= <= > < ==")
        return cls(text, parse_term(m.group("left"), where), m.group("op"), parse_term(m.group("right"), where))

    def aliases(self) -> list[str]:
        return [t.alias for t in (self.left, self.right) if t.alias is not None]


def _expand(term: Term, cells: dict[str, CellStats]) -> list[tuple[str, float]]:
    """``[(metric, value)]`` of a term: one entry, or one per length for ``@all``."""
    if term.alias is None:
        return [("", term.number)]
    cell = cells[term.alias]
    if term.metric.endswith("@all"):
        metrics = cell.lengths(term.metric[:-4])
    else:
        metrics = [term.metric]
    return [(m, cell.mean(m) + term.offset) for m in metrics]


@dataclass
class ConditionResult:
    holds: bool
    detail: str


def evaluate(cond: Condition, cells: dict[str, CellStats]) -> ConditionResult:
    left, right = _expand(cond.left, cells), _expand(cond.right, cells)
    if len(left) > 1 and len(right) > 1:
        lm = [m.rsplit("@", 1)[-1] if "@" in m else "T" for m, _ in left]
        rm = [m.rsplit("@", 1)[-1] if "@" in m else "T" for m, _ in right]
        if lm != rm:
            raise ClaimsError(f"condition {cond.text!r}: the two sides have different test lengths ({lm} vs {rm})")
        pairs = list(zip(left, right))
    elif len(left) > 1:
        pairs = [(x, right[0]) for x in left]
    else:
        pairs = [(left[0], y) for y in right]
    results = [_OPS[cond.op](a, b) for (_, a), (_, b) in pairs]
    shown = ", ".join(f"{_num(a)} {cond.op} {_num(b)}" for (_, a), (_, b) in pairs)
    return ConditionResult(all(results), shown)


# --------------------------------------------------------------------------------------- the ledger
REQUIRED = ("id", "paper", "claim", "paper_result")


@dataclass
class Claim:
    spec: dict
    cells: dict[str, CellStats] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    rule: dict[str, list[Condition]] = field(default_factory=dict)
    outcomes: dict[str, list[ConditionResult]] = field(default_factory=dict)
    verdict: str = ""
    registration: Registration | None = None
    unlearned: list[str] = field(default_factory=list)  # "alias.metric mean <= level + margin" for cells at no-learning
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


def _check_spec(spec, where: str, papers: dict, ids: set) -> None:
    """The fields every claim has: a mapping with an unused id and a known paper."""
    if not isinstance(spec, dict):
        raise ClaimsError(f"{where}: a claim is a mapping (id, paper, claim, paper_result, ...)")
    for key in REQUIRED:
        if not spec.get(key):
            raise ClaimsError(f"{where}: missing {key!r}")
    if spec["id"] in ids:
        raise ClaimsError(f"{where}: the id {spec['id']!r} is used twice")
    ids.add(spec["id"])
    if spec["paper"] not in papers or not {"title", "id"} <= set(papers[spec["paper"]] or {}):
        raise ClaimsError(f"{where}: unknown paper {spec['paper']!r}{nearest(spec['paper'], papers)} "
                          f"(papers, each with a title and an id: {', '.join(papers)})")


def _bind_cells(claim: Claim, where: str, table: str, recipe_path: str, present: dict, planned: set) -> None:
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


def _parse_rule(claim: Claim, where: str) -> None:
    """``claim.rule``: the parsed conditions of each verdict, every named cell and metric checked."""
    rule = claim.spec.get("rule")
    if not isinstance(rule, dict) or not rule.get("reproduced"):
        raise ClaimsError(f"{where}: rule.reproduced must list the conditions of a reproduced claim")
    unknown = set(rule) - set(RULE_KINDS)
    if unknown:
        raise ClaimsError(f"{where}: rule has unknown keys {sorted(unknown)}; use {', '.join(RULE_KINDS)}")
    for kind in RULE_KINDS:
        conds = rule.get(kind) or []
        claim.rule[kind] = [Condition.parse(c, f"{where}: rule.{kind}.{j}") for j, c in enumerate(conds)]
        for c in claim.rule[kind]:
            for alias in c.aliases():
                if alias not in claim.cells:
                    raise ClaimsError(f"{where}: rule condition {c.text!r} names cell {alias!r}, which is not "
                                      f"in cells{nearest(alias, claim.cells)} ({', '.join(claim.cells)})")
    for name in claim.spec.get("show") or []:
        cond = parse_term(name, f"{where}: show")
        if cond.alias not in claim.cells:
            raise ClaimsError(f"{where}: show names cell {cond.alias!r}, which is not in cells")
    for conds in claim.rule.values():  # every metric a rule names must exist (checked below 3 seeds too)
        for c in conds:
            for t in (c.left, c.right):
                if t.alias is not None and claim.cells[t.alias].rows:
                    _expand(t, claim.cells)


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
            out.append(f"{text} = {_num(cell.mean(term.metric))} <= {_num(level)} + {LEARNING_MARGIN}")
    return out


def _judge(claim: Claim) -> None:
    """``claim.outcomes`` and ``claim.verdict`` by the claim's rule."""
    fewest = min(claim.cells[a].n for a in _condition_aliases(claim))
    for kind, conds in claim.rule.items():
        claim.outcomes[kind] = [evaluate(c, claim.cells) for c in conds] if fewest else []
    if fewest < MIN_SEEDS:
        claim.verdict = f"not tested ({fewest} seed{'s' * (fewest != 1)}; needs {MIN_SEEDS})"
    elif claim.unlearned:
        claim.verdict = "inconclusive (nothing learned)"
    elif all(o.holds for o in claim.outcomes["reproduced"]):
        claim.verdict = "reproduced"
    elif claim.outcomes["partly"] and all(o.holds for o in claim.outcomes["partly"]):
        claim.verdict = "partly"
    else:
        claim.verdict = "not reproduced"


def evaluate_claims(data: dict, root: Path) -> list[Claim]:
    papers, tables = data.get("papers") or {}, data.get("tables") or {}
    loaded: dict[str, dict[str, CellStats]] = {}
    recipes: dict[str, list] = {}
    step0: dict[str, dict] = {}
    out, ids = [], set()
    for i, spec in enumerate(data["claims"]):
        where = f"claims.yaml: claims.{i}" + (f" ({spec.get('id')})" if isinstance(spec, dict) and spec.get("id") else "")
        _check_spec(spec, where, papers, ids)
        claim = Claim(spec)
        out.append(claim)
        if spec.get("pending"):
            claim.verdict = f"not tested ({spec['pending']})"
            continue
        if spec.get("unit_test"):
            _check_unit_test(root, spec["unit_test"], where)
            # a unit test asserts what is measured here; where that differs from the paper's number, say so
            claim.verdict = ("partly: checked by a unit test that measures another number than the paper's"
                             if spec.get("unit_test_differs") else
                             "exact property: checked by a unit test, not by a table")
            continue
        table = spec.get("table")
        if table not in tables:
            raise ClaimsError(f"{where}: table {table!r} is not listed under tables{nearest(table, tables)} "
                              f"(tables: {', '.join(tables)})")
        if table not in loaded:
            loaded[table] = table_cells(root, table)
            recipes[table] = recipe_cells(root, tables[table]["recipe"])
        _bind_cells(claim, where, table, tables[table]["recipe"], loaded[table], {c.label for c in recipes[table]})
        _parse_rule(claim, where)
        claim.unlearned = _unlearned(claim, tables[table], where)
        _judge(claim)
        if table not in step0:
            step0[table] = load_untrained(root, table)
        _check_step0(claim, step0[table], where)
        claim.registration = registration(root, spec, [r for a in _judged_aliases(claim) for r in claim.cells[a].rows])
        if claim.registration.post_hoc and not claim.verdict.startswith("not tested"):
            claim.verdict += ", post hoc"
        claim.stale = _stale_cells(root, claim, tables[table], where)
        if claim.stale and not claim.verdict.startswith("not tested"):
            claim.verdict += ", stale by code"
    return out


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
    cells = {}
    for alias, cell in claim.cells.items():
        seeds = untrained.get(cell.label, {})
        rows = [{"seed": s, "metrics": m, "recipe": {"seed": s}} for s, m in sorted(seeds.items())]
        if cell.rows and {row_seed(r) for r in cell.rows} - set(seeds):
            claim.step0_missing.append(cell.label)
        cells[alias] = CellStats(cell.table, cell.label, rows)
    claim.step0_missing = sorted(set(claim.step0_missing))
    if claim.step0_missing:
        return
    for kind in VERDICT_KINDS:
        conds = [c for c in claim.rule[kind] if all(cells[a].rows for a in c.aliases())]
        outcomes = [evaluate(c, cells) for c in conds]
        claim.step0_holds += [f"{kind}: `{c.text}` ({o.detail})" for c, o in zip(conds, outcomes) if o.holds]
        accounted = any(set(c.aliases()) & guarded or c.text in ok for c in conds)
        if conds and len(conds) == len(claim.rule[kind]) and all(o.holds for o in outcomes) and not accounted:
            claim.vacuous.append(f"every {kind} condition holds at step 0")


def _vouched(table_spec: dict, where: str) -> dict:
    vouched = table_spec.get("code_changes") or {}
    if not isinstance(vouched, dict) or not all(isinstance(v, str) and v.strip() for v in vouched.values()):
        raise ClaimsError(f"{where}: its table's code_changes must map commits to the reason each change keeps the "
                          f"table's numbers")
    return vouched


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
    vouched = _vouched(table_spec, where)
    probed = load_vouches(root, claim.spec["table"])
    out = []
    for alias in _judged_aliases(claim):
        cell = claim.cells[alias]
        if cell.rows:
            found = cell_staleness(root, cell.label, cell.rows, vouched, probed)
            if found.stale:
                out.append(found)
    return out


def claimed_cells(root: Path | str, table: str) -> set[str]:
    """The labels of ``table``'s cells that some claim reads."""
    data = load(Path(root))
    if table not in (data.get("tables") or {}):
        raise ClaimsError(f"claims.yaml: no table {table!r}{nearest(table, data.get('tables') or {})}")
    return {cell_of(str(label)) for spec in data["claims"] if isinstance(spec, dict) and spec.get("table") == table
            and not spec.get("pending") for label in (spec.get("cells") or {}).values()}


def _check_unit_test(root: Path, ref: str, where: str) -> None:
    path, _, name = str(ref).partition("::")
    file = root / path
    if not file.is_file() or not name or not re.search(rf"^def {re.escape(name)}\(", file.read_text(), re.M):
        raise ClaimsError(f"{where}: unit_test {ref!r} names no test function (write path/to/test_x.py::test_name)")


# --------------------------------------------------------------------------------------- rendering
def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _paper(data: dict, key: str, short: bool = False) -> str:
    p = data["papers"][key]
    return f"{p.get('short') if short and p.get('short') else p['title']} ({p['id']})"


def command(data: dict, table: str) -> str:
    spec = data["tables"][table]
    ray = " --executor ray" if spec.get("ray_workers") else ""
    return f"zoo ablate {spec['recipe']} --out tables/{table} --no-progress{ray}"


def _our_number(claim: Claim) -> str:
    spec = claim.spec
    if spec.get("pending") or spec.get("unit_test"):
        return "-"
    parts = []
    for name in spec.get("show") or []:
        t = parse_term(name, "show")
        cell = claim.cells[t.alias]
        parts.append(f"{t.alias} {t.metric}: {cell.summary(t.metric) if cell.rows else 'no rows (0 seeds)'}")
    return "; ".join(parts)


HEADER = """# Claims ledger

Generated by `zoo claims` from `claims.yaml` (the claims, their rules and the discussion of each) and the
committed `tables/*/results.jsonl`. Do not edit this file by hand: change `claims.yaml` or re-run a table,
then run `zoo claims`. `zoo claims --check` (and `tests/zoo/test_claims.py`) fails when this file differs
from the regenerated text.

## How verdicts are computed

- The rows of a table are grouped into cells by their label (a `seed=N` word in a label is ignored: older
  tables named their seed replicates that way); the rows of one cell must have the same resolved recipe
  apart from the seed, one row per seed.
- A cell's number is its mean over seeds, written `mean ± sample standard deviation (n seeds)`; the
  details below also give the min-max and every seed's value.
- A rule is a list of conditions on cell means, written next to the claim in `claims.yaml`, e.g.
  `masked.test_accuracy@all >= 0.9` (`@all`: at the training length and at every test length of the cell).
  **reproduced**: every `reproduced` condition holds; **partly**: otherwise, every `partly` condition holds;
  **not reproduced**: otherwise. `exploration` conditions (cells or settings other than the paper's) are
  shown with their outcome and never give the verdict.
- **inconclusive (nothing learned)**: a cell the comparison needs (the claim's `learned` list) did not rise
  above its table's no-learning level (chance, or the level of an answer that ignores the binding) by
  {margin}; a baseline that never learned its training task cannot be beaten, and a rule read on untrained
  models says nothing.
- **post hoc**: the rule took its current form (read from git: the oldest commit since which claims.yaml gives
  it the same rule and cells) after the code of some row it judges (each row records its commit); such a
  rule could have been chosen knowing the numbers. Each claim's details say which.
- **step 0**: every verdict condition is also evaluated on the untrained models of its cells (each row
  records their metrics; older tables keep them in `tables/<name>/untrained.json`, written by
  `zoo claims --untrained <table>`), and the conditions that already hold there are listed. A verdict
  that the untrained models would already get is **vacuous** and fails `zoo claims --check`, unless its
  conditions read a cell that must have learned (`learned`: untrained, the verdict is inconclusive) or the
  claim says why a condition is meant to hold at step 0 (`step0_ok`).
- **stale by code**: a cell the verdict reads was computed at a commit older than a change to the code of
  its mixers, kernels or task (compared as syntax trees, so wording, comments and import order do not count;
  `zoo.experiments.freshness`), and its table does not vouch for that change in `claims.yaml`
  (`code_changes`: the commit and why it keeps the numbers). Re-running the cell clears it.
- A verdict needs at least {min_seeds} seeds in every cell its rule reads; with fewer it is
  **not tested (N seeds; needs {min_seeds})**, whatever the numbers say. A claim with no table yet is
  **not tested** with the reason; an exact mathematical property is checked by a unit test instead.
- Numbers are from small CPU-scale models (see each table's README); a verdict says whether the claim's
  direction and rough size hold at that scale, not at the paper's.

## Summary
"""


def render_claims(data: dict, claims: list[Claim]) -> str:
    lines = [HEADER.format(min_seeds=MIN_SEEDS, margin=LEARNING_MARGIN)]
    lines.append("| # | paper | claim | paper's number (setting) | recipe | our number | verdict |")
    lines.append("|---|---|---|---|---|---|---|")
    for i, c in enumerate(claims, 1):
        s = c.spec
        recipe = f"`{command(data, s['table'])}`" if s.get("table") and not s.get("pending") and not s.get("unit_test") \
            else (f"`pytest {s['unit_test']}`" if s.get("unit_test") else "-")
        lines.append(f"| {i} | {_cell(_paper(data, s['paper'], short=True))} | {_cell(s['claim'])} | "
                     f"{_cell(s['paper_result'])} | "
                     f"{_cell(recipe)} | {_cell(_our_number(c))} | **{c.verdict}** |")
    lines.append("\n## Claims in detail\n")
    for i, c in enumerate(claims, 1):
        s = c.spec
        lines.append(f"### {i}. `{s['id']}`: {s['claim']}\n")
        lines.append(f"- Paper: {_paper(data, s['paper'])}; {s['paper_result']}")
        if s.get("source"):
            lines.append(f"- Source: {' '.join(str(s['source']).split())}")
        if s.get("unit_test_differs"):
            lines.append(f"- Measured here: {' '.join(str(s['unit_test_differs']).split())}")
        if s.get("setting"):
            lines.append(f"- Here: {' '.join(str(s['setting']).split())}")
        if s.get("pending"):
            lines.append(f"- Verdict: **{c.verdict}**")
        elif s.get("unit_test"):
            lines.append(f"- Checked by `{s['unit_test']}` (run with the test suite).")
            lines.append(f"- Verdict: **{c.verdict}**")
        else:
            lines.append(f"- Table: `tables/{s['table']}` (`{command(data, s['table'])}`)")
            lines.append(f"- Verdict: **{c.verdict}**")
            lines.append(f"- Rule: {c.registration.text}")
            if c.unlearned:
                lines.append(f"- Nothing learned (no-learning level + {LEARNING_MARGIN}): {'; '.join(c.unlearned)}")
            if c.step0_missing:
                lines.append(f"- Step 0: not evaluated for {', '.join(c.step0_missing)} (run `zoo claims --untrained "
                             f"{s['table']}`)")
            elif c.vacuous:
                lines.append(f"- **Vacuous at step 0**: {'; '.join(c.vacuous)}: {'; '.join(c.step0_holds)}")
            elif c.step0_holds:
                lines.append(f"- Step 0: the untrained models would not get the verdict; conditions that hold on them: "
                             f"{'; '.join(c.step0_holds)}")
            else:
                lines.append("- Step 0: no verdict condition holds on the untrained models")
            for text, why in (s.get("step0_ok") or {}).items():
                lines.append(f"- `{text}` may hold at step 0: {' '.join(why.split())}")
            if c.stale:
                lines.append(f"- Stale by code (commits that changed the code of these cells after their rows; re-run "
                             f"the cells, or vouch for a change in claims.yaml `tables.{s['table']}.code_changes`): "
                             + "; ".join(x.text() for x in c.stale))
            lines.append("\nRule (conditions on the means over seeds; values as `left op right`):\n")
            for kind in RULE_KINDS:
                for j, cond in enumerate(c.rule.get(kind, [])):
                    outcome = c.outcomes[kind][j] if c.outcomes.get(kind) else None
                    result = (f"{outcome.detail} -> {'holds' if outcome.holds else 'fails'}" if outcome
                              else "not evaluated (no rows)")
                    lines.append(f"- {kind}: `{cond.text}`: {result}")
            lines.append("\n| cell | label | seeds | metric | mean ± std | min-max | per seed |")
            lines.append("|---|---|---|---|---|---|---|")
            for alias, cell in c.cells.items():
                metrics = _metrics_read(c, alias)
                if not cell.rows:
                    lines.append(f"| {alias} | {_cell(cell.label)} | none yet | {_cell(', '.join(metrics))} | | | |")
                    continue
                for metric in metrics:
                    values = cell.values(metric)
                    mean, std = mean_std(values)
                    spread = f"{_num(mean)} ± {_num(std)}" if len(values) > 1 else f"{_num(mean)} (one seed)"
                    lines.append(f"| {alias} | {_cell(cell.label)} | {', '.join(map(str, cell.seeds))} | {metric} | "
                                 f"{spread} | {_num(min(values))}-{_num(max(values))} | "
                                 f"{', '.join(_num(v) for v in values)} |")
        if s.get("discrepancy"):
            lines.append("\n" + " ".join(str(s["discrepancy"]).split()))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _metrics_read(claim: Claim, alias: str) -> list[str]:
    out: list[str] = []
    terms = [t for conds in claim.rule.values() for c in conds for t in (c.left, c.right)]
    terms += [parse_term(n, "show") for n in claim.spec.get("show") or []]
    for t in terms:
        if t.alias != alias:
            continue
        metrics = claim.cells[alias].lengths(t.metric[:-4]) if t.metric.endswith("@all") else [t.metric]
        out += [m for m in metrics if m not in out]
    return out


# --------------------------------------------------------------------------------------- tables/README.md
TABLES_HEADER = """# Tables: the command behind each, and what it costs

Generated by `zoo claims` from `claims.yaml` (`tables:`) and each table's `results.jsonl`; do not edit by hand.
Run every command from the repository root, one at a time on a shared machine
(`flock /tmp/zoo-cpu.lock <command>`). A re-run skips every cell whose row is already in `results.jsonl`
(same resolved recipe and seed), so adding seeds runs only the new ones; rows written under an older
resolution of the recipe (or before rows carried recipe hashes) are refused rather than mixed, and such a
table is re-run whole into a new folder.

- **measured**: the wall time written in the table's README for the committed rows (training and evaluation,
  on 2 shared CPU cores), and the sum of `train_seconds` over the committed rows (training only).
- **recipe now**: the cells of the recipe as written today (cells x seeds), and an estimate of its training
  time (evaluation not included): for a cell and seed with a committed row of the same resolved recipe, the
  `train_seconds` of that row; for one without, seconds per step of the cell's committed rows (their mean
  over seeds) times the cell's step budget (an upper bound where a cell stops early). **missing** counts
  only the cells and seeds without a committed row of the same resolved recipe: the cost of the next re-run.
  Cells with no committed row of their label have no estimate and are counted as unmeasured.
  A table run with `--executor ray` (`ray_workers` in `claims.yaml`: runs of one thread side by side, one per
  core) has both estimates divided by its number of workers.
- Tables estimated above {budget} min are flagged.
"""


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def table_estimates(root: Path, recipe_path: str, cells: dict[str, CellStats]) -> dict[str, Any]:
    """Estimated training seconds of a recipe as written, from the committed rows of its cells."""
    per_step = {}
    for label, cell in cells.items():
        rates = [r["metrics"]["train_seconds"] / r["metrics"]["steps"] for r in cell.rows
                 if r["metrics"].get("steps") and r["metrics"].get("train_seconds") is not None]
        if rates:
            per_step[label] = sum(rates) / len(rates)
    total = missing = 0.0
    unmeasured = n_missing = 0
    recipe = recipe_cells(root, recipe_path)
    done = {r.get("recipe_key"): r for c in cells.values() for r in c.rows}  # committed runs by recipe key
    # rows of a cell label and seed that the recipe now resolves differently (or that predate recipe
    # hashes): zoo ablate refuses to mix them with new rows, so the table must be re-run into a new folder
    stale = 0
    for cell in recipe:
        label = cell_of(cell.label)
        is_done = cell.recipe.key in done
        if not is_done and label in cells:
            stale += any(row_seed(r) == cell.recipe.seed for r in cells[label].rows)
        if label not in per_step:
            unmeasured += 1
            n_missing += not is_done
            continue
        seconds = per_step[label] * cell.recipe.train.steps
        if is_done and done[cell.recipe.key]["metrics"].get("train_seconds") is not None:
            seconds = done[cell.recipe.key]["metrics"]["train_seconds"]  # what this very run took
        total += seconds
        if not is_done:
            missing += seconds
            n_missing += 1
    seeds = sorted({c.recipe.seed for c in recipe})
    return {"cells": len({cell_of(c.label) for c in recipe}), "runs": len(recipe), "seeds": seeds, "total": total,
            "missing": missing, "n_missing": n_missing, "unmeasured": unmeasured, "stale": stale}


def _committed(cells: dict, seeds: list[int], train: float) -> str:
    """The "committed rows" column: cells, seeds per cell and training time, or that no row exists yet."""
    if not cells:
        return "no rows yet"
    return f"{len(cells)} cells, {min(seeds)}-{max(seeds)} seeds, {_minutes(train)}"


def render_tables(data: dict, root: Path) -> str:
    lines = [TABLES_HEADER.format(budget=TABLE_BUDGET_S // 60)]
    lines.append("| table | command | measured (README) | committed rows: cells, seeds per cell, train_seconds | "
                 "recipe now: cells x seeds | estimated training, recipe now | missing rows: runs, estimate |")
    lines.append("|---|---|---|---|---|---|---|")
    for table, spec in (data.get("tables") or {}).items():
        cells = table_cells(root, table)
        seeds = [c.n for c in cells.values()]
        train = sum(r["metrics"].get("train_seconds", 0.0) for c in cells.values() for r in c.rows)
        est = table_estimates(root, spec["recipe"], cells)
        workers = spec.get("ray_workers") or 1
        est["total"], est["missing"] = est["total"] / workers, est["missing"] / workers
        on = f" on {workers} Ray workers" if workers > 1 else ""
        flag = " **over budget**" if est["total"] > TABLE_BUDGET_S else ""
        unmeasured = f" + {est['unmeasured']} unmeasured" if est["unmeasured"] else ""
        stale = (f" ({est['stale']} committed rows come from an older recipe: re-run the whole table into a new "
                 f"folder)" if est["stale"] else "")
        lines.append(
            f"| `tables/{table}` | `{command(data, table)}` | {_cell(spec.get('measured', ''))} | "
            f"{_committed(cells, seeds, train)} | "
            f"{est['cells']} x {len(est['seeds'])} ({', '.join(map(str, est['seeds']))}) = {est['runs']} | "
            f"{_minutes(est['total'])}{on}{unmeasured}{flag} | {est['n_missing']}, {_minutes(est['missing'])}{stale} |")
    for extra in data.get("other_tables") or []:
        lines.append(f"| `{extra['folder']}` | `{extra['command']}` | {_cell(extra.get('measured', ''))} | "
                     f"{_cell(extra.get('note', ''))} | | | |")
    return "\n".join(lines) + "\n"


README_BEGIN = "<!-- results table: generated by zoo claims from claims.yaml and the ledger; do not edit -->"
README_END = "<!-- end of the generated results table -->"


def render_readme_results(data: dict, claims: list[Claim]) -> str:
    """The README's table of results: each table's question and the ledger's verdicts on it, so the two
    cannot disagree."""
    lines = [README_BEGIN, "| table | question | the ledger's verdicts (our numbers: mean over seeds) |", "|---|---|---|"]
    for table, spec in (data.get("tables") or {}).items():
        judged = [c for c in claims if c.spec.get("table") == table and not c.spec.get("pending")]
        answer = "<br>".join(f"`{c.spec['id']}` **{c.verdict}**" + (f": {_our_number(c)}" if _our_number(c) != "-"
                                                                   else "") for c in judged)
        lines.append(f"| `tables/{table}` | {_cell(spec.get('question', ''))} | "
                     f"{_cell(answer) if judged else 'no claim judged here (an exploration): readings in its README'} |")
    for extra in data.get("other_tables") or []:
        lines.append(f"| `{extra['folder']}` | {_cell(extra.get('question', ''))} | {_cell(extra.get('note', ''))} |")
    lines.append(README_END)
    return "\n".join(lines)


def _readme_with_results(root: Path, data: dict, claims: list[Claim]) -> dict[str, str]:
    """``{"README.md": text}`` with the generated results table in place, when the README has its markers."""
    path = root / "README.md"
    text = path.read_text() if path.is_file() else ""
    if README_BEGIN not in text or README_END not in text:
        return {}
    head, rest = text.split(README_BEGIN, 1)
    return {"README.md": head + render_readme_results(data, claims) + rest.split(README_END, 1)[1]}


# --------------------------------------------------------------------------------------- entry points
def build(root: Path | str = ".", notes: list[str] | None = None,
          problems: list[str] | None = None) -> dict[str, str]:
    """``{relative path: text}`` of every generated file, from claims.yaml and the committed results; ``notes``
    (when given) receives one line per claim whose verdict reads cells that are stale by code."""
    root = Path(root)
    data = load(root)
    for key in ("papers", "tables"):
        if not isinstance(data.get(key), dict):
            raise ClaimsError(f"claims.yaml: {key} must be a mapping")
    for name, spec in data["tables"].items():
        if not isinstance(spec, dict) or not spec.get("recipe"):
            raise ClaimsError(f"claims.yaml: tables.{name}: give the recipe that produces the table")
        workers = spec.get("ray_workers")
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ClaimsError(f"claims.yaml: tables.{name}.ray_workers: expected a whole number of workers >= 1 "
                              f"(the runs --executor ray puts side by side), got {workers!r}")
    claims = evaluate_claims(data, root)
    if notes is not None:
        notes.extend(f"{c.spec['id']}: stale by code: {'; '.join(x.text() for x in c.stale)}" for c in claims if c.stale)
    if problems is not None:
        problems.extend(f"claims.yaml: {c.spec['id']}: vacuous at step 0: {'; '.join(c.vacuous)}; tighten the rule, "
                        f"list its cells in learned, or say why in step0_ok" for c in claims if c.vacuous)
        problems.extend(f"claims.yaml: {c.spec['id']}: no step-0 evaluation of {', '.join(c.step0_missing)}; run "
                        f"zoo claims --untrained {c.spec['table']}" for c in claims if c.step0_missing)
    return {"CLAIMS.md": render_claims(data, claims), "tables/README.md": render_tables(data, root),
            **_readme_with_results(root, data, claims)}


def first_difference(old: str, new: str) -> str:
    """The first differing line of two texts, for an error message."""
    a, b = old.splitlines(), new.splitlines()
    for i, (x, y) in enumerate(zip(a, b), 1):
        if x != y:
            return f"line {i}: committed {x[:120]!r}, regenerated {y[:120]!r}"
    return f"line {min(len(a), len(b)) + 1}: the committed file has {len(a)} lines, the regenerated {len(b)}"


def check(root: Path | str = ".", notes: list[str] | None = None) -> list[str]:
    """One message per generated file that differs from the committed one (empty when all match)."""
    root = Path(root)
    problems: list[str] = []
    for rel, text in build(root, notes, problems).items():
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel}: missing; run zoo claims")
        elif path.read_text() != text:
            problems.append(f"{rel} differs from the regenerated text ({first_difference(path.read_text(), text)}); "
                            f"edit claims.yaml or the tables, not {rel}, and run zoo claims")
    return problems


def write(root: Path | str = ".", notes: list[str] | None = None) -> list[str]:
    root = Path(root)
    written = []
    for rel, text in build(root, notes).items():
        (root / rel).write_text(text)
        written.append(rel)
    return written
