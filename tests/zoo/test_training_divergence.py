"""A run whose weights stop being finite stops there: it says at which step, the metrics record
``diverged_at_step`` and count only the updates that ran, the final evaluation reads the diverged model, a resume
of its checkpoint trains nothing more, and the results table shows the column. A non-finite loss with finite
weights (what an fp16 overflow the gradient scaler skips looks like) trains on to the last step."""
import math
import random

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from zoo import train
from zoo.experiments.results import table_columns
from zoo.recipes import resolve
from zoo.training import loop

from .test_train import TINY


class _PoisonAfter:
    """Counts AdamW updates and fills every weight with NaN after update ``k``."""

    def __init__(self, k: int):
        self.k, self.updates = k, 0

    def __call__(self, optimizer, args, kwargs):
        self.updates += 1
        if self.updates == self.k:
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.fill_(float("nan"))


def _train_poisoned(recipe, k: int, **kwargs):
    poison = _PoisonAfter(k)
    handle = register_optimizer_step_post_hook(poison)
    try:
        return train(recipe, progress=False, **kwargs), poison
    finally:
        handle.remove()


def test_a_run_whose_weights_turn_nan_stops_and_records_the_step(capsys):
    steps, k = 12, random.randint(2, 6)
    recipe = resolve(TINY, [f"train.steps={steps}", "train.eval_every=0", "train.checkpoint_every=0"])
    result, poison = _train_poisoned(recipe, k)
    m = result.metrics
    # update k poisons the weights, so step k + 1 is the first whose loss reads NaN
    assert m["diverged_at_step"] == k + 1
    # every update that ran is counted, and the run stopped long before its last step
    assert m["steps"] == poison.updates and k + 1 <= poison.updates <= k + 2 < steps
    assert math.isnan(m["test_loss"]) and math.isnan(m["train_loss"])
    err = capsys.readouterr().err
    assert f"diverged at step {k + 1}/{steps}" in err and "train.lr" in err


def test_a_resumed_diverged_run_trains_nothing_more(tmp_path):
    recipe = resolve(TINY, ["train.steps=10", "train.eval_every=0", "train.checkpoint_every=2"])
    first, poison = _train_poisoned(recipe, 3, checkpoint_dir=tmp_path)
    again, poison_again = _train_poisoned(recipe, 3, checkpoint_dir=tmp_path)
    assert poison_again.updates == 0
    assert again.metrics["diverged_at_step"] == first.metrics["diverged_at_step"] == 4
    assert again.metrics["steps"] == first.metrics["steps"] == poison.updates


def test_a_nonfinite_loss_with_finite_weights_trains_to_the_last_step(monkeypatch, capsys):
    steps, bad = 8, random.randint(1, 6)
    read = loop._read
    calls = []

    def read_with_one_nan(run, queued):
        loss, accuracy = read(run, queued)
        calls.append(loss)
        return (float("nan") if len(calls) == bad else loss), accuracy

    monkeypatch.setattr(loop, "_read", read_with_one_nan)
    recipe = resolve(TINY, [f"train.steps={steps}", "train.eval_every=0", "train.checkpoint_every=0"])
    m = train(recipe, progress=False).metrics
    assert m["steps"] == steps and "diverged_at_step" not in m
    assert math.isfinite(m["test_loss"])
    assert "diverged" not in capsys.readouterr().err


def test_the_results_table_shows_where_a_run_diverged():
    row = {"label": "a", "recipe": {"model": {"layers": ["attention"]}, "seed": 0},
           "metrics": {"test_accuracy": 0.5, "params": 10, "state_size": 4, "steps": 7, "train_seconds": 1.0}}
    diverged = {**row, "label": "b", "metrics": {**row["metrics"], "diverged_at_step": 5}}
    assert "diverged_at_step" not in table_columns([row])
    columns = table_columns([row, diverged])
    assert columns.index("diverged_at_step") == columns.index("steps") + 1
