"""MQAR generator: checked against a plain Python decoding of every generated example."""
import torch

from mixers.options import build_options
from zoo.tasks import TASKS


def make(**options):
    cls = TASKS.get("mqar")
    return cls(build_options(cls.Options, options))


def test_every_label_is_the_value_bound_to_the_queried_key():
    V, T, pairs = 64, 48, 6
    task = make(vocab_size=V, seq_len=T, num_kv_pairs=pairs, random_fill=False)
    data = task.make("train", seed=int(torch.randint(1000, (1,))), num_examples=50)
    assert data.inputs.shape == data.labels.shape == (50, T)
    for x, y, m in zip(data.inputs.tolist(), data.labels.tolist(), data.mask.tolist()):
        keys, values = x[0:2 * pairs:2], x[1:2 * pairs:2]
        assert all(1 <= k < V // 2 for k in keys) and len(set(keys)) == pairs
        assert all(V // 2 <= v < V for v in values) and len(set(values)) == pairs
        binding = dict(zip(keys, values))
        supervised = [t for t in range(T) if y[t] != -100]
        assert len(supervised) == pairs
        queried = [x[t] for t in supervised]
        assert sorted(queried) == sorted(keys), "every key is queried exactly once"
        for t in supervised:
            assert t >= 2 * pairs and y[t] == binding[x[t]]
        assert all(x[t] == 0 for t in range(2 * pairs, T) if t not in supervised)
        assert m == [1.0] * (2 * pairs) + [0.0] * (T - 2 * pairs)


def test_random_fill_only_touches_non_query_positions():
    task_plain = make(vocab_size=64, seq_len=32, num_kv_pairs=4, random_fill=False)
    task_fill = make(vocab_size=64, seq_len=32, num_kv_pairs=4, random_fill=True)
    a, b = task_plain.make("test", 5, num_examples=20), task_fill.make("test", 5, num_examples=20)
    assert torch.equal(a.labels, b.labels)
    keep = a.inputs != 0
    assert torch.equal(a.inputs[keep], b.inputs[keep])
    assert (b.inputs[~keep] != 0).float().mean() > 0.9


def test_seeded_and_splits_differ():
    task = make(vocab_size=128, seq_len=64, num_kv_pairs=8)
    a, b = task.make("train", 7, num_examples=30), task.make("train", 7, num_examples=30)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
    c = task.make("test", 7, num_examples=30)
    assert not torch.equal(a.inputs, c.inputs)


def test_query_gaps_follow_a_decreasing_power_law():
    task = make(vocab_size=256, seq_len=256, num_kv_pairs=4, random_fill=False)
    data = task.make("train", 1, num_examples=400)
    first_query = (data.labels != -100).float().argmax(dim=1) - 8  # offset into the query region
    near = (first_query < 60).float().mean()
    far = (first_query >= 180).float().mean()
    assert near > 2 * far, (near, far)
