"""The task contract: a seeded generator of ``(inputs, labels, mask)`` token tensors.

``labels`` is ``-100`` wherever nothing is supervised (the loss and the accuracy ignore it);
``mask`` is an optional ``(N, T)`` 0/1 prefix or "action" mask for mixers that use one (e.g. SKA's
prefix statistics). ``split`` selects disjoint seed streams for train and test, so the same recipe
seed always yields the same data.

The contract is checked where a task meets the zoo, so that a task that breaks it is refused in one line naming
the task and the rule (``zoo check``'s trial draw, or the first data training makes), not as a traceback at
some training step: :func:`register_task` refuses a class that leaves an abstract member out, an option without
a default, or no ``seq_len`` / ``num_train`` / ``num_test`` to read; every subclass's ``generate`` is wrapped
(:func:`checked_generate`) so that what it returns is a :class:`TaskData` of ``(num_examples, seq_len)`` torch.long
tokens in ``[0, vocab_size)``, labels there or ``-100``, at least one supervised position, a mask of that shape
if any, and, for a small draw (``zoo check``'s), the same data again from the same generator state.
"""
from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
from dataclasses import dataclass
from typing import ClassVar

import torch

from mixers.base import Registry

from ..errors import UserError


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


#: the label of a position nothing is supervised at (the loss and the accuracy ignore it)
IGNORE_INDEX = -100
#: a draw of at most this many tokens (``zoo check``'s trial draw is one sequence) is made a second time from the
#: same generator state and must repeat: a task drawing from another source of randomness is refused there
REPEATED_DRAW_TOKENS = 1 << 14
#: a draw without a supervised position is refused when this many examples drawn at its length have none either
#: (a small draw of a task that supervises some examples only may legitimately have none)
SUPERVISION_PROBE_EXAMPLES = 256


def _refuse(task, rule: str):
    raise UserError(f"task {task.name!r} ({type(task).__module__}.{type(task).__qualname__}): {rule}")


def check_task_data(task, data, num_examples: int, seq_len: int) -> None:
    """Refuse ``data`` that ``task.generate(num_examples, seq_len, ...)`` returned if its types, shapes or token
    ranges break the contract (see the module docstring), with a :class:`zoo.errors.UserError` naming the task,
    the rule and the fix."""
    call = f"generate({num_examples}, {seq_len}, generator)"
    if not isinstance(data, TaskData):
        _refuse(task, f"{call} returned a {type(data).__name__}; return TaskData(inputs, labels, mask)")
    for what in ("inputs", "labels"):
        t = getattr(data, what)
        if not isinstance(t, torch.Tensor) or t.dtype != torch.long:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            _refuse(task, f"{call} returned {what} of type {got}; token ids are torch.long tensors (.long())")
        if tuple(t.shape) != (num_examples, seq_len):
            _refuse(task, f"{call} returned {what} of shape {tuple(t.shape)}; it must be (num_examples, seq_len) = "
                          f"{(num_examples, seq_len)}, one row per example of the length asked for")
    if data.mask is not None and (not isinstance(data.mask, torch.Tensor)
                                  or tuple(data.mask.shape) != (num_examples, seq_len)):
        shape = tuple(data.mask.shape) if isinstance(data.mask, torch.Tensor) else type(data.mask).__name__
        _refuse(task, f"{call} returned a mask of shape {shape}; it must be None or (num_examples, seq_len) = "
                      f"{(num_examples, seq_len)} like the inputs")
    vocab = task.vocab_size
    if data.inputs.numel() and (data.inputs.min() < 0 or data.inputs.max() >= vocab):
        _refuse(task, f"{call} returned input tokens in [{data.inputs.min().item()}, {data.inputs.max().item()}], "
                      f"outside the vocabulary [0, {vocab}) (vocab_size); draw tokens below vocab_size or raise it")
    supervised = data.labels[data.labels != IGNORE_INDEX]
    if supervised.numel() and (supervised.min() < 0 or supervised.max() >= vocab):
        _refuse(task, f"{call} returned labels in [{supervised.min().item()}, {supervised.max().item()}], outside "
                      f"the vocabulary [0, {vocab}) (vocab_size); a label is a token id below vocab_size, or "
                      f"{IGNORE_INDEX} where nothing is supervised")


def _same_data(a: TaskData, b) -> bool:
    masks = (a.mask is None and b.mask is None) or (a.mask is not None and b.mask is not None
                                                     and torch.equal(a.mask, b.mask))
    return isinstance(b, TaskData) and torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels) and masks


def checked_generate(generate):
    """``generate`` whose result is checked (:func:`check_task_data`), refused when neither it nor a draw of
    :data:`SUPERVISION_PROBE_EXAMPLES` examples supervises a position, and, for a draw of at most
    :data:`REPEATED_DRAW_TOKENS` tokens, drawn again from the same generator state and compared."""
    @functools.wraps(generate)
    def checked(self, num_examples, seq_len, generator):
        state = generator.get_state()

        def draw_again(n):
            again = torch.Generator(device=generator.device)
            again.set_state(state)
            return generate(self, n, seq_len, again)
        data = generate(self, num_examples, seq_len, generator)
        check_task_data(self, data, num_examples, seq_len)
        if num_examples and not (data.labels != IGNORE_INDEX).any():
            probe = data if num_examples >= SUPERVISION_PROBE_EXAMPLES else draw_again(SUPERVISION_PROBE_EXAMPLES)
            if not (probe.labels != IGNORE_INDEX).any():
                _refuse(self, f"no position of {len(probe)} examples drawn at seq_len {seq_len} is supervised (every "
                              f"label is {IGNORE_INDEX}): nothing would be trained or scored; give the positions "
                              f"to predict their target tokens as labels")
        if num_examples * seq_len <= REPEATED_DRAW_TOKENS:
            if not _same_data(data, draw_again(num_examples)):
                _refuse(self, f"generate({num_examples}, {seq_len}, generator) drew different data from the same "
                              f"generator state; draw every random number from its generator argument (e.g. "
                              f"torch.randint(..., generator=generator)), not from torch's global generator, "
                              f"numpy or random, so that a seed gives the same data")
        return data
    checked.contract_checked = True
    return checked


class Task(abc.ABC):
    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type]

    def __init__(self, options):
        self.options = options

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("generate")
        if own is not None and not getattr(own, "contract_checked", False):
            cls.generate = checked_generate(own)

    @staticmethod
    def from_spec(spec) -> "Task":
        """The task a resolved spec (``recipe.task``, an ``eval.tasks`` entry) names, built from its options; a
        training length its :meth:`check_length` refuses is a :class:`zoo.errors.UserError`."""
        task = TASKS.get(spec.name)(spec.options)
        try:
            task.check_length(task.seq_len)
        except ValueError as err:
            raise UserError(f"task {spec.name!r}: {err}; set task.seq_len to a length the task can generate") from None
        return task

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


def _contract_problem(cls) -> str | None:
    """What a task class leaves out of the contract, or None."""
    if inspect.isabstract(cls):
        return f"does not implement {', '.join(sorted(cls.__abstractmethods__))} (see zoo.tasks.Task)"
    options = dataclasses.fields(cls.Options) if dataclasses.is_dataclass(getattr(cls, "Options", None)) else ()
    for f in options:
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            return (f"option {f.name!r} has no default; give it one, opt(<default>, <help>, ...), so that "
                    f"`task: {{name: {cls.name}}}` alone is a working recipe")
    names = {f.name for f in options}
    needed = [o for o, member in (("seq_len", "seq_len"), ("num_train", "num_examples"), ("num_test", "num_examples"))
              if o not in names and getattr(cls, member) is getattr(Task, member)]
    if needed:
        return (f"its Options have no {', '.join(needed)}, which Task reads (seq_len, num_examples); add the "
                f"options or override what reads them")
    return None


def register_task(cls):
    """Register a :class:`Task` subclass under ``cls.name`` (a class decorator); a class that breaks the
    contract is refused with a ValueError naming it and the rule."""
    if cls.name and (problem := _contract_problem(cls)) is not None:
        raise ValueError(f"task {cls.name!r} ({cls.__module__}.{cls.__qualname__}): {problem}")
    return TASKS.add(cls)
