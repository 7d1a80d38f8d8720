"""The transfer-retrieval tasks and ``eval.tasks``: every generated example decoded in plain Python."""
import pytest
import torch

from mixers.options import OptionError, build_options
from zoo.errors import UserError
from zoo.recipes import resolve
from zoo.tasks import TASKS
from zoo.tasks.transfer_base import IGNORE, QUERY, Vocab

FIVE = ["system_prompt", "tool_trace", "niah", "multi_hop", "common_word"]
ALL = FIVE + ["transfer_mix"]
#: tokens of a query before its labelled (last key) position: Q, then the keys before the last
KEYS_BEFORE = {"tool_trace": 1}


def make(name, **options):
    cls = TASKS.get(name)
    return cls(build_options(cls.Options, options))


def supervised(y):
    return [t for t, label in enumerate(y) if label != IGNORE]


def query_start(name, x, t):
    """Position of the Q marker of the query labelled at ``t``."""
    before = KEYS_BEFORE.get(name, 0)
    if name == "transfer_mix":  # a tool_trace query has two key tokens
        before = 1 if x[t - 1] != QUERY else 0
    return t - 1 - before


@pytest.mark.parametrize("name", ALL)
def test_shapes_vocab_and_labels_only_at_queries(name):
    V, T = 96, 80
    task = make(name, vocab_size=V, seq_len=T, num_kv_pairs=4, num_queries=3)
    data = task.make("train", seed=3, num_examples=40)
    assert data.inputs.shape == data.labels.shape == data.mask.shape == (40, T)
    assert task.vocab_size == V and 0 <= int(data.inputs.min()) and int(data.inputs.max()) < V
    lo, hi = Vocab(V).values
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        sup = supervised(y)
        assert len(sup) == 3, "num_queries=3 of 4 facts: three queries per sequence"
        for t in sup:
            assert lo <= y[t] < hi, "answers are value tokens"
            assert x[query_start(name, x, t)] == QUERY, "a label sits on the last key token of a query"
            assert t + 1 < T and x[t + 1] == y[t], "the answer follows as the next input"
        assert sup[-1] == T - 2, "the queries close the sequence"


def _facts(x, m):
    """The masked (fact) tokens as runs of consecutive positions."""
    runs, run = [], []
    for tok, w in zip(x, m):
        if w:
            run.append(tok)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


@pytest.mark.parametrize("name", ["system_prompt", "niah", "common_word", "tool_trace"])
def test_answer_is_bound_to_the_queried_key_in_the_masked_facts(name):
    task = make(name, vocab_size=128, seq_len=96, num_kv_pairs=5, min_kv_pairs=2, num_queries=0)
    data = task.make("test", seed=11, num_examples=60)
    width = 3 if name == "tool_trace" else 2
    for x, y, m in zip(data.inputs.tolist(), data.labels.tolist(), data.mask.tolist()):
        facts = [tuple(run[i:i + width]) for run in _facts(x, m) for i in range(0, len(run), width)]
        assert all(len(f) == width for f in facts), "the mask covers whole facts"
        binding = {f[:-1]: f[-1] for f in facts}
        assert len(binding) == len(facts), "keys are distinct"
        for t in supervised(y):
            key = tuple(x[t - width + 2: t + 1])
            assert binding[key] == y[t]
            assert m[t] == 0


@pytest.mark.parametrize("hops", [1, 2, 3])
def test_multi_hop_chain_resolves_to_the_label(hops):
    task = make("multi_hop", vocab_size=128, seq_len=80, num_kv_pairs=4, hops=hops, num_queries=0)
    data = task.make("train", seed=5, num_examples=40)
    keys = Vocab(128).keys
    for x, y, m in zip(data.inputs.tolist(), data.labels.tolist(), data.mask.tolist()):
        n_fact = int(sum(m))
        assert n_fact == 2 * hops * 4 and m[:n_fact] == [1.0] * n_fact, "the facts open the sequence, masked"
        edges = dict(zip(x[0:n_fact:2], x[1:n_fact:2]))
        assert len(edges) == hops * 4
        for t in supervised(y):
            node = x[t]
            for _ in range(hops):
                node = edges[node]
            assert node == y[t]
            if hops > 1:
                assert edges[x[t]] != y[t] and keys[0] <= edges[x[t]] < keys[1], "the first hop is not the answer"


def test_mask_marks_facts_and_everything_else_is_filler():
    V = 128
    voc = Vocab(V)
    for name in ALL:
        data = make(name, vocab_size=V, seq_len=72, num_kv_pairs=4).make("train", 2, num_examples=30)
        for x, y, m in zip(data.inputs.tolist(), data.labels.tolist(), data.mask.tolist()):
            first_query = min(query_start(name, x, t) for t in supervised(y))
            for t in range(first_query):
                in_facts = voc.keys[0] <= x[t] < voc.values[1]
                assert in_facts == bool(m[t]), (name, t, x[t], m[t])
            assert not any(m[first_query:])
            assert all(x[t] < voc.filler[0] for t in range(first_query, 72)), "no filler among the queries"


@pytest.mark.parametrize("name", ALL)
def test_body_mask_marks_every_token_before_the_queries_and_keeps_the_sequences(name):
    seed = int(torch.randint(1 << 30, ()))
    facts = make(name, vocab_size=128, seq_len=72, num_kv_pairs=4).make("test", seed, num_examples=20)
    body = make(name, vocab_size=128, seq_len=72, num_kv_pairs=4, mask="body").make("test", seed, num_examples=20)
    assert torch.equal(facts.inputs, body.inputs) and torch.equal(facts.labels, body.labels), seed
    for x, y, m in zip(body.inputs.tolist(), body.labels.tolist(), body.mask.tolist()):
        first_query = min(query_start(name, x, t) for t in supervised(y))
        assert m == [1.0] * first_query + [0.0] * (72 - first_query), (seed, name)
    assert bool((body.mask >= facts.mask).all()), "the facts lie in the body"


def test_the_default_mask_is_left_out_of_the_resolved_recipe_and_body_is_recorded():
    assert "mask" not in resolve(recipe()).plain["task"]
    body = resolve(recipe(tasks=[{"name": "niah"}]), ["task.mask=body"])
    assert body.plain["task"]["mask"] == "body" and body.eval_tasks[0][1].options.mask == "body"


def test_niah_needles_sit_at_varied_depths():
    data = make("niah", seq_len=128, num_kv_pairs=1, num_queries=1).make("train", 0, num_examples=200)
    depth = data.mask.argmax(dim=1).float()
    assert depth.min() < 20 and depth.max() > 100


def test_common_word_is_the_repeated_value():
    task = make("common_word", vocab_size=128, seq_len=64, num_kv_pairs=6, num_common=3, num_queries=2)
    data = task.make("train", 9, num_examples=40)
    for x, y in zip(data.inputs.tolist(), data.labels.tolist()):
        values = x[1:12:2]
        common = max(set(values), key=values.count)
        assert values.count(common) == 3 and len(set(values)) == 4
        assert {y[t] for t in supervised(y)} == {common}


def test_kv_pairs_vary_per_sequence_and_queries_are_capped():
    data = make("system_prompt", seq_len=64, num_kv_pairs=6, min_kv_pairs=2,
                num_queries=4).make("train", 0, num_examples=300)
    facts = data.mask.sum(dim=1) / 2
    assert set(facts.long().tolist()) == {2, 3, 4, 5, 6}
    queries = (data.labels != IGNORE).sum(dim=1)
    assert torch.equal(queries, torch.clamp(facts.long(), max=4))


def test_mix_draws_both_kinds():
    def tool_rows(fraction):
        data = make("transfer_mix", seq_len=64, tool_trace_fraction=fraction).make("train", 0, num_examples=400)
        return sum(1 for x in data.inputs.tolist() if x[-3] != QUERY)  # a tool query is Q agent tool result
    assert tool_rows(0.0) == 0
    assert tool_rows(1.0) == 400
    assert 150 < tool_rows(0.5) < 250


@pytest.mark.parametrize("name", ALL)
def test_seeded_fresh_and_splits_differ(name):
    task = make(name, seq_len=64)
    a, b = task.make("train", 7, num_examples=50), task.make("train", 7, num_examples=50)
    assert torch.equal(a.inputs, b.inputs) and torch.equal(a.labels, b.labels) and torch.equal(a.mask, b.mask)
    assert not torch.equal(a.inputs, task.make("test", 7, num_examples=50).inputs)
    assert not torch.equal(a.inputs, task.make("train", 8, num_examples=50).inputs)
    assert len({tuple(r) for r in a.inputs.tolist()}) == 50, "every sequence is a fresh draw"
    longer = task.make("test", 7, seq_len=256, num_examples=5)
    assert longer.inputs.shape == (5, 256)


@pytest.mark.parametrize("name, options, words", [
    ("system_prompt", {"min_kv_pairs": 5, "num_kv_pairs": 4}, "min_kv_pairs"),
    ("system_prompt", {"seq_len": 16, "num_kv_pairs": 6}, "seq_len"),
    ("multi_hop", {"vocab_size": 32, "num_kv_pairs": 6, "hops": 3}, "key ids"),
    ("common_word", {"num_kv_pairs": 2, "num_common": 3}, "num_common"),
    ("tool_trace", {"num_agents": 0}, "num_agents"),
    ("niah", {"needles": 2}, "needles"),
])
def test_bad_options_are_refused_with_the_reason(name, options, words):
    with pytest.raises(OptionError, match=words):
        make(name, **options)


def test_too_short_test_length_is_refused():
    with pytest.raises(ValueError, match="too short"):
        make("tool_trace", seq_len=64, num_kv_pairs=6).make("test", 0, seq_len=20)


# --------------------------------------------------------------------------------------- eval.tasks
def recipe(**eval_section):
    return {"model": {"d_model": 16, "layers": ["mamba2", {"ska": {"mode": "prefix", "power": 1}}],
                      "mixer_options": {"mamba2": {"d_state": 4, "headdim": 8}, "ska": {"n_heads": 2, "rank": 4}}},
            "task": {"name": "transfer_mix", "vocab_size": 64, "seq_len": 32, "num_kv_pairs": 3,
                     "num_train": 64, "num_test": 8},
            "train": {"steps": 3, "batch_size": 8, "warmup_steps": 1, "threads": 1, "device": "cpu"},
            "eval": eval_section}


def test_without_eval_tasks_the_resolved_recipe_is_unchanged():
    r = resolve(recipe(seq_lens=[48]))
    assert "tasks" not in r.plain["eval"] and r.eval_tasks == []


def test_eval_task_entries_inherit_shared_options():
    r = resolve(recipe(tasks=[{"label": "hop", "name": "multi_hop", "num_kv_pairs": 2}, {"name": "niah"}]))
    (hop_label, hop), (niah_label, niah) = r.eval_tasks
    assert (hop_label, niah_label) == ("hop", "niah")
    assert hop.options.vocab_size == 64 and hop.options.seq_len == 32 and hop.options.num_kv_pairs == 2
    assert niah.options.num_kv_pairs == 3 and niah.options.num_test == 8
    assert r.plain["eval"]["tasks"][0]["hops"] == 2
    assert r.key != resolve(recipe()).key


@pytest.mark.parametrize("tasks, words", [
    ([{"name": "niah", "vocab_size": 128}], "vocabulary size 128"),
    ([{"name": "niah"}, {"name": "niah"}], "distinct label"),
    ([{"name": "naih"}], "did you mean 'niah'"),
    ([{"label": "a b", "name": "niah"}], "short name"),
    ([{"name": "niah", "hops": 2}], "hops"),
    ([{"name": "mqar", "vocab_size": 64, "num_kv_pairs": 2}], None),
])
def test_bad_eval_tasks_are_refused(tasks, words):
    if words is None:  # a different task family is fine as long as the vocabulary matches
        assert resolve(recipe(tasks=tasks)).eval_tasks[0][1].name == "mqar"
        return
    with pytest.raises(UserError, match=words):
        resolve(recipe(tasks=tasks))


@pytest.mark.parametrize("entry", [{"name": "tool_trace"}, {"name": "mqar", "vocab_size": 64, "num_kv_pairs": 5}])
def test_eval_tasks_length_checked_against_seq_lens(entry):
    with pytest.raises(UserError, match="too short.*eval.seq_lens asks for 16"):
        resolve(recipe(seq_lens=[16], tasks=[entry]))


def test_a_recipe_with_eval_tasks_trains_and_reports_task_metrics():
    from zoo import train
    r = resolve(recipe(seq_lens=[48], tasks=[{"label": "sp", "name": "system_prompt"},
                                             {"label": "hop", "name": "multi_hop", "num_kv_pairs": 2}]))
    metrics = train(r, progress=False).metrics
    for key in ("test_accuracy@task=sp", "test_accuracy@task=sp@48", "test_accuracy@task=hop",
                "test_accuracy@task=hop@48", "test_accuracy@48"):
        assert 0.0 <= metrics[key] <= 1.0, key


def test_claims_read_the_lengths_of_task_metrics():
    from zoo.experiments.claims.cells import CellStats
    row = {"metrics": {"test_accuracy@task=niah": 0.5, "test_accuracy@task=niah@128": 0.4, "test_accuracy@128": 0.3},
           "recipe": {"seed": 0}}
    cell = CellStats("t", "c", [row])
    assert cell.lengths("test_accuracy@task=niah") == ["test_accuracy@task=niah", "test_accuracy@task=niah@128"]
    assert cell.lengths("test_accuracy") == ["test_accuracy", "test_accuracy@128"]
