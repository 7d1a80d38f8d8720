"""Every synthetic task's generated data against the definition it claims, recomputed independently.

MQAR follows "Zoology: Measuring and Improving Recall in Efficient Language Models" (arXiv 2312.04927): keys
from ``[1, V/2)`` and values from ``[V/2, V)``, distinct within a sequence, the key-value pairs at the start,
every key queried once later with its value as the label, query offsets drawn without replacement with
probability ``~ g^(a-1)`` over the even offsets of the query region (the j-th drawn offset holds the j-th key),
the key-value context under the prefix mask. The group word problems label each position with the running
product of the group elements so far (S3, S4, S5 and A5 with 6, 24, 120 and 60 elements), parity with the
running parity; the recall and transfer tasks with the answers their module docstrings define. Each test draws
fresh data (a random seed, small sizes), decodes it with plain Python and checks the labels, the supervised
positions, the vocabularies, the mask, the determinism per seed and the separation of the train and test
streams."""
from __future__ import annotations

import functools
import itertools
import math
import random

import pytest
import torch

from mixers.options import build_options
from zoo.tasks import TASKS

IGNORE = -100
QUERY = 1


def make(name, **options):
    cls = TASKS.get(name)
    return cls(build_options(cls.Options, options))


def fresh_seed() -> int:
    return random.randrange(1 << 30)  # the test's seed (ZOO_TEST_SEED replays it) draws the data seed


def draw(task, num_examples, seq_len=None, split="train"):
    seed = fresh_seed()
    return seed, task.make(split, seed, seq_len=seq_len, num_examples=num_examples)


def supervised(labels_row):
    return [t for t, y in enumerate(labels_row) if y != IGNORE]


# --------------------------------------------------------------------------------------------------
# MQAR
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("random_fill", [False, True])
@pytest.mark.parametrize("value_gap", [0, 2])
def test_mqar_follows_the_zoology_layout_and_labels(random_fill, value_gap):
    V = random.choice([64, 65, 100, 257])
    pairs = random.randint(1, 8)
    stride = 2 + value_gap
    context = stride * pairs
    T = pairs * (4 + value_gap) + random.randint(0, 20)
    task = make("mqar", vocab_size=V, seq_len=T, num_kv_pairs=pairs, random_fill=random_fill, value_gap=value_gap)
    seed, data = draw(task, 60)
    half, space = V // 2, (T - context) // 2
    assert task.vocab_size == V and data.inputs.shape == data.labels.shape == data.mask.shape == (60, T)
    for x, y, m in zip(data.inputs.tolist(), data.labels.tolist(), data.mask.tolist()):
        keys, values = x[0:context:stride], x[stride - 1:context:stride]
        assert len(set(keys)) == pairs and all(1 <= k < half for k in keys), (seed, keys)
        assert len(set(values)) == pairs and all(half <= v < V for v in values), (seed, values)
        fillers = [x[t] for t in range(context) if t % stride not in (0, stride - 1)]
        if random_fill:
            assert not set(fillers) & set(keys + values), seed
        else:
            assert fillers == [0] * (value_gap * pairs), seed
        assert m == [1.0] * context + [0.0] * (T - context), seed
        bound = {x[t]: x[t + value_gap + 1] for t in range(0, context, stride)}
        queries = supervised(y)
        assert len(queries) == pairs, seed
        for t in queries:
            assert t >= context and (t - context) % 2 == 0 and (t - context) // 2 < space, (seed, t)
            assert x[t] in bound and y[t] == bound[x[t]], (seed, t)
        assert sorted(x[t] for t in queries) == sorted(keys), seed  # every key queried exactly once
        if not random_fill:
            assert all(x[t] == 0 for t in range(context, T) if t not in queries), seed


def ordered_gap_probabilities(space: int, a: float) -> dict[tuple[int, int], float]:
    """P(first drawn offset index = i, second = j) for two draws without replacement, weight (g + 1)^(a - 1)."""
    w = [(g + 1) ** (a - 1) for g in range(space)]
    total = sum(w)
    return {(i, j): w[i] / total * w[j] / (total - w[i]) for i in range(space) for j in range(space) if i != j}


@pytest.mark.parametrize("a", [0.3, 1.0])
def test_mqar_query_offsets_follow_the_power_law_in_the_order_of_the_keys(a):
    """Two pairs, five even offsets: the (first key's offset, second key's offset) counts against the exact
    probabilities of two ordered draws without replacement (each cell within six binomial deviations)."""
    pairs, space, n = 2, 5, 6000
    context = 2 * pairs
    task = make("mqar", vocab_size=128, seq_len=context + 2 * space, num_kv_pairs=pairs, power_a=a)
    seed, data = draw(task, n)
    counts = dict.fromkeys(ordered_gap_probabilities(space, a), 0)
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        offset = {x[t]: (t - context) // 2 for t in supervised(y)}
        counts[offset[x[0]], offset[x[2]]] += 1
    for cell, p in ordered_gap_probabilities(space, a).items():
        assert abs(counts[cell] - n * p) <= 6 * math.sqrt(n * p * (1 - p)) + 1, (seed, a, cell, counts[cell], n * p)


# --------------------------------------------------------------------------------------------------
# determinism and splits, every task
# --------------------------------------------------------------------------------------------------
ALL_TASKS = [("mqar", {"vocab_size": 512, "seq_len": 48}), ("assoc_recall", {}), ("mad_recall", {}),
             ("dyck1_next", {}), ("parity", {}), ("s3", {}), ("s4", {}), ("s5", {}), ("a5", {}), ("dyck1", {}),
             ("system_prompt", {}), ("tool_trace", {}), ("niah", {}), ("multi_hop", {"seq_len": 64}),
             ("common_word", {}), ("transfer_mix", {})]


def same(a, b) -> bool:
    masks = (a.mask is None and b.mask is None) or torch.equal(a.mask, b.mask)
    return torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels) and masks


@pytest.mark.parametrize("name,options", ALL_TASKS)
def test_a_seed_gives_the_same_data_and_train_test_and_other_seeds_differ(name, options):
    task = make(name, **options)
    seed = fresh_seed()
    train = task.make("train", seed, num_examples=32)
    assert same(train, task.make("train", seed, num_examples=32)), seed
    test = task.make("test", seed, num_examples=32)
    assert not torch.equal(train.inputs, test.inputs), seed
    assert not torch.equal(train.inputs, task.make("train", seed + 1, num_examples=32).inputs), seed
    if name in ("mqar", "system_prompt", "niah", "tool_trace", "multi_hop", "transfer_mix"):
        rows = {tuple(r) for r in train.inputs.tolist()}  # rich enough that a shared sequence means a shared stream
        assert not rows & {tuple(r) for r in test.inputs.tolist()}, seed


# --------------------------------------------------------------------------------------------------
# state tracking
# --------------------------------------------------------------------------------------------------
def sign(p: tuple) -> int:
    """+1 for an even permutation, -1 for an odd one, from its cycles."""
    seen, s = set(), 1
    for i in range(len(p)):
        length = 0
        while i not in seen:
            seen.add(i)
            i = p[i]
            length += 1
        if length and length % 2 == 0:
            s = -s
    return s


@functools.lru_cache(maxsize=None)
def elements(group: str) -> list[tuple]:
    n = int(group[1:])
    perms = sorted(itertools.permutations(range(n)))  # lexicographic ids
    return [p for p in perms if group[0] == "s" or sign(p) == 1]


@pytest.mark.parametrize("group,order", [("s3", 6), ("s4", 24), ("s5", 120), ("a5", 60)])
@pytest.mark.parametrize("supervise", ["all", "last"])
def test_group_word_problem_labels_are_running_products(group, order, supervise):
    elems = elements(group)
    assert len(elems) == order
    index = {p: i for i, p in enumerate(elems)}
    T = random.randint(1, 40)
    task = make(group, seq_len=T, supervise=supervise)
    assert task.vocab_size == order
    seed, data = draw(task, 80)
    assert data.mask is None
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        state, expect = tuple(range(len(elems[0]))), []
        for token in x:
            state = tuple(elems[token][state[i]] for i in range(len(state)))  # P_t(i) = x_t(P_{t-1}(i))
            expect.append(index[state])
        if supervise == "last":
            expect = [IGNORE] * (T - 1) + expect[-1:]
        assert y == expect, (seed, group, x)
    if T >= 10:
        assert len(set(data.inputs.flatten().tolist())) > order // 2, seed  # inputs range over the whole group


@pytest.mark.parametrize("supervise", ["all", "last"])
def test_parity_labels_are_the_running_parity(supervise):
    T = random.randint(1, 50)
    seed, data = draw(make("parity", seq_len=T, supervise=supervise), 100)
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        assert set(x) <= {0, 1}
        expect = [sum(x[:t + 1]) % 2 for t in range(T)]
        assert y == (expect if supervise == "all" else [IGNORE] * (T - 1) + expect[-1:]), (seed, x)


@pytest.mark.parametrize("label", ["depth", "balanced"])
def test_dyck1_prefixes_and_their_depth_labels(label):
    T, max_depth = random.randint(1, 40), random.randint(1, 5)
    task = make("dyck1", seq_len=T, max_depth=max_depth, label=label)
    seed, data = draw(task, 100)
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        depth, expect = 0, []
        for token in x:
            assert token in (0, 1) and not (depth == 0 and token == 1) and not (depth == max_depth and token == 0)
            depth += 1 if token == 0 else -1
            expect.append(depth if label == "depth" else int(depth == 0))
        assert y == expect, (seed, x)
        assert max(y) < task.vocab_size


# --------------------------------------------------------------------------------------------------
# memory tasks
# --------------------------------------------------------------------------------------------------
def test_assoc_recall_answers_with_the_latest_binding_of_the_query_key():
    V, T = random.randint(2, 20), random.randint(4, 60)
    task = make("assoc_recall", vocab_size=V, seq_len=T)
    assert task.vocab_size == V + 1
    seed, data = draw(task, 100)
    n, pad = (T - 2) // 2, T % 2
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        assert x[:pad] == [V] * pad and x[-2] == V, (seed, x)
        body = x[pad:-2]
        assert len(body) == 2 * n and all(0 <= s < V for s in body), (seed, x)
        keys, values = body[0::2], body[1::2]
        assert x[-1] in keys, (seed, x)
        latest = max(i for i, k in enumerate(keys) if k == x[-1])
        assert y == [IGNORE] * (T - 1) + [values[latest]], (seed, x)


@functools.lru_cache(maxsize=None)
def completable(depth: int, remaining: int, max_depth: int) -> bool:
    """A balanced word can be finished from ``depth`` with ``remaining`` tokens, staying in [0, max_depth]."""
    if not 0 <= depth <= max_depth:
        return False
    if remaining == 0:
        return depth == 0
    return completable(depth + 1, remaining - 1, max_depth) or completable(depth - 1, remaining - 1, max_depth)


def test_dyck1_next_words_are_balanced_and_labels_are_the_legal_next_brackets():
    T, max_depth = 2 * random.randint(1, 20), random.randint(1, 6)
    seed, data = draw(make("dyck1_next", seq_len=T, max_depth=max_depth), 100)
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        depth = 0
        for t, token in enumerate(x):
            assert token in (0, 1)
            depth += 1 if token == 0 else -1
            assert completable(depth, T - t - 1, max_depth), (seed, x)  # the word stays balanced and in depth
            if t == T - 1:
                assert y[t] == IGNORE
                continue
            legal = {c for c, d in ((0, depth + 1), (1, depth - 1)) if completable(d, T - t - 2, max_depth)}
            assert y[t] == {frozenset({0}): 0, frozenset({1}): 1, frozenset({0, 1}): 2}[frozenset(legal)], (seed, x, t)
        assert depth == 0


def test_mad_recall_supervises_repeated_keys_with_their_value():
    V, T = 2 * random.randint(2, 10), 2 * random.randint(2, 40)
    task = make("mad_recall", vocab_size=V, seq_len=T)
    seed, data = draw(task, 100)
    half = V // 2
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        keys, values = x[0::2], x[1::2]
        assert all(0 <= k < half for k in keys) and all(half <= v < V for v in values), (seed, x)
        binding, expect = {}, []
        for k, v in zip(keys, values):
            expect += [v if k in binding else IGNORE, IGNORE]  # the first occurrence of a key is not supervised
            assert binding.setdefault(k, v) == v, (seed, x)  # one value per key within a sequence
        assert y == expect, (seed, x)


# --------------------------------------------------------------------------------------------------
# transfer tasks
# --------------------------------------------------------------------------------------------------
def ranges(V):
    n = V - 4
    return range(4, 4 + 3 * n // 8), range(4 + 3 * n // 8, 4 + 6 * n // 8), range(4 + 6 * n // 8, V)


def split_row(x, y):
    """The body (everything before the first query marker) and the queries ``(key tokens, answer, label)``."""
    first = x.index(QUERY)
    body, queries, t = x[:first], [], first
    while t < len(x):
        assert x[t] == QUERY
        end = t + 1
        while y[end] == IGNORE:
            end += 1
        queries.append((tuple(x[t + 1:end + 1]), x[end + 1], y[end]))
        assert all(v == IGNORE for v in y[t:end]) and y[end + 1] == IGNORE
        t = end + 2
    assert all(v == IGNORE for v in y[:first])
    return body, queries


def check_transfer_row(x, y, m, V, facts_at, bound, asked, seed):
    keys, values, filler = ranges(V)
    body, queries = split_row(x, y)
    assert QUERY not in body and all(t >= 4 for t in body), seed
    assert [i for i, v in enumerate(m) if v] == facts_at, seed
    assert all(body[i] in filler for i in range(len(body)) if i not in facts_at), seed
    assert len(queries) == asked, seed
    assert len({q for q, _, _ in queries}) == len(queries), seed  # each query on a different fact
    for key, answer, label in queries:
        assert all(k in keys for k in key) and answer in values and label == answer, seed
        assert bound[key] == answer, (seed, key)
    return body


@pytest.mark.parametrize("name", ["system_prompt", "niah", "common_word"])
def test_key_value_transfer_tasks(name):
    V, pairs = random.choice([64, 128, 300]), random.randint(3, 6)
    num_queries = random.randint(0, pairs)
    extra = {"num_common": random.randint(2, pairs - 1)} if name == "common_word" else {}
    T = 2 * pairs + 3 * pairs + random.randint(0, 30)
    task = make(name, vocab_size=V, seq_len=T, num_kv_pairs=pairs, num_queries=num_queries, **extra)
    seed, data = draw(task, 60)
    keys, values, _ = ranges(V)
    for x, y, m in zip(data.inputs.tolist(), data.labels.tolist(), data.mask.tolist()):
        first = x.index(QUERY)
        facts_at = [i for i in range(first) if x[i] in keys or x[i] in values]
        if name == "niah":
            starts = facts_at[0::2]
            assert all(x[i] in keys and x[i + 1] in values for i in starts), seed
            assert facts_at == sorted(itertools.chain.from_iterable((i, i + 1) for i in starts)), seed
        else:
            assert facts_at == list(range(2 * pairs)), seed
        bound = {(x[i],): x[i + 1] for i in facts_at[0::2]}
        assert len(bound) == pairs and all(k in keys for (k,) in bound), seed
        pool = extra["num_common"] if name == "common_word" else pairs  # common_word asks the common word's keys
        body = check_transfer_row(x, y, m, V, facts_at, bound, pool if num_queries == 0 else min(num_queries, pool),
                                  seed)
        if name == "common_word":
            counts = sorted((list(bound.values()).count(v) for v in set(bound.values())), reverse=True)
            assert counts == [extra["num_common"]] + [1] * (pairs - extra["num_common"]), seed
            common = max(set(bound.values()), key=list(bound.values()).count)
            assert all(a == common for _, a, _ in split_row(x, y)[1]), seed  # the queries ask the common word
        else:
            assert len(set(bound.values())) == pairs, seed
        if name == "system_prompt":
            assert len(body) == first and facts_at == list(range(2 * pairs)), seed


def test_tool_trace_calls_and_queries():
    V, pairs, agents = 200, random.randint(2, 6), random.randint(1, 4)
    T = 3 * pairs + 4 * pairs + random.randint(0, 30)
    task = make("tool_trace", vocab_size=V, seq_len=T, num_kv_pairs=pairs, num_agents=agents, num_queries=0)
    seed, data = draw(task, 60)
    keys = ranges(V)[0]
    for x, y, m in zip(data.inputs.tolist(), data.labels.tolist(), data.mask.tolist()):
        first = x.index(QUERY)
        calls = [i for i in range(first) if x[i] in keys and x[i + 1] in keys]
        assert len(calls) == pairs and calls[0] == 0, seed  # a call opens the trace
        tools = [x[i + 1] for i in calls]
        assert len(set(tools)) == pairs and not set(tools) & {x[i] for i in calls}, seed
        assert len({x[i] for i in calls}) <= agents, seed
        bound = {(x[i], x[i + 1]): x[i + 2] for i in calls}
        facts_at = [i + d for i in calls for d in range(3)]
        check_transfer_row(x, y, m, V, facts_at, bound, pairs, seed)


def test_multi_hop_answers_are_chain_ends():
    V, pairs, hops = 300, random.randint(2, 4), random.randint(1, 4)
    T = 2 * hops * pairs + 3 * pairs + random.randint(0, 20)
    task = make("multi_hop", vocab_size=V, seq_len=T, num_kv_pairs=pairs, hops=hops, num_queries=0)
    seed, data = draw(task, 60)
    keys, values, _ = ranges(V)
    for x, y, m in zip(data.inputs.tolist(), data.labels.tolist(), data.mask.tolist()):
        facts = x[:2 * hops * pairs]
        edges = dict(zip(facts[0::2], facts[1::2]))
        assert len(edges) == hops * pairs and all(a in keys for a in edges), seed
        starts = set(edges) - set(edges.values())
        assert len(starts) == pairs, seed
        bound = {}
        for k0 in starts:
            node = k0
            for _ in range(hops):
                node = edges[node]
            assert node in values, seed
            bound[(k0,)] = node
        check_transfer_row(x, y, m, V, list(range(2 * hops * pairs)), bound, pairs, seed)


@pytest.mark.parametrize("fraction", [0.0, 1.0, 0.5])
def test_transfer_mix_rows_are_system_prompt_or_tool_trace_and_body_mask(fraction):
    V, pairs = 200, 3
    task = make("transfer_mix", vocab_size=V, seq_len=40, num_kv_pairs=pairs, tool_trace_fraction=fraction,
                mask="body")
    seed, data = draw(task, 200)
    keys, _, _ = ranges(V)
    tool_rows = 0
    for x, y, m in zip(data.inputs.tolist(), data.labels.tolist(), data.mask.tolist()):
        first = x.index(QUERY)
        assert m == [1.0] * first + [0.0] * (len(x) - first), seed
        _, queries = split_row(x, y)
        tool = len(queries[0][0]) == 2
        tool_rows += tool
        for key, answer, _ in queries:  # the key tokens and the answer stand together in the body, once
            spans = [i for i in range(first - len(key)) if tuple(x[i:i + len(key)]) == key]
            assert len(spans) == 1 and x[spans[0] + len(key)] == answer, seed
        if not tool:
            assert all(x[i] in keys for i in range(0, 2 * pairs, 2)), seed
    if fraction in (0.0, 1.0):
        assert tool_rows == fraction * 200, seed
    else:
        assert 40 < tool_rows < 160, seed
