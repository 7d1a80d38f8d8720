"""Registered state-tracking tasks (parity, S3/S5/A5 word problems, Dyck-1) over the generators of
:mod:`zoo.tasks.state_tracking`. Test at longer lengths with ``eval.seq_lens`` for length
generalisation.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from mixers.options import opt

from . import state_tracking as st
from .base import Task, TaskData, register_task


@dataclass
class _Common:
    seq_len: int = opt(64, "training sequence length", at_least=1, at_most=1 << 22)
    num_train: int = opt(20_000, "training examples", at_least=1, at_most=10_000_000)
    num_test: int = opt(1_000, "test examples", at_least=1, at_most=10_000_000)
    supervise: str = opt("all", "label every position or only the last", choices=("all", "last"))


class _StateTask(Task):
    #: the generator of :mod:`zoo.tasks.state_tracking` this task draws from
    generator = staticmethod(st.parity)

    def _generator_options(self) -> dict:
        skip = {"seq_len", "num_train", "num_test"}
        return {k: v for k, v in vars(self.options).items() if k not in skip}

    def generate(self, num_examples, seq_len, generator) -> TaskData:
        inputs, labels = self.generator(num_examples, seq_len, generator, **self._generator_options())
        return TaskData(inputs, labels)


@register_task
class Parity(_StateTask):
    name = "parity"
    description = "running parity of a bit string (needs negative eigenvalues / non-diagonal state)"
    generator = staticmethod(st.parity)
    vocab_size = 2

    @dataclass
    class Options(_Common):
        p_one: float = opt(0.5, "probability of a 1 bit", at_least=0.0, at_most=1.0)


def _group_task(group: str, blurb: str):
    @register_task
    class WordProblem(_StateTask):
        name = group
        description = f"{group.upper()} word problem: inputs are group elements, label = running product ({blurb})"
        generator = staticmethod(functools.partial(st.word_problem, group=group))
        vocab_size = len(st.group_elements(group))

        @dataclass
        class Options(_Common):
            pass

    WordProblem.__name__ = WordProblem.__qualname__ = f"{group.upper()}WordProblem"
    return WordProblem


S3 = _group_task("s3", "6 elements, solvable")
S4 = _group_task("s4", "24 elements, solvable")
S5 = _group_task("s5", "120 elements, not solvable")
A5 = _group_task("a5", "60 elements, simple")


@register_task
class Dyck1(_StateTask):
    name = "dyck1"
    description = "Dyck-1 counting: label = nesting depth (or 'balanced') after each bracket"
    generator = staticmethod(st.dyck1)

    @dataclass
    class Options(_Common):
        p_open: float = opt(0.5, "probability of '(' when both brackets are allowed", at_least=0.0, at_most=1.0)
        max_depth: int = opt(16, "the depth never exceeds this", at_least=1)
        label: str = opt("depth", "what to predict", choices=("depth", "balanced"))

    @property
    def vocab_size(self) -> int:
        return st.dyck1_vocab_size(self.options.max_depth, self.options.label)
