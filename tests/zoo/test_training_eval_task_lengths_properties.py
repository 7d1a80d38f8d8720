"""The ``eval.tasks`` metrics of a run (zoo.training.evaluation.eval_task_metrics): ``test_accuracy@task=<label>``
is the accuracy on the task's own length and ``test_accuracy@task=<label>@<L>`` on examples of length ``L``, each
checked against its closed form: a stand-in model that predicts the successor of a token, on a task whose first
``RIGHT`` positions are labelled with the successor and every later one with another token, is right on
``min(RIGHT, L) / L`` of the positions of an example of length ``L``."""
import types

import pytest
import torch

from zoo.tasks import TaskData
from zoo.training import evaluation

from .test_training_final_evaluation_properties import TokenLogits

CPU = torch.device("cpu")
V, OWN_LENGTH, RIGHT = 7, 5, 3


class PrefixTask:
    """Random inputs of whatever length asked for; the label is the successor ``(x + 1) mod V`` at the first
    ``RIGHT`` positions and ``(x + 2) mod V`` after them, every position supervised."""

    seq_len = OWN_LENGTH

    def make(self, split, seed, seq_len=None):
        length = seq_len or self.seq_len
        inputs = torch.randint(V, (int(torch.randint(3, 9, ())), length))
        shift = torch.where(torch.arange(length) < RIGHT, 1, 2)
        return TaskData(inputs, (inputs + shift) % V)


def test_each_eval_task_is_scored_at_its_own_length_and_at_each_evaluation_length(monkeypatch):
    table = torch.randn(V, V, dtype=torch.float64)
    table[torch.arange(V), (torch.arange(V) + 1) % V] += 10.0  # predicts the successor
    monkeypatch.setattr(evaluation.Task, "from_spec", staticmethod(lambda spec: PrefixTask()))
    lengths = sorted({int(n) for n in torch.randint(OWN_LENGTH + 1, 16, (2,))})
    recipe = types.SimpleNamespace(seed=int(torch.randint(0, 100, ())), eval_tasks=[("prefix", object())],
                                   eval=types.SimpleNamespace(batch_size=int(torch.randint(1, 5, ())),
                                                              seq_lens=lengths, test_time={}))
    metrics = evaluation.eval_task_metrics(TokenLogits(table), recipe, CPU, "fp32")
    assert metrics["test_accuracy@task=prefix"] == pytest.approx(RIGHT / OWN_LENGTH, rel=1e-12)
    for length in lengths:
        assert metrics[f"test_accuracy@task=prefix@{length}"] == pytest.approx(RIGHT / length, rel=1e-12), length
    assert len(metrics) == 1 + len(lengths)
