"""What the recall task generators promise about their draws, rebuilt from the generated tokens with plain loops:
every symbol of a declared range is drawn, every pair or fact position can be the one asked, a row never asks
one fact twice, and nothing in the layout gives the answer away by position (facts shuffled, needles and tool
outputs spread evenly)."""
import collections
import math

import pytest
import torch

from mixers.options import build_options
from zoo.tasks import TASKS
from zoo.tasks.transfer_base import IGNORE, NUM_SPECIAL, QUERY, Vocab


def make(name, **options):
    cls = TASKS.get(name)
    return cls(build_options(cls.Options, options))


def seed():
    return int(torch.randint(1 << 30, ()))


def supervised(y):
    return [t for t, label in enumerate(y) if label != IGNORE]


# ------------------------------------------------------------------------------------------- mqar
def test_mqar_keys_and_values_cover_their_whole_ranges():
    V = 16  # keys 1..7, values 8..15
    data = make("mqar", vocab_size=V, seq_len=32, num_kv_pairs=4, random_fill=False).make("train", seed(),
                                                                                          num_examples=400)
    keys = {k for row in data.inputs[:, 0:8:2].tolist() for k in row}
    values = {v for row in data.inputs[:, 1:8:2].tolist() for v in row}
    assert keys == set(range(1, V // 2))
    assert values == set(range(V // 2, V))


# ----------------------------------------------------------------------------------- assoc_recall
def test_assoc_recall_keys_and_values_cover_every_symbol():
    V, L = 20, 40
    data = make("assoc_recall", vocab_size=V, seq_len=L).make("train", seed(), num_examples=300)
    pairs = data.inputs[:, :L - 2]  # even L: no pad
    assert set(pairs[:, 0::2].unique().tolist()) == set(range(V))
    assert set(pairs[:, 1::2].unique().tolist()) == set(range(V))


def test_assoc_recall_asks_every_pair_position_equally_often():
    """With a vocabulary far larger than the pairs, keys rarely repeat, so the latest binding of the query key is
    the pair that was drawn: each of the ``n`` pairs, the most recent one included, is asked about ``1/n`` of the
    time."""
    L, rows = 12, 3000
    n = (L - 2) // 2
    data = make("assoc_recall", vocab_size=5000, seq_len=L).make("train", seed(), num_examples=rows)
    counts = collections.Counter()
    for x in data.inputs.tolist():
        keys = x[0:2 * n:2]
        counts[max(i for i, k in enumerate(keys) if k == x[-1])] += 1
    assert set(counts) == set(range(n))
    for i in range(n):
        assert 0.7 * rows / n < counts[i] < 1.3 * rows / n, counts


# ------------------------------------------------------------------------------------- mad_recall
def test_mad_recall_keys_and_values_cover_their_ranges_and_each_sequence_has_its_own_map():
    V, L = 8, 32
    half = V // 2
    data = make("mad_recall", vocab_size=V, seq_len=L).make("train", seed(), num_examples=400)
    keys, values = data.inputs[:, 0::2], data.inputs[:, 1::2]
    assert set(keys.unique().tolist()) == set(range(half))
    assert set(values.unique().tolist()) == set(range(half, V))
    maps = collections.defaultdict(set)  # key -> the values it carries in the different sequences
    for ks, vs in zip(keys.tolist(), values.tolist()):
        for k, v in zip(ks, vs):
            maps[k].add(v)
    assert all(maps[k] == set(range(half, V)) for k in range(half)), "a key's value is drawn per sequence"


# --------------------------------------------------------------------------------- transfer tasks
@pytest.mark.parametrize("V", [32, 96, 128, 1001])
def test_transfer_vocabulary_ranges_are_disjoint_and_follow_the_documented_split(V):
    n = V - NUM_SPECIAL
    vocab = Vocab(V)
    assert vocab.keys == (4, 4 + 3 * n // 8)
    assert vocab.values == (4 + 3 * n // 8, 4 + 6 * n // 8)
    assert vocab.filler == (4 + 6 * n // 8, V)
    ranges = [set(range(*r)) for r in (vocab.keys, vocab.values, vocab.filler)]
    assert set().union(*ranges) == set(range(NUM_SPECIAL, V)) and sum(map(len, ranges)) == n


def queried_keys(name, x, y):
    """The key tokens of each query of a row (agent and tool for tool_trace)."""
    width = 2 if name == "tool_trace" else 1
    return [tuple(x[t - width + 1:t + 1]) for t in supervised(y)]


@pytest.mark.parametrize("name", ["system_prompt", "tool_trace", "niah", "multi_hop", "common_word"])
def test_a_row_never_asks_the_same_fact_twice(name):
    task = make(name, vocab_size=128, seq_len=96, num_kv_pairs=5, num_queries=4)
    data = task.make("train", seed(), num_examples=200)
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        asked = queried_keys(name, x, y)
        assert asked and len(set(asked)) == len(asked), asked
        assert all(x[t - len(k)] == QUERY for t, k in zip(supervised(y), asked))


def call_starts(m):
    """Where each ``agent tool result`` call starts: masked runs, read three tokens at a time (calls with no
    output between them form one run)."""
    starts, t = [], 0
    while t < len(m):
        if m[t]:
            starts.append(t)
            t += 3
        else:
            t += 1
    return starts


@pytest.mark.parametrize("agents", [1, 4])
@pytest.mark.parametrize("name,options", [("tool_trace", {}), ("transfer_mix", {"tool_trace_fraction": 1.0})])
def test_tool_calls_come_from_a_pool_of_agents_that_are_never_tools(name, options, agents):
    task = make(name, vocab_size=128, seq_len=96, num_kv_pairs=5, num_agents=agents, **options)
    data = task.make("train", seed(), num_examples=200)
    lo, hi = Vocab(128).keys
    pools = []
    for x, m in zip(data.inputs.tolist(), data.mask.tolist()):
        calls = [tuple(x[t:t + 3]) for t in call_starts(m)]
        assert len(calls) == 5
        tools = [c[1] for c in calls]
        used = {c[0] for c in calls}
        assert len(set(tools)) == 5, "tools are distinct within a sequence"
        assert not used & set(tools), "an agent id is never one of the sequence's tools"
        assert len(used) <= agents and all(lo <= a < hi for a in used)
        pools.append(len(used))
    assert max(pools) == min(agents, 5), "the whole pool is used"


def test_tool_trace_outputs_are_equally_long_on_average_after_every_call():
    pairs, T, rows = 4, 200, 600
    data = make("tool_trace", vocab_size=128, seq_len=T, num_kv_pairs=pairs, num_queries=2).make(
        "train", seed(), num_examples=rows)
    gap = T - 3 * pairs - 4 * 2
    totals = [0] * pairs
    for m in data.mask.tolist():
        starts = call_starts(m)
        ends = starts[1:] + [T - 4 * 2]
        spans = [e - s - 3 for s, e in zip(starts, ends)]
        assert sum(spans) == gap and min(spans) >= 0
        totals = [a + b for a, b in zip(totals, spans)]
    for total in totals:
        assert abs(total / rows - gap / pairs) < 0.2 * gap / pairs, [t / rows for t in totals]


def test_niah_needles_take_every_slot_of_the_haystack_evenly():
    """Each slot's count is binomial: within six standard deviations of ``rows / slots`` (a correct generator fails
    about once in 20 million runs; half the expected count at 1,200 rows was 5.2 of them), while a slot at half or
    one and a half times its share lies 10 of them away."""
    T, rows = 16, 4800
    hay = T - 3  # one query: Q k v
    data = make("niah", vocab_size=128, seq_len=T, num_kv_pairs=1, num_queries=1).make("train", seed(),
                                                                                       num_examples=rows)
    counts = collections.Counter()
    for x, m in zip(data.inputs.tolist(), data.mask.tolist()):
        slot = m.index(1.0)
        assert m[:hay] == [0.0] * slot + [1.0, 1.0] + [0.0] * (hay - slot - 2)
        assert x[hay:] == [QUERY, x[slot], x[slot + 1]], "the query asks the needle"
        counts[slot] += 1
    slots = hay - 1  # the needle k v fits at 0 .. hay - 2
    assert set(counts) == set(range(slots))
    share = 1 / slots
    spread = math.sqrt(rows * share * (1 - share))
    assert all(abs(c - rows * share) <= 6 * spread for c in counts.values()), counts


def test_niah_needles_reach_the_end_of_the_haystack_with_several_needles():
    pairs, T, rows = 3, 20, 600
    hay = T - 3 * pairs
    data = make("niah", vocab_size=128, seq_len=T, num_kv_pairs=pairs, num_queries=0).make("train", seed(),
                                                                                           num_examples=rows)
    masks = data.mask[:, :hay]
    assert bool((masks.sum(1) == 2 * pairs).all())
    assert bool((masks > 0).any(0).all()), "every haystack position holds a needle token in some row"


def test_multi_hop_facts_are_shuffled_across_chains():
    """Written in chain order, ``k0 k1`` would always be followed by ``k1 k2``: the answer would sit at a fixed
    distance from the queried key. Shuffled, the next fact continues the chain about ``1 / (facts - 1)`` of the
    time, and a chain's first fact sits anywhere."""
    pairs, hops, rows = 4, 2, 400
    task = make("multi_hop", vocab_size=128, seq_len=64, num_kv_pairs=pairs, hops=hops, num_queries=0)
    data = task.make("train", seed(), num_examples=rows)
    facts = pairs * hops
    follows, first_positions = 0, collections.Counter()
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        edges = [(x[2 * i], x[2 * i + 1]) for i in range(facts)]
        for t in supervised(y):
            i = next(j for j, (a, _b) in enumerate(edges) if a == x[t])
            first_positions[i] += 1
            follows += i + 1 < facts and edges[i + 1][0] == edges[i][1]
    asked = sum(first_positions.values())
    assert follows / asked < 0.35, follows / asked
    assert set(first_positions) == set(range(facts))


def test_common_word_facts_sit_at_every_position():
    pairs, common, rows = 6, 3, 400
    task = make("common_word", vocab_size=128, seq_len=64, num_kv_pairs=pairs, num_common=common)
    data = task.make("train", seed(), num_examples=rows)
    at = [0] * pairs
    for x in data.inputs.tolist():
        values = x[1:2 * pairs:2]
        word = max(set(values), key=values.count)
        for i, v in enumerate(values):
            at[i] += v == word
    for count in at:  # each position holds the common word common / pairs of the time
        assert 0.3 < count / rows < 0.7, at


@pytest.mark.parametrize("common_only", [True, False])
def test_common_word_queries_ask_the_keys_the_option_names(common_only):
    pairs, common = 6, 3
    task = make("common_word", vocab_size=128, seq_len=64, num_kv_pairs=pairs, num_common=common, num_queries=2,
                query_common_only=common_only)
    data = task.make("train", seed(), num_examples=300)
    asked_common = asked = 0
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        values = x[1:2 * pairs:2]
        word = max(set(values), key=values.count)
        for t in supervised(y):
            asked += 1
            asked_common += y[t] == word
    if common_only:
        assert asked_common == asked
    else:  # any key: the common word's keys are common / pairs of them
        assert 0.35 < asked_common / asked < 0.65, asked_common / asked
