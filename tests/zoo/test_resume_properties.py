"""Resuming a run from its saved state (zoo.training.state.TrainState): every random stream a model or task
may draw from (torch's, Python's ``random``, NumPy's global generator) continues after ``load_state_dict``
exactly as it would have continued at ``state_dict``, whatever was drawn in between."""
import random

import numpy as np
import torch

from zoo.model import HybridLM
from zoo.recipes import resolve
from zoo.training.state import TrainState

from .test_train import TINY

CPU = torch.device("cpu")


def _state():
    recipe = resolve(TINY, ["model.d_model=16", "model.layers=[attention]", "model.mixer_options={attention: {n_heads: 2}}"])
    model = HybridLM.from_recipe(recipe, vocab_size=32)
    return TrainState.fresh(recipe, model, 64, "fp32", CPU)


def _draws():
    return torch.rand(5).tolist(), [random.random() for _ in range(5)], np.random.rand(5).tolist()


def test_loading_a_saved_state_restores_every_global_random_stream():
    state = _state()
    torch.rand(int(torch.randint(1, 50, ())))  # wherever the streams happen to be at the save
    random.seed(int(torch.randint(1 << 30, ())))
    np.random.seed(int(torch.randint(1 << 30, ())))
    saved = state.state_dict()
    expected = _draws()
    for _ in range(3):  # the streams move on (other runs, evaluations) before the resume
        _draws()
    torch.manual_seed(int(torch.randint(1 << 30, ())))
    resumed = _state()
    resumed.load_state_dict(saved)
    assert _draws() == expected
