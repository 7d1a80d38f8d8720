"""The ledger's arithmetic against plain computations over the rows: a mean that equals a rule's threshold
meets it, ``@all`` against ``@all`` pairs length with length, a per-seed condition reads the same seeds on both
sides, metric names with a hyphen parse whole, the seed summary says how many seeds a value rests on, a
diverged seed shows in the min-max column, and a code change undone since a row leaves the row fresh."""
import math
import random
import subprocess
from fractions import Fraction

import pytest

from zoo.experiments.claims.cells import CellStats, num
from zoo.experiments.claims.conditions import Condition, evaluate, parse_term
from zoo.experiments.claims.errors import ClaimsError
from zoo.experiments.claims.render import _cell_rows
from zoo.experiments.claims.schema import Claim, load
from zoo.experiments.claims.verdicts import evaluate_claims
from zoo.experiments.freshness import code_changes
from zoo.experiments.results import seed_table

from .test_claims import _synthetic_root, _values


def _cell(label, per_seed: dict[int, dict], order: list[int] | None = None, keys: dict[int, str] | None = None):
    """A cell of table t: ``{seed: metrics}``, its rows written in ``order`` of seeds (default: as given); with
    ``keys`` (``{seed: recipe key}``, a missing seed keyed ``<label>-<seed>``) each row names its label and key."""
    rows = []
    for s in order if order is not None else per_seed:
        row = {"seed": s, "recipe": {"seed": s}, "metrics": dict(per_seed[s])}
        if keys is not None:
            row.update(label=label, recipe_key=keys.get(s, f"{label}-{s}"))
        rows.append(row)
    return CellStats("t", label, rows)


def _acc(values, seeds=None):
    return {s: {"test_accuracy": v} for s, v in zip(seeds or range(len(values)), values)}


def _exact_mean(values):
    """The mean of the values as the decimals they were written as, in exact arithmetic."""
    return sum(Fraction(repr(v)) for v in values) / len(values)


_EXACT = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b,
          "==": lambda a, b: a == b}


# ------------------------------------------------------------------------------------- rounding of means
def test_a_mean_at_its_threshold_meets_it_as_in_exact_arithmetic():
    """Three seeds at 0.95 have the mean 0.95: ``>= 0.95`` holds (it failed, shown as '0.950 >= 0.950')."""
    cells = {"a": _cell("a", _acc([0.95] * 3)), "b": _cell("b", _acc([0.9] * 3))}
    for text in ("a.test_accuracy >= 0.95", "a.test_accuracy >= b.test_accuracy + 0.05",
                 "b.test_accuracy <= a.test_accuracy - 0.05", "a.test_accuracy == 0.95"):
        outcome = evaluate(Condition.parse(text, "test"), cells)
        assert outcome.holds, (text, outcome.detail)
    assert not evaluate(Condition.parse("a.test_accuracy > 0.95", "test"), cells).holds
    rng = random.Random(random.getrandbits(32))  # from the test's seed: replayable
    for _ in range(300):   # fresh two-decimal accuracies, b exactly d below a on the mean
        d = rng.choice([0.01, 0.05, 0.1, 0.2, 0.3])
        a = [rng.randint(30, 100) / 100 for _ in range(3)]
        b = [round(x - d, 2) for x in a]
        t = rng.randint(1, 100) / 100
        cells = {"a": _cell("a", _acc(a)), "b": _cell("b", _acc(b)), "c": _cell("c", _acc([t] * 3))}
        ma, mb = _exact_mean(a), _exact_mean(b)
        for op in _EXACT:
            for text, left, right in ((f"a.test_accuracy {op} b.test_accuracy + {d}", ma, mb + Fraction(str(d))),
                                      (f"b.test_accuracy {op} a.test_accuracy - {d}", mb, ma - Fraction(str(d))),
                                      (f"c.test_accuracy {op} {t}", _exact_mean([t] * 3), Fraction(str(t))),
                                      (f"per seed: a.test_accuracy {op} b.test_accuracy + {d}", None, None)):
                if left is None:   # every seed, exactly
                    expected = all(_EXACT[op](Fraction(repr(x)), Fraction(repr(y)) + Fraction(str(d)))
                                   for x, y in zip(a, b))
                else:
                    expected = _EXACT[op](left, right)
                got = evaluate(Condition.parse(text, "test"), cells).holds
                assert got == expected, (text, a, b)


def test_a_verdict_on_seeds_exactly_at_the_threshold_is_reproduced(tmp_path):
    root = _synthetic_root(tmp_path, {"a": [0.95, 0.95, 0.95], "b": _values(3, 0.1)},
                           rule={"reproduced": ["a.test_accuracy >= 0.95"]})
    assert evaluate_claims(load(root), root)[0].verdict == "reproduced"


# ------------------------------------------------------------------------------------- @all against @all
def test_all_against_all_pairs_length_with_length_or_is_refused():
    """b has no test length: a's accuracy at 512 was compared with b's at the training length."""
    a_long, a_train, b_train = (random.uniform(0.1, 0.9) for _ in range(3))
    cells = {"a": _cell("a", {s: {"test_accuracy": a_train, "test_accuracy@512": a_long} for s in range(3)}),
             "b": _cell("b", {s: {"test_accuracy": b_train} for s in range(3)})}
    with pytest.raises(ClaimsError, match="different test lengths"):
        evaluate(Condition.parse("a.test_accuracy@all >= b.test_accuracy@all", "test"), cells)
    # two tasks at the same lengths are compared length by length (refused as 'different test lengths')
    per_seed = {s: {f"test_accuracy@task={t}{at}": random.random() for t in ("x", "y") for at in ("", "@64", "@128")}
                for s in range(3)}
    cells = {"a": _cell("a", per_seed)}
    outcome = evaluate(Condition.parse("a.test_accuracy@task=x@all >= a.test_accuracy@task=y@all", "test"), cells)
    mean = {k: sum(per_seed[s][k] for s in range(3)) / 3 for k in per_seed[0]}
    pairs = [(mean[f"test_accuracy@task=x{at}"], mean[f"test_accuracy@task=y{at}"]) for at in ("", "@64", "@128")]
    assert outcome.detail == ", ".join(f"{num(x)} >= {num(y)}" for x, y in pairs)
    assert outcome.holds == all(x >= y for x, y in pairs)


# ------------------------------------------------------------------------------------- per seed
def test_a_per_seed_condition_over_cells_with_different_seeds_is_refused():
    """a's seed 3 falls below b, but b has no seed 3: the condition held on seeds 0-2 alone."""
    a = [random.uniform(0.8, 0.9) for _ in range(3)] + [random.uniform(0.1, 0.2)]
    b = [random.uniform(0.4, 0.6) for _ in range(3)]
    cells = {"a": _cell("a", _acc(a)), "b": _cell("b", _acc(b))}
    assert not all(x >= 0.3 for x in a)                      # seed 3 of a does not hold against any b
    with pytest.raises(ClaimsError, match=r"seeds 0, 1, 2, 3.*seeds 0, 1, 2"):
        evaluate(Condition.parse("per seed: a.test_accuracy >= b.test_accuracy", "test"), cells)
    same = {"a": _cell("a", _acc(a[:3])), "b": cells["b"]}
    assert evaluate(Condition.parse("per seed: a.test_accuracy >= b.test_accuracy", "test"), same).holds
    # a per-seed condition on one cell, or on a cell and a number, reads that cell's seeds
    assert not evaluate(Condition.parse("per seed: a.test_accuracy >= 0.3", "test"), cells).holds


# ------------------------------------------------------------------------------------- metric names
def test_a_metric_name_with_a_hyphen_is_read_whole():
    """``val_loss@pos0-511`` was read as metric ``val_loss@pos0`` minus 511."""
    term = parse_term("a.val_loss@pos0-511", "test")
    assert (term.metric, term.offset) == ("val_loss@pos0-511", 0.0)
    term = parse_term("a.val_loss@pos512-1023 - 0.05", "test")
    assert (term.metric, term.offset) == ("val_loss@pos512-1023", -0.05)
    term = parse_term("a.test_accuracy@task=k4@64 + 0.1", "test")
    assert (term.metric, term.offset) == ("test_accuracy@task=k4@64", 0.1)
    early, late = [random.uniform(2, 3) for _ in range(3)], [random.uniform(1, 2) for _ in range(3)]
    cells = {"a": _cell("a", {s: {"val_loss@pos0-511": e, "val_loss@pos512-1023": x}
                              for s, (e, x) in enumerate(zip(early, late))})}
    outcome = evaluate(Condition.parse("a.val_loss@pos512-1023 <= a.val_loss@pos0-511 - 0.5", "test"), cells)
    assert outcome.holds == (sum(late) / 3 <= sum(early) / 3 - 0.5)
    assert outcome.detail == f"{num(sum(late) / 3)} <= {num(sum(early) / 3 - 0.5)}"


# ------------------------------------------------------------------------------------- rendering
def _row(label, seed, metrics):
    return {"label": label, "recipe": {"seed": seed, "model": {"layers": ["attention"]}},
            "metrics": {"test_accuracy": random.random(), "params": 10, "state_size": 4, "steps": 10, **metrics}}


def test_the_seed_summary_says_when_a_value_rests_on_fewer_seeds_than_the_cell_has():
    """A metric one seed of three has was shown as a bare number, like a value of every seed."""
    x, y, z = (random.random() for _ in range(3))
    rows = [_row("a", 0, {"test_accuracy@64": x}), _row("a", 1, {}), _row("a", 2, {}),
            _row("b", 0, {"test_accuracy@64": y}), _row("b", 1, {"test_accuracy@64": z}), _row("b", 2, {})]
    columns, body = seed_table(rows)
    at = columns.index("test_accuracy@64")
    assert body[0][at] == f"{x:.4f} (n=1)"
    mean, std = (y + z) / 2, abs(y - z) / math.sqrt(2)
    assert body[1][at] == f"{mean:.4f} ± {std:.4f} (n=2)"
    one = seed_table([_row("c", 0, {"test_accuracy@64": x}), _row("d", 0, {}), _row("d", 1, {})])[1]
    assert one[0][at] == f"{x:.4f}"                          # a one-seed cell: its value as it is


@pytest.mark.parametrize("diverged", [0, 1, 2])
def test_the_min_max_column_shows_a_diverged_seed_wherever_it_is(diverged):
    """min and max over a list with a NaN depend on where the NaN is: seed 0 gave 'nan-nan', seeds 1 and 2 hid it."""
    values = [random.uniform(0.2, 0.9) for _ in range(3)]
    values[diverged] = float("nan")
    claim = Claim({"show": []}, cells={"a": _cell("a", _acc(values))},
                  rule={"reproduced": [Condition.parse("a.test_accuracy >= 0.5", "test")]})
    line = _cell_rows(claim)[-1]
    cols = [c.strip() for c in line.strip("|").split("|")]
    assert cols[4] == "nan ± nan" and cols[5] == "nan-nan"
    assert cols[6] == ", ".join(num(v) for v in values)


# ------------------------------------------------------------------------------------- stale by code
def _git(root, *args):
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


def _commit_file(root, text):
    (root / "mixers" / "m.py").write_text(text)
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "m")
    return _git(root, "rev-parse", "HEAD")


def test_a_change_undone_since_the_row_is_no_change(tmp_path):
    """The code of a row's commit, changed and changed back since: the same code, so no change of the cell."""
    (tmp_path / "mixers").mkdir()
    _git(tmp_path, "init", "-q")
    k = random.randint(1, 9)
    row = _commit_file(tmp_path, f"def f(x):\n    return x + {k}\n")
    changed = _commit_file(tmp_path, f"def f(x):\n    return x * {k}\n")
    assert code_changes(tmp_path, row, "mixers/m.py") == [changed]
    _commit_file(tmp_path, f"def f(x):\n    '''the same code'''\n    return x + {k}\n")
    assert code_changes(tmp_path, row, "mixers/m.py") == []
    again = _commit_file(tmp_path, f"def f(x):\n    return x - {k}\n")
    assert code_changes(tmp_path, row, "mixers/m.py")[-1] == again
    (tmp_path / "mixers" / "m.py").write_text(f"def f(x):\n    return x + {k}  # as at the row\n")
    assert code_changes(tmp_path, row, "mixers/m.py") == []   # undone in the working tree

