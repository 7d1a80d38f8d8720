"""The path of CONTRIBUTING.md ("Adding a task") for a task kept in the author's own package.

The guide's example module runs as written from a folder outside the repository, named in ``imports:``; the
accuracy the zoo reports for it is the one its predictions on the test data give; a task that breaks the contract
(tokens outside the vocabulary, data of the wrong shape or dtype, no supervised position, a generator that reads
another source of randomness, an option without a default, a training length it cannot generate) is refused by
``zoo check`` in one line naming the task and the rule; and a results row names the module the task came from.
"""
from __future__ import annotations

import json
import re
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import zoo
from mixers import STATE_MIXERS, StateMixer, register_state_mixer
from mixers.options import build_options, opt
from zoo.tasks import TASKS, Task, TaskData, register_task

from .cli_errors import one_line_error

ROOT = Path(__file__).parents[2]
TINY = Path(__file__).resolve().parent / "recipes" / "tiny.yaml"


def guide_example() -> str:
    """The Python block of the guide's "Adding a task" section."""
    guide = (ROOT / "CONTRIBUTING.md").read_text()
    assert "## Adding a task" in guide, "CONTRIBUTING.md has no section on adding a task"
    section = guide.split("## Adding a task", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "the guide's 'Adding a task' section shows no example module"
    return blocks[0]


@pytest.fixture
def author_package(tmp_path, monkeypatch):
    """A package of the author's own, outside the repository and on the path: ``(name, folder)``; what its modules
    register is unregistered afterwards."""
    name = f"task_author_{uuid.uuid4().hex[:8]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = dict(TASKS.entries)
    yield name, tmp_path / name
    TASKS.entries.clear()
    TASKS.entries.update(before)
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[module]


@pytest.fixture
def registered():
    """``register(cls)``: registers a task class for one test only."""
    before = dict(TASKS.entries)
    yield register_task
    TASKS.entries.clear()
    TASKS.entries.update(before)


def draw_size() -> tuple[int, int]:
    """A fresh vocabulary size and training length."""
    return int(torch.randint(4, 40, ())), int(torch.randint(6, 20, ()))


def task_override(name: str, vocab: int, seq_len: int) -> str:
    return f"task={{name: {name}, vocab_size: {vocab}, seq_len: {seq_len}, num_train: 64, num_test: 16}}"


# ------------------------------------------------------------------------------- the guide's example, as written
@pytest.mark.slow
def test_the_guides_task_trains_and_reports_the_accuracy_of_its_predictions(author_package):
    package, folder = author_package
    (folder / "my_task.py").write_text(guide_example())
    vocab, seq_len = draw_size()
    recipe = zoo.load(TINY, [f"imports=[{package}.my_task]", task_override("first_token", vocab, seq_len),
                             f"eval.seq_lens=[{2 * seq_len}]"])
    assert TASKS.get("first_token").__module__ == f"{package}.my_task"
    result = zoo.train(recipe, progress=False)
    task = zoo.build_task(recipe)
    model = result.model.eval()
    for length, key in [(seq_len, "test_accuracy"), (2 * seq_len, f"test_accuracy@{2 * seq_len}")]:
        data = task.make("test", recipe.seed, seq_len=length)
        assert data.inputs.shape == (16, length) and data.inputs.max() < vocab
        assert torch.equal(data.labels[:, -1], data.inputs[:, 0])  # what the guide's task asks for
        assert (data.labels[:, :-1] == -100).all()
        with torch.no_grad():
            predicted = model(data.inputs, mask=data.mask).argmax(-1)[:, -1]
        mine = (predicted == data.inputs[:, 0]).double().mean().item()
        assert result.metrics[key] == pytest.approx(mine, abs=1e-12), key
        sequence_key = key.replace("test_accuracy", "test_sequence_accuracy")
        assert result.metrics[sequence_key] == pytest.approx(mine, abs=1e-12)  # one supervised position each


def test_a_training_length_the_guides_task_cannot_generate_is_refused_at_check(author_package, capsys):
    package, folder = author_package
    example = guide_example()
    line = 'seq_len: int = opt(16, "training sequence length", at_least=2)'
    assert line in example
    # only check_length knows the minimum now: the option's own range would refuse the length first
    (folder / "my_task.py").write_text(example.replace(line, line.replace("at_least=2", "at_least=1")))
    err = one_line_error(capsys, "check", TINY, f"imports=[{package}.my_task]", task_override("first_token", 8, 1))
    assert "first_token" in err and "seq_len must be at least 2, got 1" in err and "task.seq_len" in err


# ------------------------------------------------------------------------- tasks that break the data contract
class _Recall(Task):
    """First-token recall with one rule of the contract broken, chosen by ``breaks``."""
    breaks = ""

    @dataclass
    class Options:
        vocab_size: int = opt(16, "vocabulary", at_least=2)
        seq_len: int = opt(16, "length", at_least=2)
        num_train: int = opt(64, "training examples", at_least=1)
        num_test: int = opt(16, "test examples", at_least=1)

    @property
    def vocab_size(self) -> int:
        return self.options.vocab_size

    def generate(self, num_examples, seq_len, generator):
        vocab = self.options.vocab_size
        inputs = torch.randint(vocab, (num_examples, seq_len), generator=None if self.breaks == "global_rng" else
                               generator)
        labels = torch.full_like(inputs, -100)
        labels[:, -1] = inputs[:, 0]
        mask = torch.ones(num_examples, seq_len + (self.breaks == "mask_shape"))
        if self.breaks == "labels_outside":
            labels[:, -1] = vocab
        if self.breaks == "inputs_outside":
            inputs[:, 1] = vocab + int(torch.randint(3, ()))
        if self.breaks == "float_inputs":
            inputs = inputs.float()
        if self.breaks == "int32_labels":
            labels = labels.int()
        if self.breaks == "short":
            inputs, labels, mask = inputs[:, 1:], labels[:, 1:], mask[:, 1:]
        if self.breaks == "unsupervised":
            labels[:] = -100
        if self.breaks == "tuple":
            return inputs, labels
        return TaskData(inputs, labels, mask)


#: (rule broken, words of the refusal that name it)
BROKEN = [
    ("labels_outside", "returned labels in"), ("inputs_outside", "returned input tokens in"),
    ("mask_shape", "returned a mask of shape"), ("float_inputs", "torch.long"), ("int32_labels", "torch.long"),
    ("short", "it must be (num_examples, seq_len)"), ("unsupervised", "is supervised"),
    ("global_rng", "different data from the same generator state"), ("tuple", "return TaskData"),
]


@pytest.mark.parametrize("rule,words", BROKEN)
def test_zoo_check_refuses_a_task_breaking_the_data_contract_in_one_line(rule, words, registered, capsys):
    name = f"broken_{rule}"
    registered(type(f"Broken_{rule}", (_Recall,), {"name": name, "description": rule, "breaks": rule}))
    vocab, seq_len = draw_size()
    err = one_line_error(capsys, "check", TINY, task_override(name, vocab, seq_len))
    assert f"task {name!r}" in err and words in err, err


@pytest.mark.parametrize("rule,words", BROKEN)
def test_training_refuses_a_task_breaking_the_data_contract_before_any_step(rule, words, registered):
    name = f"broken_{rule}"
    registered(type(f"Broken_{rule}", (_Recall,), {"name": name, "description": rule, "breaks": rule}))
    vocab, seq_len = draw_size()
    recipe = zoo.load(TINY, [task_override(name, vocab, seq_len)])
    if rule == "global_rng":  # only a small draw is made twice: zoo check's, or a small set like this one
        assert 64 * seq_len <= 1 << 14
    with pytest.raises(zoo.UserError, match=re.escape(words)):
        zoo.train(recipe, progress=False)


def test_the_intact_task_passes_and_its_data_repeats_for_a_seed(registered):
    registered(type("Intact", (_Recall,), {"name": "intact", "description": "intact"}))
    vocab, seq_len = draw_size()
    task = zoo.build_task(zoo.load(TINY, [task_override("intact", vocab, seq_len)]))
    seed = int(torch.randint(1 << 20, ()))
    first, again = task.make("test", seed), task.make("test", seed)
    assert torch.equal(first.inputs, again.inputs) and torch.equal(first.labels[:, -1], first.inputs[:, 0])
    assert not torch.equal(first.inputs, task.make("train", seed, num_examples=16).inputs)


def test_a_small_draw_without_supervision_from_a_task_that_supervises_is_kept():
    """mad_recall supervises repeated keys only: a draw of two sequences of two pairs often has none, which is not
    a broken task."""
    cls = TASKS.get("mad_recall")
    task = cls(build_options(cls.Options, {"seq_len": 4, "vocab_size": 16}))
    seed = int(torch.randint(1 << 20, ()))
    empty = 0
    for k in range(40):
        data = task.generate(2, 4, torch.Generator().manual_seed(seed + k))
        empty += int((data.labels == -100).all())
    assert empty > 0  # (7/8)^2 of draws have no repeated key; all 40 with one: about 1e-19


# -------------------------------------------------------------------------------- classes refused at registration
def _class(name: str, options: type, **members) -> type:
    def generate(self, num_examples, seq_len, generator):
        inputs = torch.randint(4, (num_examples, seq_len), generator=generator)
        return TaskData(inputs, inputs)
    return type(name, (Task,), {"name": name.lower(), "description": name, "Options": options,
                                "generate": generate, **members})


@dataclass
class _NoDefault:
    gap: int
    seq_len: int = 8
    num_train: int = 8
    num_test: int = 8


@dataclass
class _NoLength:
    num_train: int = 8
    num_test: int = 8


@dataclass
class _Complete:
    seq_len: int = 8
    num_train: int = 8
    num_test: int = 8


@pytest.mark.parametrize("cls,words", [
    (_class("NoDefault", _NoDefault, vocab_size=4), "option 'gap' has no default"),
    (_class("NoLength", _NoLength, vocab_size=4), "no seq_len"),
    (_class("NoVocabulary", _Complete), "does not implement vocab_size"),
])
def test_registering_a_task_that_leaves_out_part_of_the_contract_is_refused(cls, words, registered):
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        registered(cls)
    assert f"task {cls.name!r}" in str(info.value)
    assert cls.name not in TASKS.entries


# ------------------------------------------------------------------------------------------- the results rows
@pytest.mark.slow
def test_a_results_row_names_the_module_of_an_out_of_tree_task(author_package, tmp_path, capsys):
    package, folder = author_package
    (folder / "my_task.py").write_text(guide_example())
    vocab, seq_len = draw_size()
    out = tmp_path / "run"
    argv = ["train", TINY, "--out", out, f"imports=[{package}.my_task]", task_override("first_token", vocab, seq_len)]
    assert zoo.cli.main([str(a) for a in argv]) == 0
    capsys.readouterr()
    err = one_line_error(capsys, "eval", out, f"eval.seq_lens=[{seq_len + 2}]")
    assert f"{package}.my_task" in err  # the checkpoint names it
    row = json.loads((out / "results.jsonl").read_text().splitlines()[-1])
    assert row.get("imports") == [f"{package}.my_task"], row.keys()


# ------------------------------------------------------------------------------ an out-of-tree state mixer
class _WideMLP(StateMixer):
    """A state mixer that returns twice the model's width: a block cannot add it to its input."""
    name = "wide_mlp_task_author"
    description = "returns the wrong width"

    @dataclass
    class Options:
        pass

    def __init__(self, d_model, options):
        super().__init__(d_model, options)
        self.net = torch.nn.Linear(d_model, 2 * d_model)

    def forward(self, x):
        return self.net(x)


def test_zoo_check_refuses_a_state_mixer_of_the_wrong_width_in_one_line(capsys):
    register_state_mixer(_WideMLP)
    try:
        err = one_line_error(capsys, "check", TINY, f"model.state_mixer={_WideMLP.name}")
    finally:
        STATE_MIXERS.entries.pop(_WideMLP.name, None)
    assert _WideMLP.name in err and "shape" in err
