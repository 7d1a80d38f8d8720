"""``zoo.config`` against expectations written out here: a pattern's layers are named by their place in the
pattern (``model.pattern.<i mod len>``) where a refusal blames the key that built them, and
``train.warmup_steps`` may equal ``train.steps`` but not exceed it."""
from __future__ import annotations

import pytest
import torch

from zoo.config import ModelConfig, TrainConfig


def test_a_pattern_layer_is_named_by_its_place_in_the_pattern():
    names = ["a", "b", "c", "d"]
    length = int(torch.randint(1, 4, ()))
    n_layers = length + int(torch.randint(1, 7, ()))
    pattern = [names[i] if i % 2 else {names[i]: {"width": i + 1}} for i in range(length)]
    keys = ModelConfig(pattern=pattern, n_layers=n_layers).layer_option_keys()
    expected = []
    for i in range(n_layers):
        j = i % length
        expected.append(f"model.pattern.{j}" if j % 2 else f"model.pattern.{j}.{names[j]}")
    assert [key for key, _note in keys] == expected


def test_warmup_may_reach_the_step_count_but_not_pass_it():
    steps = int(torch.randint(1, 500, ()))
    assert TrainConfig(steps=steps, warmup_steps=steps).warmup_steps == steps
    with pytest.raises(ValueError, match=rf"warmup_steps \({steps + 1}\) exceeds train.steps \({steps}\)"):
        TrainConfig(steps=steps, warmup_steps=steps + 1)
