"""The task contract: a seeded generator of ``(inputs, labels, mask)`` token tensors.

``labels`` is ``-100`` wherever nothing is supervised (the loss and the accuracy ignore it);
``mask`` is an optional ``(N, T)`` 0/1 prefix or "action" mask for mixers that use one (e.g. SKA's
prefix statistics). ``split`` selects disjoint seed streams for train and test, so the same recipe
seed always yields the same data.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

import torch

from mixers.base import Registry


@dataclass
class TaskData:
    inputs: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def batch(self, index: torch.Tensor | slice) -> "TaskData":
        return TaskData(self.inputs[index], self.labels[index], None if self.mask is None else self.mask[index])

    def to(self, device, non_blocking: bool = False) -> "TaskData":
        """On ``device``; ``non_blocking``: to CUDA through pinned memory, without waiting for the copy (nor for
        the work queued before it)."""
        pin = non_blocking and torch.device(device).type == "cuda"

        def move(t):
            return (t.pin_memory() if pin else t).to(device, non_blocking=pin)
        return TaskData(move(self.inputs), move(self.labels), None if self.mask is None else move(self.mask))


SPLIT_OFFSET = {"train": 1, "test": 2}
#: below this length the seed of a stream is ``seed * 1_000_003 + SPLIT_OFFSET[split] * 7919 + seq_len``
LINEAR_SEED_LENGTHS = 7919
#: the low bits of a seed that torch's CPU generator reads (its Mersenne Twister is keyed on 32 bits: seeds that
#: agree in them draw the same numbers)
GENERATOR_KEY_BITS = 32
#: keys per split for the lengths from :data:`LINEAR_SEED_LENGTHS` on (every length a task or ``eval.seq_lens``
#: allows, at most ``1 << 22``, has its own)
LONG_LENGTH_KEYS = 1 << 22


def stream_seed(seed: int, split: str, seq_len: int) -> int:
    """The generator seed of the data stream ``(seed, split, seq_len)``: within one seed, every ``(split, length)``
    has its own generator key (the low :data:`GENERATOR_KEY_BITS` bits, all that the generator reads).

    Below :data:`LINEAR_SEED_LENGTHS` tokens it is the linear form above (every table's data was drawn with it);
    its keys of one seed lie in ``seed * 1_000_003 + [7920, 3 * 7919)``. From there on the linear form would meet
    another split's stream (train at ``L + 7919`` is test at ``L``), so each split's longer lengths take the next
    block of :data:`LONG_LENGTH_KEYS` keys after that range (modulo ``2**32``), with the seed in the bits above:
    a run's train, test and every test length never share a stream. Different seeds can meet at other splits or
    lengths (32 bits cannot hold every triple: seeds 94,489 apart do at lengths 2,955 apart)."""
    if seq_len < LINEAR_SEED_LENGTHS:
        return seed * 1_000_003 + SPLIT_OFFSET[split] * 7919 + seq_len
    block = 3 * 7919 + (SPLIT_OFFSET[split] - 1) * LONG_LENGTH_KEYS + (seq_len - LINEAR_SEED_LENGTHS)
    key = (seed * 1_000_003 + block) % (1 << GENERATOR_KEY_BITS)
    return (seed << GENERATOR_KEY_BITS) | key


class Task(abc.ABC):
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type]

    def __init__(self, options):
        self.options = options

    @staticmethod
    def from_spec(spec) -> "Task":
        """The task a resolved spec (``recipe.task``, an ``eval.tasks`` entry) names, built from its options."""
        return TASKS.get(spec.name)(spec.options)

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Token ids used by inputs and labels (the model's embedding size)."""

    @property
    def seq_len(self) -> int:
        return self.options.seq_len

    def num_examples(self, split: str) -> int:
        return self.options.num_train if split == "train" else self.options.num_test

    def check_length(self, seq_len: int) -> None:  # noqa: B027 - no minimum length unless a task has one
        """Raise ValueError naming the problem if sequences of ``seq_len`` cannot be generated (a task
        with a minimum length overrides this; it is checked when a recipe is validated)."""

    @abc.abstractmethod
    def generate(self, num_examples: int, seq_len: int, generator: torch.Generator) -> TaskData:
        """``num_examples`` sequences of length ``seq_len`` drawn with ``generator``."""

    def make(self, split: str, seed: int, seq_len: int | None = None, num_examples: int | None = None) -> TaskData:
        if split not in SPLIT_OFFSET:
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        seq_len = seq_len or self.seq_len
        generator = torch.Generator().manual_seed(stream_seed(seed, split, seq_len))
        return self.generate(num_examples or self.num_examples(split), seq_len, generator)


TASKS = Registry("task", {}, "register_task", Task)


def register_task(cls):
    return TASKS.add(cls)
