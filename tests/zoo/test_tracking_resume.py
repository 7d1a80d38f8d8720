"""The training curve a tracker shows for a run killed after its last checkpoint and resumed: every step once,
with the values of an uninterrupted run (TensorBoard hides what the killed process logged past the checkpoint,
as its ``purge_step`` asks)."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from zoo import train
from zoo.recipes import resolve
from zoo.training import loop

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"


class Killed(Exception):
    pass


def fake_tensorboard(events: list, kill_at: list):
    """A ``torch.utils.tensorboard`` whose writers append ``(tag, step, value)`` to ``events`` and read back as
    TensorBoard does: a writer opened with ``purge_step=P`` hides every earlier event at a step >= P. A writer
    raises :class:`Killed` when asked to log ``train/loss`` at the step ``kill_at`` holds (then forgets it)."""

    class SummaryWriter:
        def __init__(self, log_dir=None, purge_step=None, **_):
            if purge_step is not None:
                events[:] = [e for e in events if e[1] < purge_step]

        def add_scalar(self, tag, value, step):
            if tag == "train/loss" and kill_at and step == kill_at[0]:
                kill_at.clear()
                raise Killed
            events.append((tag, step, value))

        def flush(self):
            pass

        def close(self):
            pass

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = SummaryWriter
    return module


def test_a_resumed_run_logs_every_step_once_with_the_uninterrupted_values(tmp_path, monkeypatch):
    steps, every = 12, 4
    killed_at = int(torch.randint(every + 1, 2 * every, ()))  # past the checkpoint at step 4, before the next
    events: list = []
    kill: list = []
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake_tensorboard(events, kill))
    seed = int(torch.randint(0, 1000, ()))
    recipe = resolve(TINY, [f"train.steps={steps}", f"train.checkpoint_every={every}", "train.eval_every=2",
                            "train.tracking=tensorboard", f"train.tracking_dir={tmp_path / 'tb'}", f"seed={seed}"])

    train(recipe, progress=False)
    uninterrupted = sorted(events)
    assert len({(tag, step) for tag, step, _ in uninterrupted}) == len(uninterrupted)

    events.clear()
    kill.append(killed_at)
    with pytest.raises(Killed):
        train(recipe, progress=False, checkpoint_dir=tmp_path / "run")
    assert max(step for tag, step, _ in events if tag == "train/loss") == killed_at - 1
    resumed_from = []
    real_make = loop.make_tracker
    monkeypatch.setattr(loop, "make_tracker", lambda *a, **k: resumed_from.append(k.get("resume_step")) or
                        real_make(*a, **k))
    train(recipe, progress=False, checkpoint_dir=tmp_path / "run")
    assert resumed_from == [every]
    assert sorted(events) == uninterrupted  # each step once, nothing lost at the checkpoint's step
