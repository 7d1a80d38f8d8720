"""A cell a claim lists in ``learned`` bears on the verdict even where no condition of the rule reads it: a seed
of it at the no-learning level makes the verdict inconclusive, and with fewer than three seeds (or none) the
verdict is not tested. Before, such a cell was checked and listed as not having learned, while the verdict
read "reproduced" on the other cells alone; a cell of it with no rows passed as learned."""
import torch

from zoo.experiments.claims import ledger
from zoo.experiments.claims.schema import load
from zoo.experiments.claims.verdicts import INCONCLUSIVE, MIN_SEEDS, evaluate_claims

from .test_claims import _synthetic_root

LEVEL = 0.0  # the synthetic tables' no-learning level
RULE = {"reproduced": ["a.test_accuracy >= b.test_accuracy + 0.2"]}


def _root(tmp_path, cells: dict[str, list[float]], claim: dict):
    """A repository whose claim reads a and b and names g among its cells."""
    return _synthetic_root(tmp_path, cells, rule=claim.pop("rule", RULE),
                           claim={"cells": {"a": "a", "b": "b", "g": "g"}, **claim})


def _accs(n, low, high):
    return (low + (high - low) * torch.rand(n)).tolist()


def _claim(root):
    return evaluate_claims(load(root), root)[0]


def test_a_learned_cell_that_no_condition_reads_makes_the_verdict_inconclusive_when_a_seed_did_not_learn(tmp_path):
    # a beats b by far on every seed; g, which the claim says must have learned, is at chance on one seed
    g = _accs(3, 0.6, 0.9)
    stuck = int(torch.randint(3, ()))
    g[stuck] = LEVEL + 0.02 * torch.rand(()).item()  # within the margin
    root = _root(tmp_path, {"a": _accs(3, 0.85, 0.95), "b": _accs(3, 0.3, 0.4), "g": g},
                 {"learned": ["g.test_accuracy"]})
    claim = _claim(root)
    assert [(u.alias, u.seed) for u in claim.unlearned] == [("g", stuck)]
    assert claim.verdict == INCONCLUSIVE
    outcome = claim.outcomes["reproduced"][0]
    assert outcome.holds and outcome.inconclusive == f"g seed {stuck} did not learn"
    assert f"-> inconclusive (g seed {stuck} did not learn)" in ledger.build(root)["CLAIMS.md"]
    # every seed of g learned: the rule decides
    root = _root(tmp_path / "learned", {"a": _accs(3, 0.85, 0.95), "b": _accs(3, 0.3, 0.4), "g": _accs(3, 0.6, 0.9)},
                 {"learned": ["g.test_accuracy"]})
    assert _claim(root).verdict == "reproduced"


def test_an_exploration_condition_is_not_made_inconclusive_by_a_learned_cell_it_does_not_read(tmp_path):
    g = [LEVEL] * 3
    root = _root(tmp_path, {"a": _accs(3, 0.85, 0.95), "b": _accs(3, 0.3, 0.4), "g": g},
                 {"learned": ["g.test_accuracy"],
                  "rule": {"reproduced": ["a.test_accuracy >= b.test_accuracy + 0.2"],
                           "exploration": ["a.test_accuracy >= 0.5"]}})
    claim = _claim(root)
    assert claim.verdict == INCONCLUSIVE
    assert claim.outcomes["exploration"][0].outcome == "holds"


def test_a_learned_cell_needs_as_many_seeds_as_a_cell_the_rule_reads(tmp_path):
    for n in range(MIN_SEEDS):
        root = _root(tmp_path / str(n), {"a": _accs(3, 0.85, 0.95), "b": _accs(3, 0.3, 0.4), "g": _accs(n, 0.6, 0.9)},
                     {"learned": ["g.test_accuracy"]})
        claim = _claim(root)
        assert claim.verdict == f"not tested ({n} seed{'s' * (n != 1)}; needs {MIN_SEEDS})", n
        # the rule's own cells have their rows: its conditions are still evaluated and shown
        assert claim.outcomes["reproduced"][0].holds
