"""The training curve a run sends to its tracker (zoo.training.loop): each step's ``train/loss`` and
``train/accuracy`` are that step's own numbers (the first one recomputed here with torch from the initial model on
the first batch), ``train/loss_ema`` is their running average ``ema <- 0.95 * ema + 0.05 * x`` started at the first,
and each periodic evaluation logs the numbers the run's history holds at its step."""
import pytest
import torch

from zoo import train
from zoo.recipes import resolve
from zoo.training import loop

from .test_reported_training_numbers_properties import _first_step_by_hand
from .test_train import TINY


def test_the_tracker_gets_each_steps_own_numbers_and_their_running_average(monkeypatch):
    logged: dict[int, dict] = {}

    class Recorder:
        def log(self, step, values):
            logged.setdefault(step, {}).update(values)

        def close(self):
            pass

    real_read, per_step = loop._read, []

    def recording(run, queued):
        per_step.append(real_read(run, queued))
        return per_step[-1]

    monkeypatch.setattr(loop, "make_tracker", lambda *args, **kwargs: Recorder())
    monkeypatch.setattr(loop, "_read", recording)
    steps = int(torch.randint(4, 7, ()))
    recipe = resolve(TINY, [f"train.steps={steps}", "train.eval_every=2", "train.tracking=tensorboard",
                            f"seed={int(torch.randint(0, 1000, ()))}"])
    result = train(recipe, progress=False)

    first_loss, first_accuracy, _, _ = _first_step_by_hand(recipe)
    assert logged[1]["train/loss"] == pytest.approx(first_loss, rel=1e-5)
    assert logged[1]["train/accuracy"] == pytest.approx(first_accuracy, rel=1e-12, abs=1e-12)
    assert len(per_step) == steps
    ema = per_step[0][0]
    for step, (loss, accuracy) in enumerate(per_step, start=1):
        ema = loss if step == 1 else 0.95 * ema + 0.05 * loss
        assert logged[step]["train/loss"] == loss and logged[step]["train/accuracy"] == accuracy, step
        assert logged[step]["train/loss_ema"] == pytest.approx(ema, rel=1e-12), step
    assert len({round(loss, 9) for loss, _ in per_step}) > 1  # the steps' losses differ: a running average would not pass
    assert result.history and all(step % 2 == 0 and step < steps for step in (h["step"] for h in result.history))
    for entry in result.history:
        assert logged[entry["step"]]["test/loss"] == entry["test_loss"]
        assert logged[entry["step"]]["test/accuracy"] == entry["test_accuracy"]
