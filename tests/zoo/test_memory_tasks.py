"""assoc_recall and dyck1_next generators, checked against plain Python decodings of every example."""
import pytest
import torch

from mixers.options import build_options
from zoo.tasks import TASKS


def make(name, **options):
    cls = TASKS.get(name)
    return cls(build_options(cls.Options, options))


def seed():
    return int(torch.randint(10_000, (1,)))


@pytest.mark.parametrize("L", [10, 11, 40, 61])
def test_assoc_recall_label_is_latest_value_bound_to_query(L):
    V = 20
    task = make("assoc_recall", vocab_size=V, seq_len=L)
    data = task.make("train", seed(), num_examples=200)
    assert data.inputs.shape == data.labels.shape == (200, L)
    assert task.vocab_size == V + 1
    assert int(data.inputs.min()) >= 0 and int(data.inputs.max()) <= V
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        assert all(label == -100 for label in y[:-1]), "only the query position is supervised"
        assert x[-2] == V, "the query marker precedes the query key"
        start = L % 2
        assert x[:start] == [V] * start
        pairs = x[start:-2]
        binding = {}
        for k, v in zip(pairs[0::2], pairs[1::2]):
            assert 0 <= k < V and 0 <= v < V
            binding[k] = v  # the latest binding wins
        q = x[-1]
        assert q in binding, "the answer is present in the context"
        assert y[-1] == binding[q]


def test_assoc_recall_answers_are_spread_over_the_vocabulary():
    data = make("assoc_recall", vocab_size=20, seq_len=40).make("test", seed(), num_examples=4000)
    counts = torch.bincount(data.labels[:, -1], minlength=20).float()
    assert counts.numel() == 20 and counts.min() > 0.5 * counts.mean()


@pytest.mark.parametrize("name,opts", [("assoc_recall", {"seq_len": 30}), ("dyck1_next", {"seq_len": 20}),
                                       ("mad_recall", {"seq_len": 40})])
def test_seeded_and_splits_differ(name, opts):
    task = make(name, **opts)
    s = seed()
    a, b = task.make("train", s, num_examples=50), task.make("train", s, num_examples=50)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels)
    c = task.make("test", s, num_examples=50)
    assert not torch.equal(a.inputs, c.inputs)


def _legal_next(depth, remaining, max_depth):
    can_open = depth + 1 <= remaining - 1 and depth < max_depth
    return can_open, depth > 0


@pytest.mark.parametrize("L,max_depth", [(10, 16), (20, 3), (30, 16)])
def test_dyck1_next_words_are_balanced_and_labels_are_the_legal_next_tokens(L, max_depth):
    task = make("dyck1_next", seq_len=L, max_depth=max_depth)
    assert task.vocab_size == 3
    data = task.make("train", seed(), num_examples=200)
    assert data.inputs.shape == (200, L)
    assert set(data.inputs.unique().tolist()) <= {0, 1}
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        depth = 0
        for t, tok in enumerate(x):
            depth += 1 if tok == 0 else -1
            assert 0 <= depth <= max_depth
            if t == L - 1:
                assert y[t] == -100
                continue
            remaining = L - t - 1
            # brute force: which next brackets still allow completing a balanced word of length L
            ok = [d <= remaining - 1 and 0 <= d <= max_depth for d in (depth + 1, depth - 1)]
            expected = 2 if all(ok) else (0 if ok[0] else 1)
            assert y[t] == expected
        assert depth == 0, "every word is balanced"


def test_dyck1_next_free_positions_are_common_and_words_vary():
    data = make("dyck1_next", seq_len=20).make("test", seed(), num_examples=500)
    labels = data.labels[:, :-1]
    frac_free = (labels == 2).float().mean()
    assert 0.2 < frac_free < 0.9
    assert data.inputs.unique(dim=0).shape[0] > 100


@pytest.mark.parametrize("name,opts", [("dyck1_next", {"seq_len": 15}), ("assoc_recall", {"seq_len": 3}),
                                       ("dyck1_next", {"p_open": 1.0}), ("mad_recall", {"seq_len": 31})])
def test_bad_options_raise(name, opts):
    cls = TASKS.get(name)
    with pytest.raises(Exception, match="seq_len|p_open"):
        build_options(cls.Options, opts)


@pytest.mark.parametrize("V,L", [(16, 64), (8, 20)])
def test_mad_recall_labels_are_values_of_keys_seen_before(V, L):
    task = make("mad_recall", vocab_size=V, seq_len=L)
    assert task.vocab_size == V
    data = task.make("train", seed(), num_examples=100)
    assert data.inputs.shape == data.labels.shape == (100, L)
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        binding = {}
        for t in range(0, L, 2):
            k, v = x[t], x[t + 1]
            assert 0 <= k < V // 2 <= v < V
            assert y[t + 1] == -100
            if k in binding:
                assert v == binding[k], "one value per key within a sequence"
                assert y[t] == v, "a repeated key is supervised with its value"
            else:
                assert y[t] == -100, "a first occurrence is not supervised"
            binding[k] = v
    supervised = (data.labels != -100).float().sum(1)
    assert supervised.min() > 0
