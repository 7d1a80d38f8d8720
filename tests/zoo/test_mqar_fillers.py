"""MQAR with ``value_gap`` and ``random_fill``: the fillers between a key and its value are random tokens other than
the sequence's own keys and values. They were drawn over the whole vocabulary, so a filler could repeat a key of the
sequence (a second occurrence of the key in the context, with another token ``value_gap + 1`` positions on) or put
a value between a key and its own: at a vocabulary of 64 with 4 pairs and a gap of 1 (tables/echo_power's 'value
gap' cells) about 39% of the sequences held such a filler."""
from __future__ import annotations

import pytest
import torch

import zoo.tasks.mqar as mqar
from mixers.options import build_options
from zoo.tasks import TASKS


def make(**options):
    cls = TASKS.get("mqar")
    return cls(build_options(cls.Options, options))


def layout(inputs, pairs, gap):
    """(keys, values, fillers) of the context of every row."""
    stride = 2 + gap
    context = stride * pairs
    fillers = [t for t in range(context) if t % stride not in (0, stride - 1)]
    return inputs[:, 0:context:stride], inputs[:, stride - 1:context:stride], inputs[:, fillers]


@pytest.mark.parametrize("gap", [1, 3])
def test_context_fillers_are_never_the_sequences_keys_or_values(gap):
    V, T, pairs = 16, 8 * (4 + gap), 5   # 10 of 16 tokens taken: a filler drawn over all 16 hits one mostly
    task = make(vocab_size=V, seq_len=T, num_kv_pairs=pairs, value_gap=gap, random_fill=True)
    seed = int(torch.randint(1 << 30, ()))
    data = task.make("train", seed, num_examples=400)
    plain = make(vocab_size=V, seq_len=T, num_kv_pairs=pairs, value_gap=gap, random_fill=False).make(
        "train", seed, num_examples=400)
    keys, values, fillers = layout(data.inputs, pairs, gap)
    for k, v, f in zip(keys.tolist(), values.tolist(), fillers.tolist()):
        assert not set(f) & (set(k) | set(v)), (k, v, f)
        assert len(set(k)) == len(set(v)) == pairs
    context = (2 + gap) * pairs
    # every key and value occurs once in the context: a query has one binding to read
    for row, k, v in zip(data.inputs[:, :context].tolist(), keys.tolist(), values.tolist()):
        assert all(row.count(token) == 1 for token in k + v), row
    # the rest is the draw random_fill=False makes: keys, values, queries, labels and mask
    assert torch.equal(data.labels, plain.labels) and torch.equal(data.mask, plain.mask)
    keep = plain.inputs != 0
    assert torch.equal(data.inputs[keep], plain.inputs[keep])


def test_the_fillers_are_uniform_over_the_tokens_left():
    V, pairs, gap, n = 16, 3, 2, 6000
    data = make(vocab_size=V, seq_len=pairs * (4 + gap), num_kv_pairs=pairs, value_gap=gap,
                random_fill=True).make("train", int(torch.randint(1 << 30, ())), num_examples=n)
    keys, values, fillers = layout(data.inputs, pairs, gap)
    taken = torch.cat([keys, values], dim=1)
    for token in range(V):
        allowed = ~(taken == token).any(dim=1)   # rows where the token may fill
        slots = int(allowed.sum()) * fillers.shape[1]
        share = (fillers[allowed] == token).sum().item() / slots
        assert abs(share * (V - 2 * pairs) - 1) < 0.15, (token, share)  # 1/10 each; one sigma is about 2% here


def test_only_the_fillers_that_were_keys_or_values_change(monkeypatch):
    """The filler draw is the old one wherever it missed the sequence's keys and values (a redrawn filler takes
    one extra draw, made last), so only the sequences that held such a filler change; without a value gap the
    fillers' redraw is never reached and the stream is as it was."""
    V, T, pairs, gap = 64, 32, 4, 1
    seed = int(torch.randint(1 << 30, ()))
    task = make(vocab_size=V, seq_len=T, num_kv_pairs=pairs, value_gap=gap, random_fill=True)
    now = task.make("test", seed, num_examples=500)
    monkeypatch.setattr(mqar, "other_tokens", lambda drawn, *rest: drawn)   # the fillers drawn over all V
    before = task.make("test", seed, num_examples=500)
    keys, values, fillers = layout(before.inputs, pairs, gap)
    clash = (fillers[..., None] == torch.cat([keys, values], dim=1)[:, None, :]).any(-1)
    assert clash.any()
    changed = now.inputs != before.inputs
    _, _, changed_fillers = layout(changed, pairs, gap)
    assert torch.equal(changed_fillers, clash) and int(changed.sum()) == int(clash.sum())
    assert torch.equal(now.labels, before.labels) and torch.equal(now.mask, before.mask)

    def refuse(*args):
        raise AssertionError("no value gap: no filler to redraw")
    monkeypatch.setattr(mqar, "other_tokens", refuse)
    make(vocab_size=V, seq_len=T, num_kv_pairs=pairs, random_fill=True).make("test", seed, num_examples=50)


def test_other_tokens_keeps_what_was_not_taken_and_redraws_the_rest():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    for _ in range(50):
        V = int(torch.randint(3, 40, (), generator=g))
        c = int(torch.randint(1, V, (), generator=g))
        taken = torch.stack([torch.randperm(V, generator=g)[:c] for _ in range(4)])
        drawn = torch.randint(V, (4, 30), generator=g)
        out = mqar.other_tokens(drawn, taken, V, g)
        assert ((out >= 0) & (out < V)).all()
        hit = (drawn[..., None] == taken[:, None, :]).any(-1)
        assert torch.equal(out[~hit], drawn[~hit])
        assert not (out[..., None] == taken[:, None, :]).any()
