"""Every registered task: tokens and labels fit the vocabulary the model is built with, the data is
seeded, and longer test lengths (length generalisation) are produced on request."""
import pytest
import torch

from mixers.options import build_options
from zoo.tasks import TASKS

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
