"""The end-of-run metrics (zoo.training.evaluation) at every ``eval.seq_lens`` length and every value of
``eval.test_time_sweep``, each computed here by plain Python from a stand-in model's logits: ``val_bpb@L`` is the
bits per byte of the test windows of length ``L``; ``test_accuracy@L`` / ``test_sequence_accuracy@L`` the token
and the sequence accuracy of the test examples of length ``L`` (rows with nothing supervised left out); and
``test_accuracy@<knob>=<value>`` the accuracy under ``eval.test_time`` with that one knob changed. Stand-in tasks
give data of whatever length they are asked for."""
import contextlib
import math
import types

import pytest
import torch

from zoo.tasks import TaskData
from zoo.training import evaluation

from .test_metric_computations import TokenLogits as TableLogits

CPU = torch.device("cpu")
V, TRAIN_LENGTH, ROWS = 7, 5, 5


class TokenLogits(TableLogits):
    """:class:`tests.zoo.test_metric_computations.TokenLogits` with what the end-of-run metrics ask of a model:
    no test-time knobs, no state."""

    def test_time(self, values):
        return contextlib.nullcontext()

    def test_time_knobs(self):
        return set()

    def num_params(self):
        return self.table.numel()

    def state_size(self, seq_len):
        return 0

    def active_state_size(self, seq_len):
        return 0


class WindowsTask:
    """Random test windows, different for every length and fixed per length; every label supervised."""

    def __init__(self, token_bytes):
        self._bytes = token_bytes
        self.seq_len = TRAIN_LENGTH

    def make(self, split, seed, seq_len=None):
        length = seq_len or self.seq_len
        g = torch.Generator().manual_seed(seed * 1000 + length)
        tokens = torch.randint(V, (ROWS, length + 1), generator=g)
        return TaskData(tokens[:, :-1], tokens[:, 1:])

    def token_bytes(self):
        return self._bytes

    def data_record(self):
        return {}


def hand_bpb(table, data, token_bytes) -> float:
    nats, n_bytes = 0.0, 0
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        for token, label in zip(x, y):
            row = table[token].tolist()
            nats += math.log(sum(math.exp(v) for v in row)) - row[label]
            n_bytes += int(token_bytes[label])
    return nats / math.log(2) / n_bytes


def test_bits_per_byte_at_each_evaluation_length_reads_windows_of_that_length():
    table = torch.randn(V, V, dtype=torch.float64) * 2
    token_bytes = torch.randint(1, 4, (V,))
    task = WindowsTask(token_bytes)
    lengths = sorted({int(n) for n in torch.randint(TRAIN_LENGTH + 1, 20, (2,))})
    recipe = types.SimpleNamespace(seed=int(torch.randint(0, 100, ())),
                                   eval=types.SimpleNamespace(batch_size=3, seq_lens=lengths, test_time={}))
    metrics = evaluation.lm_metrics(TokenLogits(table), recipe, task, CPU, "fp32")
    assert metrics["val_bpb"] == pytest.approx(hand_bpb(table, task.make("test", recipe.seed), token_bytes),
                                               rel=1e-9)
    for length in lengths:
        want = hand_bpb(table, task.make("test", recipe.seed, seq_len=length), token_bytes)
        assert metrics[f"val_bpb@{length}"] == pytest.approx(want, rel=1e-9), length


class SuccessorTask:
    """Examples whose labels are mostly the successor of the input token (``(x + 1) mod V``), about half of the
    positions supervised and two rows not at all, of whatever length asked for."""

    def __init__(self):
        self.seq_len = TRAIN_LENGTH

    def make(self, split, seed, seq_len=None):
        length = seq_len or self.seq_len
        g = torch.Generator().manual_seed(seed * 1000 + length)
        inputs = torch.randint(V, (12, length), generator=g)
        labels = torch.where(torch.rand(12, length, generator=g) < 0.8, (inputs + 1) % V,
                             torch.randint(V, (12, length), generator=g))
        keep = torch.rand(12, length, generator=g) < 0.5
        keep[:, 0] = True
        keep[[2, 7]] = False  # rows with nothing to predict: neither right nor wrong
        return TaskData(inputs, torch.where(keep, labels, -100))


def hand_accuracies(table, data) -> tuple[float, float]:
    """Token accuracy over the supervised positions, and the fraction of the rows with a supervised position that
    have every one of them right."""
    right = count = exact = judged = 0
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        if all(label == -100 for label in y):
            continue
        all_right = True
        for token, label in zip(x, y):
            if label == -100:
                continue
            row = table[token].tolist()
            hit = max(range(V), key=row.__getitem__) == label
            right, count, all_right = right + hit, count + 1, all_right and hit
        exact, judged = exact + all_right, judged + 1
    return right / count, exact / judged


def test_token_and_sequence_accuracy_at_each_evaluation_length():
    table = torch.randn(V, V, dtype=torch.float64)
    table[torch.arange(V), (torch.arange(V) + 1) % V] += 10.0  # predicts the successor
    task = SuccessorTask()
    lengths = sorted({int(n) for n in torch.randint(TRAIN_LENGTH + 1, 12, (2,))})
    recipe = types.SimpleNamespace(seed=int(torch.randint(0, 100, ())), eval_tasks=[],
                                   eval=types.SimpleNamespace(batch_size=5, seq_lens=lengths, test_time={},
                                                              test_time_sweep={}))
    metrics = evaluation.test_metrics(TokenLogits(table), recipe, task, CPU, "fp32")
    accuracy, sequence_accuracy = hand_accuracies(table, task.make("test", recipe.seed))
    assert metrics["test_accuracy"] == pytest.approx(accuracy, rel=1e-9)
    assert metrics["test_sequence_accuracy"] == pytest.approx(sequence_accuracy, rel=1e-9)
    for length in lengths:
        accuracy, sequence_accuracy = hand_accuracies(table, task.make("test", recipe.seed, seq_len=length))
        assert metrics[f"test_accuracy@{length}"] == pytest.approx(accuracy, rel=1e-9), length
        assert metrics[f"test_sequence_accuracy@{length}"] == pytest.approx(sequence_accuracy, rel=1e-9), length


class KnobLogits(TokenLogits):
    """Predicts the successor only under the test-time knob ``window=1`` (whatever ``decay`` is), the token after it
    otherwise; records the knob values it computed with."""

    def __init__(self, table):
        super().__init__(table)
        self.active, self.seen = {}, []

    @contextlib.contextmanager
    def test_time(self, values):
        before, self.active = self.active, dict(values)
        try:
            yield
        finally:
            self.active = before

    def test_time_knobs(self):
        return {"window", "decay"}

    def forward(self, ids, mask=None):
        self.seen.append(dict(self.active))
        return self.table[ids] if self.active.get("window") == 1 else self.table[(ids + 1) % V]


def test_a_swept_knob_changes_that_knob_alone_and_keeps_the_other_test_time_values():
    table = torch.randn(V, V, dtype=torch.float64)
    table[torch.arange(V), (torch.arange(V) + 1) % V] += 10.0
    task, model = SuccessorTask(), KnobLogits(table)
    values = sorted({int(n) for n in torch.randint(1, 50, (2,))})
    recipe = types.SimpleNamespace(seed=int(torch.randint(0, 100, ())), eval_tasks=[],
                                   eval=types.SimpleNamespace(batch_size=5, seq_lens=[], test_time={"window": 1},
                                                              test_time_sweep={"decay": values, "unknown": [1]}))
    metrics = evaluation.test_metrics(model, recipe, task, CPU, "fp32")
    accuracy, _ = hand_accuracies(table, task.make("test", recipe.seed))
    for value in values:
        assert metrics[f"test_accuracy@decay={value}"] == pytest.approx(accuracy, rel=1e-9), value
        assert {"window": 1, "decay": value} in model.seen
    assert "test_accuracy@unknown=1" not in metrics  # a knob the model does not declare is left out
