"""The GPU speed run's language-model row: tokens/s come from the steady-state window the plan asks for
(``lm_warmup`` steps left out, then up to ``lm_steps`` timed) with every token of a step counted
(``batch * T``, the plan's tokens per step), and the row reports that window's rate and steps as measured."""
import dataclasses

import torch

from zoo.benchmark import gpu_speed
from zoo.benchmark.device_time import Breakdown
from zoo.benchmark.gpu_speed import DRY
from zoo.benchmark.train_rate import Rate


def test_the_lm_row_asks_for_the_plan_window_and_counts_every_token(monkeypatch):
    warmup, steps = int(torch.randint(1, 5, ())), int(torch.randint(5, 9, ()))
    T = int(DRY.lm_lengths[int(torch.randint(0, len(DRY.lm_lengths), ()))])
    batch = int(torch.randint(2, 5, ()))
    plan = dataclasses.replace(DRY, lm_warmup=warmup, lm_steps=steps, lm_tokens=batch * T)
    seconds = 10 + 50 * float(torch.rand(()))
    asked = []
    rate = Rate(float(torch.rand(())) * 1e5, warmup, float(torch.rand(())), steps, float(torch.rand(())) + 0.1)

    def recorded(step, tokens_per_step, device, warmup_steps, timed_steps, budget=None):
        asked.append((tokens_per_step, warmup_steps, timed_steps, budget))
        step()  # one real step: the model, optimizer and batch are wired together
        return rate

    monkeypatch.setattr(gpu_speed, "steady_rate", recorded)
    monkeypatch.setattr(gpu_speed, "breakdown", lambda step, device: Breakdown(3, 1.0, []))
    monkeypatch.setattr(gpu_speed, "host_issue", lambda step, device: {"host_ms": 1.0, "syncs": None})
    row = gpu_speed.lm_rate(plan, "attention", T, seconds)
    assert asked == [(batch * T, warmup, steps, seconds / 2)]
    assert row["batch"] == batch
    assert row["tokens_per_second"] == rate.tokens_per_second
    assert (row["warmup_steps"], row["timed_steps"]) == (warmup, steps)
