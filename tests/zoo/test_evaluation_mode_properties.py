"""Evaluation reads a model in evaluation mode and hands it back in the mode it found it in: a stand-in model
whose logits depend on ``model.training`` must give exactly the hand-computed metrics of its evaluation-mode
logits, from ``evaluate_data`` (loss, accuracy) and ``text_metrics`` (bits per byte)."""
import math

import pytest
import torch
import torch.nn.functional as F

from zoo.tasks import TaskData
from zoo.training.evaluation import evaluate_data, text_metrics

CPU = torch.device("cpu")


class ModeDependentLogits(torch.nn.Module):
    """Logits are row ``ids[t]`` of ``eval_table`` in evaluation mode and of ``train_table`` in training mode."""

    def __init__(self, eval_table, train_table):
        super().__init__()
        self.eval_table, self.train_table = eval_table, train_table
        self.modes = []

    def forward(self, ids, mask=None):
        self.modes.append(self.training)
        return (self.train_table if self.training else self.eval_table)[ids]


def _setup(V=6, rows=5, T=7):
    eval_table = torch.randn(V, V, dtype=torch.float64)
    model = ModeDependentLogits(eval_table, -eval_table)  # training mode predicts the opposite
    ids = torch.randint(V, (rows, T + 1))
    return model, eval_table, TaskData(ids[:, :-1], ids[:, 1:])


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_data_reads_the_evaluation_mode_and_restores_the_mode(training):
    model, table, data = _setup()
    model.train(training)
    got = evaluate_data(model, data, 2, CPU)
    logits = table[data.inputs]
    loss = F.cross_entropy(logits.flatten(0, 1), data.labels.flatten()).item()
    accuracy = (logits.float().argmax(-1) == data.labels).double().mean().item()
    assert got["loss"] == pytest.approx(loss, rel=1e-6)  # the loss is taken in float32
    assert got["accuracy"] == pytest.approx(accuracy, rel=1e-12)
    assert model.modes and not any(model.modes)
    assert model.training == training


@pytest.mark.parametrize("training", [True, False])
def test_text_metrics_read_the_evaluation_mode_and_restore_the_mode(training):
    model, table, data = _setup()
    model.train(training)
    token_bytes = torch.randint(1, 4, (table.shape[0],))
    got = text_metrics(model, data, token_bytes, 2, CPU)
    logits = table[data.inputs]
    nats = F.cross_entropy(logits.flatten(0, 1), data.labels.flatten(), reduction="sum").item()
    assert got["bpb"] == pytest.approx(nats / math.log(2) / token_bytes[data.labels].sum().item(), rel=1e-12)
    assert model.modes and not any(model.modes)
    assert model.training == training
