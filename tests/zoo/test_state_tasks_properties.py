"""The registered state-tracking tasks (``parity``, ``s3``/``s4``/``s5``/``a5``, ``dyck1``) pass every option of a
recipe to their generator: each task's data, drawn through the task registry, is rebuilt with plain loops from
its inputs and the documented rules (lexicographic permutation ids, ``P_t = x_t o P_{t-1}``)."""
import itertools

import pytest
import torch

from mixers.options import build_options
from zoo.tasks import TASKS

IGNORE = -100


def make(name, **options):
    cls = TASKS.get(name)
    return cls(build_options(cls.Options, options))


def seed():
    return int(torch.randint(1 << 30, ()))


def running_products(word, n, group):
    elems = list(itertools.permutations(range(n)))
    if group.startswith("a"):
        elems = [p for p in elems if sum(p[i] > p[j] for i in range(n) for j in range(i + 1, n)) % 2 == 0]
    state, out = tuple(range(n)), []
    for token in word:
        x = elems[token]
        state = tuple(x[state[i]] for i in range(n))
        out.append(elems.index(state))
    return out, len(elems)


@pytest.mark.parametrize("p_one", [0.1, 0.9])
def test_parity_draws_ones_with_the_recipes_probability(p_one):
    task = make("parity", seq_len=64, p_one=p_one)
    data = task.make("train", seed(), num_examples=200)
    assert abs(float(data.inputs.float().mean()) - p_one) < 0.03
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        assert y == [sum(x[:t + 1]) % 2 for t in range(len(x))]


@pytest.mark.parametrize("group", ["s3", "s4", "a5"])
def test_word_problem_tasks_label_the_running_product(group):
    task = make(group, seq_len=12)
    data = task.make("test", seed(), num_examples=30)
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        expected, size = running_products(x, int(group[1]), group)
        assert y == expected and task.vocab_size == size


@pytest.mark.parametrize("name,options", [("parity", {}), ("s3", {}), ("s5", {}),
                                          ("dyck1", {"max_depth": 3}), ("dyck1", {"label": "balanced"})])
def test_supervise_last_keeps_only_the_final_label(name, options):
    full = make(name, seq_len=20, **options)
    last = make(name, seq_len=20, supervise="last", **options)
    s = seed()
    a, b = full.make("train", s, num_examples=40), last.make("train", s, num_examples=40)
    assert torch.equal(a.inputs, b.inputs)
    assert bool((b.labels[:, :-1] == IGNORE).all()) and torch.equal(b.labels[:, -1], a.labels[:, -1])


@pytest.mark.parametrize("label", ["depth", "balanced"])
def test_dyck1_task_labels_follow_the_chosen_label_and_depth_bound(label):
    max_depth = 2
    task = make("dyck1", seq_len=30, max_depth=max_depth, label=label, p_open=0.8)
    data = task.make("train", seed(), num_examples=100)
    reached = 0
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        depth, expected = 0, []
        for token in x:
            depth += 1 if token == 0 else -1
            assert 0 <= depth <= max_depth
            reached = max(reached, depth)
            expected.append(depth if label == "depth" else int(depth == 0))
        assert y == expected
    assert reached == max_depth
    assert int(data.labels.max()) < task.vocab_size == (max_depth + 1 if label == "depth" else 2)
