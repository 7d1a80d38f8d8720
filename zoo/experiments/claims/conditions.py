"""The condition language of a claim's rule: ``<cell>.<metric> <op> <cell>.<metric> [+|- number]`` or
``<cell>.<metric> <op> <number>``, op one of ``>= <= > < ==``, read on cell means over seeds.

``nan`` is a number (``== nan`` asks for a diverged cell, and ``nan == nan`` holds); ``<metric>@all`` means the
metric at the training length and at every test length of the cell, compared length by length when both
sides say ``@all`` (both sides must then have the same lengths). Values are compared up to rounding
(:data:`TOLERANCE`): three seeds at 0.95 meet ``>= 0.95`` although their floating-point mean is 0.9499...
A condition written ``per seed: <condition>`` is read on every seed's value instead of the
means (both sides' cells must have the same seeds) and holds when it holds for every seed, e.g.
``per seed: attn.test_accuracy@4096 <= attn.test_accuracy - 0.2`` (every seed of attn falls by 0.2).

Every condition reads a cell, and an accuracy (a metric whose name ends in ``accuracy``, before any ``@``) is a
fraction: a number it is compared with lies in [0, 1] and an offset added to it in [-1, 1] (0.9, not 90).

A condition is **inconclusive** when it reads a cell that the verdict's learned guard found at its no-learning
level on some seed (:mod:`.verdicts`): its numbers say nothing about the claim.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .cells import CellStats, num
from .errors import ClaimsError

#: two values this close are equal: far below any difference a rule means, far above the rounding of a mean of
#: seeds or of an offset added to one (``0.9 + 0.05`` is 0.9500000000000001)
TOLERANCE = 1e-9


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=TOLERANCE, abs_tol=TOLERANCE)


_OPS = {">=": lambda a, b: a >= b or _close(a, b), "<=": lambda a, b: a <= b or _close(a, b),
        ">": lambda a, b: a > b and not _close(a, b), "<": lambda a, b: a < b and not _close(a, b),
        "==": lambda a, b: (math.isnan(a) and math.isnan(b)) or _close(a, b)}
_COND = re.compile(r"^\s*(?P<left>.+?)\s+(?P<op>>=|<=|==|>|<)\s+(?P<right>.+?)\s*$")
_PER_SEED = re.compile(r"^\s*per seed:\s*", re.I)
#: an offset is set off from the metric by whitespace: a metric name may hold a '-' (``val_loss@pos0-511``)
_TERM = re.compile(r"^(?:(?P<alias>[A-Za-z_][\w]*)\.(?P<metric>\S+)(?:\s+(?P<sign>[+-])\s*(?P<offset>\S+))?"
                   r"|(?P<number>\S+))$")


def is_fraction(metric: str) -> bool:
    """Whether ``metric`` is a fraction in [0, 1] (``test_accuracy``, ``test_sequence_accuracy@512``, ...)."""
    return metric.split("@", 1)[0].endswith("accuracy")


def check_fraction(metric: str, value: float, where: str, what: str) -> None:
    """Refuse ``value`` (a threshold, level or offset of ``metric``) outside [-1, 1] or [0, 1] when the metric is
    a fraction: an accuracy written in percent would silently never (or always) be met."""
    low = -1.0 if what == "offset" else 0.0
    if is_fraction(metric) and not low <= value <= 1.0:
        raise ClaimsError(f"{where}: {metric} is a fraction, but its {what} is {value:g}; write accuracies as "
                          f"fractions ({value / 100:g} for {value:g}%)")


@dataclass
class Term:
    """One side of a condition: a cell's metric plus an offset, or a number."""
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
    per_seed: bool = False

    @classmethod
    def parse(cls, text, where: str) -> "Condition":
        if not isinstance(text, str):
            raise ClaimsError(f"{where}: a condition is a string such as 'a.test_accuracy >= 0.9', got {text!r}")
        body = _PER_SEED.sub("", text, count=1)
        m = _COND.match(body)
        if m is None:
            raise ClaimsError(f"{where}: cannot read condition {text!r}; write [per seed:] <cell>.<metric> <op> "
                              f"<cell>.<metric> [+|- number] or <cell>.<metric> <op> <number>, op one of >= <= > < ==")
        cond = cls(text, parse_term(m.group("left"), where), m.group("op"), parse_term(m.group("right"), where),
                   per_seed=body != text)
        if cond.per_seed and any(t.metric and t.metric.endswith("@all") for t in (cond.left, cond.right)):
            raise ClaimsError(f"{where}: {text!r}: a per-seed condition reads one length per side; write one "
                              f"condition per length instead of @all")
        if not cond.aliases():
            raise ClaimsError(f"{where}: {text!r} reads no cell, so it says nothing about the table; write "
                              f"<cell>.<metric> on at least one side")
        cond.check_scale(where)
        return cond

    def check_scale(self, where: str) -> None:
        """An accuracy compared with a number or shifted by an offset on the scale of a fraction."""
        for term, other in ((self.left, self.right), (self.right, self.left)):
            if term.alias is None:
                continue
            metric = term.metric.removesuffix("@all")
            check_fraction(metric, term.offset, where, "offset")
            if other.number is not None and other.number == other.number:  # nan asks for a diverged cell
                check_fraction(metric, other.number, where, "threshold")

    def aliases(self) -> list[str]:
        return [t.alias for t in (self.left, self.right) if t.alias is not None]


def term_metrics(term: Term, cell: CellStats) -> list[str]:
    """The metrics a term reads of its cell: its metric, or the metric at every length for ``@all``."""
    return cell.lengths(term.metric[:-4]) if term.metric.endswith("@all") else [term.metric]


def expand(term: Term, cells: dict[str, CellStats]) -> list[tuple[str, float]]:
    """``[(metric, value)]`` of a term: one entry, or one per length for ``@all``."""
    if term.alias is None:
        return [("", term.number)]
    cell = cells[term.alias]
    return [(m, cell.mean(m) + term.offset) for m in term_metrics(term, cell)]


@dataclass
class ConditionResult:
    holds: bool
    detail: str
    #: why the outcome says nothing (a cell it reads did not learn on some seed); empty when it is conclusive
    inconclusive: str = ""

    @property
    def outcome(self) -> str:
        return "inconclusive" if self.inconclusive else ("holds" if self.holds else "fails")


def _lengths(term: Term, expanded: list[tuple[str, float]]) -> list[str]:
    """The lengths of an ``@all`` term's metrics: ``T`` (the training length), then each test length."""
    base = term.metric[:-len("@all")]
    return ["T" if m == base else m[len(base) + 1:] for m, _ in expanded]


def _per_seed(term: Term, cells: dict[str, CellStats]) -> dict | None:
    """``{seed: value}`` of a cell term (None for a number)."""
    if term.alias is None:
        return None
    cell = cells[term.alias]
    return {seed: v + term.offset for seed, v in zip(cell.seeds, cell.values(term.metric))}


def _evaluate_per_seed(cond: Condition, cells: dict[str, CellStats]) -> ConditionResult:
    left, right = _per_seed(cond.left, cells), _per_seed(cond.right, cells)
    if left is not None and right is not None and set(left) != set(right):
        raise ClaimsError(f"condition {cond.text!r}: per seed, but cell {cond.left.alias!r} has seeds "
                          f"{', '.join(map(str, sorted(left)))} and cell {cond.right.alias!r} seeds "
                          f"{', '.join(map(str, sorted(right)))}; run the missing seeds, or compare the means")
    seeds = sorted(left if left is not None else right)
    pairs = [(s, left[s] if left else cond.left.number, right[s] if right else cond.right.number) for s in seeds]
    shown = ", ".join(f"seed {s}: {num(a)} {cond.op} {num(b)}" for s, a, b in pairs)
    return ConditionResult(bool(pairs) and all(_OPS[cond.op](a, b) for _, a, b in pairs), shown)


def evaluate(cond: Condition, cells: dict[str, CellStats]) -> ConditionResult:
    if cond.per_seed:
        return _evaluate_per_seed(cond, cells)
    left, right = expand(cond.left, cells), expand(cond.right, cells)
    if all(t.metric is not None and t.metric.endswith("@all") for t in (cond.left, cond.right)):
        lm, rm = _lengths(cond.left, left), _lengths(cond.right, right)
        if lm != rm:
            raise ClaimsError(f"condition {cond.text!r}: the two sides have different test lengths ({lm} vs {rm})")
        pairs = list(zip(left, right))
    elif len(left) > 1:
        pairs = [(x, right[0]) for x in left]
    else:
        pairs = [(left[0], y) for y in right]
    results = [_OPS[cond.op](a, b) for (_, a), (_, b) in pairs]
    shown = ", ".join(f"{num(a)} {cond.op} {num(b)}" for (_, a), (_, b) in pairs)
    return ConditionResult(all(results), shown)
