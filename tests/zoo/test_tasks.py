"""Every registered task: tokens and labels fit the vocabulary the model is built with, the data is
seeded, and longer test lengths (length generalisation) are produced on request."""
import pytest
import torch

from mixers.options import build_options
from zoo.tasks import TASKS
from zoo.tasks.base import SPLIT_OFFSET, stream_seed

SMALL = {"mqar": {"seq_len": 32, "num_kv_pairs": 4, "vocab_size": 64}}


@pytest.mark.parametrize("name", TASKS.names())
def test_tokens_fit_the_vocabulary(name):
    cls = TASKS.get(name)
    task = cls(build_options(cls.Options, SMALL.get(name, {"seq_len": 24})))
    for seq_len in (task.seq_len, 4 * task.seq_len):
        data = task.make("test", seed=11, seq_len=seq_len, num_examples=40)
        assert data.inputs.shape == data.labels.shape == (40, seq_len)
        assert 0 <= data.inputs.min() and data.inputs.max() < task.vocab_size
        supervised = data.labels[data.labels != -100]
        assert supervised.numel() > 0 and supervised.min() >= 0 and supervised.max() < task.vocab_size
    again = task.make("test", seed=11, num_examples=40)
    assert torch.equal(again.inputs, task.make("test", seed=11, num_examples=40).inputs)


def test_every_seed_split_and_length_draws_its_own_stream():
    """No two ``(seed, split, length)`` triples share a generator seed, across the lengths where the linear form
    would repeat (train at L + 7919 against test at L) and the switch to the hashed form; below the switch the
    linear form is kept, so the data of every existing table is drawn as before."""
    seen = {}
    lengths = list(range(1, 20000, 7)) + [7918, 7919, 7920, 2 * 7919, 2 * 7919 + 1]
    for seed in range(3):
        for split in SPLIT_OFFSET:
            for seq_len in lengths:
                value = stream_seed(seed, split, seq_len)
                assert 0 <= value < 1 << 63
                assert seen.setdefault(value, (seed, split, seq_len)) == (seed, split, seq_len), value
    assert stream_seed(4, "test", 64) == 4 * 1_000_003 + 2 * 7919 + 64
    # the collision the linear form had, as data: the two streams differ
    cls = TASKS.get("mqar")
    task = cls(build_options(cls.Options, SMALL["mqar"]))
    short = task.make("test", seed=0, seq_len=32, num_examples=4)
    long = task.make("train", seed=0, seq_len=32 + 7919, num_examples=4)
    assert not torch.equal(short.inputs[:, :8], long.inputs[:, :8])
