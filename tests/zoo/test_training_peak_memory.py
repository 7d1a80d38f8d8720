"""``peak_memory_mib`` is the training peak: what the periodic evaluations hold on the device is not counted (the
peak counter is read before each evaluation and reset after it), what the training steps hold is, including the
steps after the last evaluation. The device's counter is stood in for by one whose allocations the test makes, with
CUDA's semantics (the peak since the last reset; a reset sets it to what is held now)."""
import torch

from zoo import train
from zoo.recipes import resolve
from zoo.training import loop

from .test_train import TINY

MIB = 2**20


class FakeCounter:
    def __init__(self):
        self.held = self.peak = 0

    def hold(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def reset(self) -> None:
        self.peak = self.held


def test_the_training_peak_leaves_out_periodic_evaluations_and_keeps_every_step(monkeypatch):
    steps, every = int(torch.randint(7, 11, ())), 3
    step_mib = torch.randint(10, 50, (steps,)).tolist()  # a transient of each step, freed at its end
    eval_mib = int(torch.randint(500, 900, ()))          # an evaluation holds far more than any step
    counter, done = FakeCounter(), []
    monkeypatch.setattr(loop, "peak_counter", lambda device: (lambda: counter.peak, counter.reset))
    real_step, real_evaluate = loop._step, loop.evaluate_data

    def step(run, state, *args):
        counter.hold(step_mib[len(done)] * MIB)
        counter.hold(-step_mib[len(done)] * MIB)
        done.append(1)
        return real_step(run, state, *args)

    def evaluate(*args, **kwargs):
        counter.hold(eval_mib * MIB)
        counter.hold(-eval_mib * MIB)
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(loop, "_step", step)
    monkeypatch.setattr(loop, "evaluate_data", evaluate)
    recipe = resolve(TINY, [f"train.steps={steps}", f"train.eval_every={every}"])
    result = train(recipe, progress=False)
    assert len(done) == steps and sum(1 for h in result.history if "test_accuracy" in h) == (steps - 1) // every
    assert result.metrics["peak_memory_mib"] == max(step_mib)
