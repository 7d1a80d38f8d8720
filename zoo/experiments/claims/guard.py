"""The learned guard: every cell a verdict judges must have left its table's no-learning level on every seed.

Every table declares ``no_learning: {<cell label or '*'>: {<metric>: level}}`` in claims.yaml: the score of a
model that learned nothing (chance, or the level of an answer that ignores the binding). The cells a verdict
judges (those its ``reproduced`` and ``partly`` conditions read, and those the claim lists in ``learned``) are
checked seed by seed on the metrics declared for them (or on the metric a ``learned`` term names): a seed
whose value is not above the level by :data:`LEARNING_MARGIN` did not learn, and every condition that reads
the cell is then inconclusive (a baseline that learned nothing cannot be beaten, and a model that learned
nothing tells nothing about how it would do once it learns); a ``learned`` cell that no verdict condition
reads makes every verdict condition inconclusive, since the verdict as a whole assumes that it learned. A metric
that is a cost (:func:`is_cost`: bits per byte, a loss, a perplexity) learns downwards: its seed must be below
the level by the margin, e.g. a language model's ``val_bpb`` below the bits per byte of the validation text's
unigram distribution.

A claim names in ``unguarded: {<cell>: <why>}`` the cells whose failure to learn is itself the result: the
claim predicts it (a pure Mamba-2 stays at chance), or the cell is compared with a guarded cell that learned
at the same budget (the unmasked arm of an ablation whose masked arm learned). Their conditions are read as
written, and the reason is printed next to the verdict.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cells import num
from .conditions import parse_term
from .errors import ClaimsError

#: a seed has learned when its value is above its table's no-learning level by this much (below, for a cost)
LEARNING_MARGIN = 0.05
#: the endings of the metric names that are costs (lower is better), before any ``@<length>``
COST_ENDINGS = ("_bpb", "_loss", "_ppl")


def is_cost(metric: str) -> bool:
    """Whether lower values of ``metric`` are better (``val_bpb``, ``test_loss``, ``val_bpb@8192``, ...)."""
    return metric.split("@", 1)[0].endswith(COST_ENDINGS)


def learned(value: float, level: float, metric: str) -> bool:
    """Whether one seed's ``value`` left the no-learning ``level`` by the margin, in the metric's direction
    (a NaN, a diverged run, never did)."""
    return value < level - LEARNING_MARGIN if is_cost(metric) else value > level + LEARNING_MARGIN


@dataclass
class Unlearned:
    """One seed of a judged cell at its no-learning level."""
    alias: str
    seed: int
    metric: str
    value: float
    level: float

    def text(self) -> str:
        op, sign = (">=", "-") if is_cost(self.metric) else ("<=", "+")
        return (f"{self.alias} seed {self.seed}: {self.metric} = {num(self.value)} {op} {num(self.level)} {sign} "
                f"{LEARNING_MARGIN}")


def unguarded(spec: dict, aliases, where: str) -> dict[str, str]:
    """The claim's ``unguarded`` cells, checked: each a cell of the claim, with why its failure is a result."""
    found = spec.get("unguarded") or {}
    if not isinstance(found, dict) or not all(isinstance(v, str) and v.strip() for v in found.values()):
        raise ClaimsError(f"{where}: unguarded must map a cell to why its not learning is a result, not a budget "
                          f"effect (the claim predicts it, or a guarded cell learned at the same budget)")
    for alias in found:
        if alias not in aliases:
            raise ClaimsError(f"{where}: unguarded names cell {alias!r}, which is not in cells")
    return found


def guarded(spec: dict, judged: set[str], aliases, where: str) -> dict[str, list[str]]:
    """``{alias: metrics}`` of the cells the guard checks: the ``judged`` ones (metrics: those their table
    declares, given as an empty list) less the unguarded ones, and the ``learned`` terms (their metric)."""
    free = unguarded(spec, aliases, where)
    out: dict[str, list[str]] = {a: [] for a in sorted(judged) if a not in free}
    learned = spec.get("learned") or []
    if not isinstance(learned, list):
        raise ClaimsError(f"{where}: learned must be a list of <cell>.<metric> terms, got {learned!r}")
    for text in learned:
        term = parse_term(text, f"{where}: learned")
        if term.alias not in aliases:
            raise ClaimsError(f"{where}: learned names cell {term.alias!r}, which is not in cells")
        if term.alias in free:
            raise ClaimsError(f"{where}: cell {term.alias!r} is both in learned and in unguarded; keep one")
        out.setdefault(term.alias, [])
        if term.metric not in out[term.alias]:
            out[term.alias].append(term.metric)
    return out


def check_learning(claim, levels: dict, where: str) -> list[Unlearned]:
    """Every seed of the claim's guarded cells (``claim.guarded``) that did not leave its no-learning level."""
    out = []
    for alias, metrics in claim.guarded.items():
        cell = claim.cells[alias]
        declared = levels.get(cell.label) or levels.get("*")
        if declared is None:
            raise ClaimsError(f"{where}: table {cell.table} declares no no_learning level for cell {cell.label!r} "
                              f"(give one for the label or '*')")
        for metric in metrics or sorted(declared):
            if metric not in declared:
                raise ClaimsError(f"{where}: learned {alias}.{metric}: table {cell.table} declares no no_learning "
                                  f"level of {metric} for cell {cell.label!r} (or '*')")
            if not cell.rows:
                continue
            level = float(declared[metric])
            try:
                values = cell.values(metric)
            except ClaimsError as err:
                raise ClaimsError(f"{where}: tables.{cell.table}.no_learning (or learned) reads {alias}.{metric}: "
                                  f"{err}") from None
            out += [Unlearned(alias, seed, metric, value, level) for seed, value in zip(cell.seeds, values)
                    if not learned(value, level, metric)]
    return out
