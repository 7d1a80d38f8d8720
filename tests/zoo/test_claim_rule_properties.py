"""A rule's comparison against exact arithmetic near its threshold: a cell mean a small but real distance
(a millionth to a hundredth, relative) on either side of a number, or of another cell's mean plus an offset,
gets the outcome exact arithmetic gives for each operator; the tolerance only absorbs floating-point rounding."""
from fractions import Fraction

import torch

from zoo.experiments.claims.cells import CellStats
from zoo.experiments.claims.conditions import Condition, evaluate

OPS = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b,
       "==": lambda a, b: a == b}


def _cell(label: str, values: list[float]) -> CellStats:
    rows = [{"seed": s, "recipe": {"seed": s}, "metrics": {"test_accuracy": v}} for s, v in enumerate(values)]
    return CellStats("t", label, rows)


def _seeds_with_mean(target: float) -> list[float]:
    """Three seeds spread around ``target`` whose mean is ``target`` up to rounding."""
    spread = 0.05 * float(torch.rand(()))
    return [target - spread, target + spread / 2, target + spread / 2]


def _exact_mean(values: list[float]) -> Fraction:
    return sum(Fraction(v) for v in values) / len(values)


def _gap() -> float:
    """A relative distance from the threshold: none (on it) or between a millionth and a hundredth, either way."""
    if float(torch.rand(())) < 0.2:
        return 0.0
    size = 10 ** (-6 + 4 * float(torch.rand(())))
    return size if float(torch.rand(())) < 0.5 else -size


def _expected(op: str, left: Fraction, right: Fraction, on: bool) -> bool:
    """Exact arithmetic; on the threshold the two sides are equal (their difference is rounding)."""
    return OPS[op](0, 0) if on else OPS[op](left, right)


def test_a_mean_near_a_number_gets_the_exact_outcome():
    for _ in range(200):
        threshold = 0.2 + 0.7 * float(torch.rand(()))
        gap, op = _gap(), list(OPS)[int(torch.randint(0, len(OPS), ()))]
        values = _seeds_with_mean(threshold * (1 + gap))
        cond = Condition.parse(f"a.test_accuracy {op} {threshold!r}", "test")
        got = evaluate(cond, {"a": _cell("a", values)}).holds
        assert got == _expected(op, _exact_mean(values), Fraction(threshold), gap == 0), (op, threshold, values)


def test_a_mean_near_another_cell_plus_an_offset_gets_the_exact_outcome():
    for _ in range(200):
        base = 0.4 + 0.5 * float(torch.rand(()))
        offset = round(0.3 * float(torch.rand(())), 3)
        sign = "+" if float(torch.rand(())) < 0.5 else "-"
        right_target = base + offset if sign == "+" else base - offset
        gap, op = _gap(), list(OPS)[int(torch.randint(0, len(OPS), ()))]
        a, b = _seeds_with_mean(right_target * (1 + gap)), _seeds_with_mean(base)
        cond = Condition.parse(f"a.test_accuracy {op} b.test_accuracy {sign} {offset!r}", "test")
        got = evaluate(cond, {"a": _cell("a", a), "b": _cell("b", b)}).holds
        right = _exact_mean(b) + (Fraction(offset) if sign == "+" else -Fraction(offset))
        assert got == _expected(op, _exact_mean(a), right, gap == 0), (op, a, b, sign, offset)
