"""Learning curves worked out by hand: a row's curve starts at the untrained model, skips an evaluation whose loss
is not finite, and ends at the final evaluation even where training stopped between two periodic evaluations;
the curve of a cell with several seeds is their mean at exactly the token counts every seed has."""
from __future__ import annotations

import csv
import json
import math
import random

import pytest
import torch

from zoo.experiments.curves import curve, write_curves

BATCH, SEQ, EVERY = 4, 8, 10


def _row(rng: random.Random, key: str, seed: int, steps: int, not_finite_at: int | None = None) -> dict:
    evals = list(range(EVERY, steps + 1, EVERY))
    history = [{"step": s, "test_loss": math.nan if s == not_finite_at else rng.uniform(1, 3)} for s in evals]
    final = rng.uniform(1, 3)
    metrics = {"val_bpb": final * rng.uniform(1.3, 1.6), "test_loss": final, "steps": steps}
    return {"recipe_key": key, "label": "a", "seed": seed, "metrics": metrics, "history": history,
            "step0_metrics": {"val_bpb": rng.uniform(7, 8)},
            "recipe": {"seed": seed, "train": {"batch_size": BATCH}, "task": {"seq_len": SEQ},
                       "model": {"layers": ["attention"]}}}


def _points_by_hand(row: dict) -> dict[int, float]:
    bits_per_nat = row["metrics"]["val_bpb"] / row["metrics"]["test_loss"]
    points = {0: row["step0_metrics"]["val_bpb"]}
    for h in row["history"]:
        if h["test_loss"] == h["test_loss"]:  # NaN is not equal to itself
            points[h["step"] * BATCH * SEQ] = h["test_loss"] * bits_per_nat
    points[row["metrics"]["steps"] * BATCH * SEQ] = row["metrics"]["val_bpb"]
    return points


def test_a_curve_ends_at_the_last_step_and_a_cell_is_the_mean_at_the_tokens_all_seeds_have(tmp_path):
    rng = random.Random(torch.initial_seed())
    steps = [EVERY * rng.randint(2, 4) + rng.randint(1, EVERY - 1) for _ in range(2)]  # stopped between evaluations
    nan_at = EVERY * rng.randint(1, steps[0] // EVERY)
    rows = [_row(rng, "k0", 0, steps[0], not_finite_at=nan_at), _row(rng, "k1", 1, steps[1])]
    for row in rows:
        by_hand = _points_by_hand(row)
        drawn = curve(row)
        assert [t for t, _ in drawn] == sorted(by_hand)
        assert [b for _, b in drawn] == pytest.approx([by_hand[t] for t in sorted(by_hand)])
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_curves(tmp_path)
    with open(tmp_path / "curves.csv", newline="") as fh:
        lines = list(csv.DictReader(fh))
    hands = [_points_by_hand(r) for r in rows]
    shared = sorted(set(hands[0]) & set(hands[1]))
    assert nan_at * BATCH * SEQ not in shared and steps[0] * BATCH * SEQ in hands[0]
    assert [(x["cell"], int(x["tokens"])) for x in lines] == [("a", t) for t in shared]
    assert [float(x["val_bpb"]) for x in lines] == pytest.approx([(hands[0][t] + hands[1][t]) / 2 for t in shared],
                                                                 abs=1e-6)
