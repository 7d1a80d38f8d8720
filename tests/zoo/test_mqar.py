"""MQAR generator: checked against a plain Python decoding of every generated example."""
from pathlib import Path

import pytest
import torch

from mixers.options import build_options
from zoo import resolve
from zoo.tasks import TASKS

ECHO_BASE = Path(__file__).resolve().parents[2] / "recipes" / "ablations" / "_echo_base.yaml"


def make(**options):
    cls = TASKS.get("mqar")
    return cls(build_options(cls.Options, options))


@pytest.mark.parametrize("gap", [0, 1, 3])
def test_every_label_is_the_value_bound_to_the_queried_key(gap):
    V, T, pairs = 64, 48, 6
    task = make(vocab_size=V, seq_len=T, num_kv_pairs=pairs, random_fill=False, value_gap=gap)
    data = task.make("train", seed=int(torch.randint(1000, (1,))), num_examples=50)
    assert data.inputs.shape == data.labels.shape == (50, T)
    stride = 2 + gap
    context = stride * pairs
    for x, y, m in zip(data.inputs.tolist(), data.labels.tolist(), data.mask.tolist()):
        keys, values = x[0:context:stride], x[stride - 1:context:stride]
        fillers = [x[t] for t in range(context) if t % stride not in (0, stride - 1)]
        assert fillers == [0] * (gap * pairs)
        assert all(1 <= k < V // 2 for k in keys) and len(set(keys)) == pairs
        assert all(V // 2 <= v < V for v in values) and len(set(values)) == pairs
        binding = dict(zip(keys, values))
        supervised = [t for t in range(T) if y[t] != -100]
        assert len(supervised) == pairs
        queried = [x[t] for t in supervised]
        assert sorted(queried) == sorted(keys), "every key is queried exactly once"
        for t in supervised:
            assert t >= context and y[t] == binding[x[t]]
        assert all(x[t] == 0 for t in range(context, T) if t not in supervised)
        assert m == [1.0] * context + [0.0] * (T - context)


def test_value_gap_needs_room_and_is_left_out_of_the_recipe_at_its_default():
    with pytest.raises(ValueError, match=r"num_kv_pairs \* \(4 \+ value_gap \(2\)\) must be <= seq_len"):
        make(vocab_size=64, seq_len=32, num_kv_pairs=6, value_gap=2)
    make(vocab_size=64, seq_len=32, num_kv_pairs=5, value_gap=2)  # 5 * 6 = 30 fits
    plain, explicit, gapped = (resolve(ECHO_BASE, extra) for extra in ([], ["task.value_gap=0"], ["task.value_gap=1"]))
    assert "value_gap" not in plain.plain["task"] and plain.key == explicit.key
    assert gapped.plain["task"]["value_gap"] == 1 and gapped.key != plain.key


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
