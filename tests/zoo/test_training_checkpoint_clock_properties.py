"""Writing the periodic checkpoints of a run stops the throughput clocks: the steady rate and the warm-up's time
count the training steps only, however long the writes take. Time is a hand-advanced clock here (each step one
second, the first one a compile's worth, each checkpoint write many seconds), never measured."""
import pytest
import torch

from zoo.recipes import resolve
from zoo.tasks import Task
from zoo.training import checkpoint as ckpt
from zoo.training import loop, throughput
from zoo.training.throughput import warmup_steps

from .test_train import TINY


class Clock:
    def __init__(self):
        self.now = float(torch.randint(0, 10**6, ()).item())

    def __call__(self):
        return self.now


def test_periodic_checkpoint_writes_stay_out_of_both_throughput_clocks(monkeypatch, tmp_path):
    clock = Clock()
    monkeypatch.setattr(throughput, "clock", clock)
    steps, every = int(torch.randint(8, 12, ())), int(torch.randint(2, 4, ()))
    recipe = resolve(TINY, [f"train.steps={steps}", f"train.checkpoint_every={every}", "train.eval_every=0",
                            "train.threads=1"])
    compile_seconds, write_seconds = 40.0 + float(torch.rand(())), 300.0 + float(torch.rand(()))
    real_step, real_save = loop._step, ckpt.save
    queued, writes = [], []

    def step(run, state, *args):
        clock.now += 1.0 if queued else compile_seconds
        queued.append(state.step)
        return real_step(run, state, *args)

    def save(path, state):
        clock.now += write_seconds
        writes.append(state["step"])
        return real_save(path, state)

    monkeypatch.setattr(loop, "_step", step)
    monkeypatch.setattr(ckpt, "save", save)
    m = loop.train(recipe, progress=False, checkpoint_dir=tmp_path).metrics
    # every periodic write before the last step, then the final one
    assert writes == [k for k in range(every, steps, every)] + [steps, steps]
    warm = warmup_steps(steps)
    tokens = recipe.train.batch_size * Task.from_spec(recipe.task).seq_len
    assert m["steady_steps"] == steps - warm
    assert m["warmup_seconds"] == pytest.approx(compile_seconds + warm - 1)
    assert m["steady_tokens_per_second"] == pytest.approx(tokens)  # one step per (fake) second
