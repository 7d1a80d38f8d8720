"""State-tracking generators against brute-force Python loops on small examples."""
from __future__ import annotations

import itertools

import pytest
import torch

from zoo.tasks import state_tracking as st


def gen():
    return torch.Generator().manual_seed(int(torch.randint(1 << 32, ())))  # from the test's seed: replayable


def test_parity_brute_force():
    x, y = st.parity(16, 23, gen())
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (16, 23)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        acc = 0
        for b, lab in zip(row_x, row_y):
            assert b in (0, 1)
            acc ^= b
            assert lab == acc
    assert 0 < x.float().mean() < 1


def apply_word(word, n):
    """Brute force: run the permutation of {0..n-1} as a list through every element, in order."""
    arr = list(range(n))                 # arr[i] = P(i)
    out = []
    for p in word:
        arr = [p[arr[i]] for i in range(n)]   # P_t(i) = x_t(P_{t-1}(i))
        out.append(tuple(arr))
    return out


@pytest.mark.parametrize("group, size", [("s3", 6), ("s5", 120), ("a5", 60)])
def test_word_problem_brute_force(group, size):
    fn = {"s3": st.s3, "s5": st.s5, "a5": st.a5}[group]
    x, y = fn(8, 17, gen())
    elems = st.group_elements(group)
    assert len(elems) == size
    assert x.min() >= 0 and x.max() < size and y.min() >= 0 and y.max() < size
    n = int(group[1:])
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        expected = apply_word([elems[i] for i in row_x], n)
        assert [elems[i] for i in row_y] == expected
        assert row_y[0] == row_x[0]      # P_1 = x_1


def test_multiplication_order_is_documented_one():
    elems = st.group_elements("s3")
    swap01, swap12 = (1, 0, 2), (0, 2, 1)
    ids = torch.tensor([[elems.index(swap01), elems.index(swap12)]])
    # apply (0 1) first, then (1 2): 0 -> 1 -> 2, 1 -> 0 -> 0, 2 -> 2 -> 1
    table = st.multiplication_table("s3")
    assert elems[table[ids[0, 0], ids[0, 1]]] == (2, 0, 1)
    assert elems[table[ids[0, 1], ids[0, 0]]] == (1, 2, 0)     # the other order differs: non-abelian


@pytest.mark.parametrize("group", ["s3", "a5"])
def test_group_axioms(group):
    T = st.multiplication_table(group)
    m = T.shape[0]
    e = st.identity_id(group)
    ar = torch.arange(m)
    assert (T[e] == ar).all() and (T[:, e] == ar).all()
    for r in range(m):                                    # Latin square: every row/column a permutation
        assert sorted(T[r].tolist()) == list(range(m)) and sorted(T[:, r].tolist()) == list(range(m))
    for a, b, c in itertools.islice(itertools.product(range(m), repeat=3), 0, None, 7):
        assert T[T[a, b], c] == T[a, T[b, c]]
    assert all(st.is_even(p) for p in st.group_elements("a5"))


@pytest.mark.parametrize("max_depth", [3, 16])
def test_dyck1_brute_force(max_depth):
    x, y = st.dyck1(32, 41, gen(), max_depth=max_depth)
    _, yb = st.dyck1(4, 9, gen(), label="balanced")
    assert set(yb.unique().tolist()) <= {0, 1}
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        depth = 0
        for tok, lab in zip(row_x, row_y):
            if depth == 0:
                assert tok == st.OPEN       # a prefix of a valid word never closes at depth 0
            depth += 1 if tok == st.OPEN else -1
            assert 0 <= depth <= max_depth and lab == depth
    assert y.max() < st.dyck1_vocab_size(max_depth=max_depth)
    assert (x == st.CLOSE).any() and (y == 0).any()       # not all opening


def test_dyck1_balanced_matches_depth():
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    _, depth = st.dyck1(16, 30, g1, max_depth=4)
    _, bal = st.dyck1(16, 30, g2, max_depth=4, label="balanced")
    assert (bal == (depth == 0).long()).all()


@pytest.mark.parametrize("name", ["parity", "s3", "dyck1"])
def test_supervise_last_and_determinism(name):
    fn = {"parity": st.parity, "s3": st.s3, "dyck1": st.dyck1}[name]
    seed = int(torch.randint(1 << 32, ()))
    x1, y1 = fn(6, 12, torch.Generator().manual_seed(seed))
    x2, y2 = fn(6, 12, torch.Generator().manual_seed(seed), supervise="last")
    assert (x1 == x2).all()
    assert (y2[:, :-1] == st.IGNORE).all() and (y2[:, -1] == y1[:, -1]).all()
    x3, _ = fn(6, 12, torch.Generator().manual_seed(seed + 1))
    assert not (x3 == x1).all()


def test_bad_options():
    with pytest.raises(ValueError, match="supervise"):
        st.parity(2, 4, gen(), supervise="first")
    with pytest.raises(ValueError, match="group"):
        st.word_problem(2, 4, gen(), group="q8")
    with pytest.raises(ValueError, match="label"):
        st.dyck1(2, 4, gen(), label="height")
