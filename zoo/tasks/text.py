"""Tasks on real text: the streaming form of the task contract, and what text adds to it.

A :class:`TextTask` (the ``lm`` task) extends the task contract of :mod:`zoo.tasks.base` in four ways:

- :meth:`TextTask.train_data`: its training data is too large to generate up front, so it is a stream, an
  object with ``draw(n, generator) -> TaskData`` that the trainer calls once per step with its batch-order
  generator: the same seed draws the same batches, and a resumed run draws what the uninterrupted one would;
- :meth:`TextTask.check_layers`: next-token prediction is honest only with strictly causal layers;
- :meth:`TextTask.token_bytes`: the bytes of text each token stands for, for bits per byte;
- :meth:`TextTask.data_record`: facts about the corpus recorded with the metrics (its hash, its size).

Synthetic tasks are untouched: :func:`training_data` gives the trainer their whole generated training set,
and :func:`layer_problem` has nothing to say about their layers.
"""
from __future__ import annotations

import abc

import torch

from .base import Task


class TextTask(Task):
    """A task on real text (see the module docstring)."""

    @abc.abstractmethod
    def train_data(self, seed: int):
        """The stream training draws its batches from: ``draw(n, generator) -> TaskData``."""

    @abc.abstractmethod
    def check_layers(self, layers) -> tuple[int, str] | None:
        """``(layer index, problem)`` if a layer of the model (a list of :class:`zoo.config.Spec`) cannot be
        trained on this task honestly (a non-causal mixer on next-token prediction), else None."""

    @abc.abstractmethod
    def token_bytes(self) -> torch.Tensor:
        """``(vocab_size,)``: the bytes of text each token id stands for."""

    def data_record(self) -> dict:
        """Facts about the data to record with the metrics (e.g. the corpus hash)."""
        return {}


def training_data(task: Task, seed: int):
    """What training draws from: a text task's stream, else the task's generated training set."""
    return task.train_data(seed) if isinstance(task, TextTask) else task.make("train", seed)


def layer_problem(task: Task, layers) -> tuple[int, str] | None:
    """``(layer index, problem)`` where a text task refuses a layer; None for every other task."""
    return task.check_layers(layers) if isinstance(task, TextTask) else None

