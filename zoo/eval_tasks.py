"""``eval.tasks``: evaluate the trained model on other tasks than the one it was trained on (zero-shot).

A recipe lists entries ``{label: <short name>, name: <task>, <option>: value, ...}``; options an entry
leaves out that the training task also has (``vocab_size``, ``seq_len``, ``num_kv_pairs``, ...) are
taken from the training task, the rest from the task's defaults. Every entry must keep the training
task's vocabulary size (the trained embedding reads nothing else). At the end of training each entry is
evaluated on its test split at its own ``seq_len`` and at every ``eval.seq_lens`` length, under
``eval.test_time``, giving the metrics ``test_accuracy@task=<label>`` and
``test_accuracy@task=<label>@<L>``.

An empty list (the default) is left out of the resolved recipe, so recipes written before this option
keep their hashes.
"""
from __future__ import annotations

import re
from dataclasses import fields
from typing import Callable

from mixers.options import OptionError, build_options, plain_options

from .config import Spec

_LABEL = re.compile(r"^[A-Za-z0-9_.+-]+$")


def resolve_eval_tasks(entries: list, train_task: Spec, seq_lens: list[int],
                       fail: Callable[[str, str], None]) -> list[tuple[str, Spec]]:
    """``[(label, Spec)]`` of the ``eval.tasks`` entries, validated (also against the ``eval.seq_lens``
    they will be generated at); ``fail(path, message)`` raises."""
    from .tasks import TASKS
    train_vocab = TASKS.get(train_task.name)(train_task.options).vocab_size
    inherited = {f.name: getattr(train_task.options, f.name) for f in fields(train_task.options)}
    out, seen = [], set()
    for i, entry in enumerate(entries):
        at = f"eval.tasks.{i}"
        values = dict(entry)
        name = values.pop("name", None)
        if not isinstance(name, str):
            fail(f"{at}.name", f"expected a task name, got {name!r}; choose one of {', '.join(TASKS.names())}")
        label = values.pop("label", name)
        if not isinstance(label, str) or not _LABEL.match(label):
            fail(f"{at}.label", f"expected a short name of letters, digits and _.+- (it names the metric "
                                f"test_accuracy@task=<label>), got {label!r}")
        if label in seen:
            fail(f"{at}.label", f"{label!r} is used by two eval.tasks entries; give each a distinct label")
        seen.add(label)
        try:
            cls = TASKS.get(name)
        except OptionError as err:
            fail(f"{at}.name", err.message)
        own = {f.name for f in fields(cls.Options)}
        merged = {k: v for k, v in inherited.items() if k in own}
        merged.update(values)
        try:
            spec = Spec(name, build_options(cls.Options, merged, ""))
        except OptionError as err:
            fail(at + (f".{err.path}" if err.path else ""), err.message)
        task = cls(spec.options)
        if task.vocab_size != train_vocab:
            fail(at, f"task {name!r} here has vocabulary size {task.vocab_size} but the model is trained with "
                     f"{train_vocab}; set its options so the vocabularies match (e.g. vocab_size)")
        for length in seq_lens:
            try:
                task.check_length(length)
            except ValueError as err:
                fail(at, f"{err}; eval.seq_lens asks for {length}: drop that length or lower this entry's facts")
        out.append((label, spec))
    return out


def plain_eval_tasks(eval_tasks: list[tuple[str, Spec]]) -> list[dict]:
    """The resolved entries as JSON data, every option filled in."""
    return [{"label": label, "name": spec.name, **plain_options(spec.options)} for label, spec in eval_tasks]


def eval_task_metrics(model, recipe, device, precision: str) -> dict:
    """``test_accuracy@task=<label>`` (and ``@<L>`` for every ``eval.seq_lens`` length) per entry."""
    from .tasks import TASKS
    from .train import evaluate
    metrics = {}
    bs = recipe.eval.batch_size
    with model.test_time(recipe.eval.test_time):
        for label, spec in recipe.eval_tasks:
            task = TASKS.get(spec.name)(spec.options)
            ev = evaluate(model, task.make("test", recipe.seed), bs, device, precision)
            metrics[f"test_accuracy@task={label}"] = ev["accuracy"]
            for seq_len in recipe.eval.seq_lens:
                ev = evaluate(model, task.make("test", recipe.seed, seq_len=seq_len), bs, device, precision)
                metrics[f"test_accuracy@task={label}@{seq_len}"] = ev["accuracy"]
    return metrics

