"""What a resumed process takes over from a checkpoint written mid-run (zoo.training.state): the training seconds
add up over the processes (the checkpoint holds the earlier processes' seconds plus this one's so far, and the
resumed process goes on from that sum; time is a hand-advanced clock here, never measured), and fp16 training's
gradient scaler goes on with the factor and the count of overflow-free steps it had reached."""
import types

import pytest
import torch

from zoo.model import HybridLM
from zoo.recipes import resolve
from zoo.training import state as state_module
from zoo.training.state import TrainState

from .test_train import TINY


class Clock:
    def __init__(self):
        self.now = float(torch.randint(0, 10**6, ()).item())

    def __call__(self):
        return self.now


def _fresh(recipe, precision="fp32") -> TrainState:
    model = HybridLM.from_recipe(recipe, vocab_size=12)
    return TrainState.fresh(recipe, model, 64, precision, torch.device("cpu"))


def test_a_checkpoint_written_mid_run_carries_every_process_seconds_so_far(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(state_module, "time", types.SimpleNamespace(perf_counter=clock))
    recipe = resolve(TINY, ["train.steps=6"])
    earlier, first, second = (float(torch.empty(()).uniform_(1, 100)) for _ in range(3))

    running = _fresh(recipe)
    running.elapsed_before, running.started = earlier, clock.now  # a process resumed after ``earlier`` seconds
    clock.now += first
    saved = running.state_dict()
    assert saved["elapsed"] == pytest.approx(earlier + first)

    clock.now += 1000.0  # time between the processes is no training time
    resumed = _fresh(recipe)
    resumed.load_state_dict(saved)
    clock.now += second
    assert resumed.elapsed == pytest.approx(earlier + first + second)
    resumed.stop_clock()
    clock.now += 1000.0  # the final evaluation, after the clock stopped
    assert resumed.summary()["train_seconds"] == pytest.approx(earlier + first + second)


def test_the_fp16_gradient_scaler_resumes_with_its_factor_and_its_count_of_clean_steps():
    recipe = resolve(TINY, ["train.steps=6", "train.precision=fp16"])
    running = _fresh(recipe, "fp16")
    assert running.scaler.is_enabled()
    factor = float(2 ** int(torch.randint(3, 12, ())))
    clean = int(torch.randint(1, 4, ()))
    running.scaler.scale(torch.ones(()))  # the scaler allocates its factor on first use
    running.scaler.update(factor)
    for _ in range(clean):  # overflow-free steps count towards the next growth of the factor
        for p in running.model.parameters():
            p.grad = torch.zeros_like(p)
        running.scaler.step(running.optimizer)
        running.scaler.update()
    assert running.scaler.get_scale() == factor
    resumed = _fresh(recipe, "fp16")
    resumed.load_state_dict(running.state_dict())
    assert resumed.scaler.get_scale() == factor
    assert resumed.scaler.state_dict()["_growth_tracker"] == clean
