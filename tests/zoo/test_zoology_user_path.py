"""A Zoology-style MQAR study (arXiv 2312.04927) as the README walks it: the generated data decoded by a plain
Python solver at test lengths other than the training one, impossible settings refused in one line that names the
knob and its limit (and, in a grid, the cell), and a tiny grid (2 mixers x 2 widths x 2 lengths) whose table rows
and learning curves are checked against each cell's recipe and recorded evaluations."""
import csv
import json
import random

import pytest
import torch
import yaml

from mixers.options import OptionError, build_options
from zoo.cli import main
from zoo.experiments.curves import write_curves
from zoo.tasks import TASKS
from zoo.tasks.transfer_base import Vocab

from .cli_errors import one_line_error


def make(name, **options):
    cls = TASKS.get(name)
    return cls(build_options(cls.Options, options))


def _mqar_by_hand(x: list[int], pairs: int) -> tuple[dict, list[float]]:
    """What one MQAR input says by itself: the context ``k1 v1 ... kn vn`` opens it and binds each key to the
    value after it; the mask marks that context."""
    context = 2 * pairs
    return dict(zip(x[0:context:2], x[1:context:2])), [1.0] * context + [0.0] * (len(x) - context)


def test_mqar_data_at_every_test_length_is_what_a_solver_reads_off_the_inputs():
    """Random fill on, odd and longer test lengths (``eval.seq_lens``), pairs up to the most the training length
    holds: every label is the value the context binds to the key at that position, every key is asked once at an
    even offset of the query region, nothing else is supervised, and the mask is the context."""
    pairs = random.randint(1, 6)
    V = 2 * pairs + 2 + random.randint(0, 40)
    T = 4 * pairs + random.randint(0, 3)
    task = make("mqar", vocab_size=V, seq_len=T, num_kv_pairs=pairs, random_fill=True)
    seed = random.randrange(1 << 20)
    for L in (T, T + 1 + random.randint(0, 20), 4 * T):
        data = task.make("test", seed, seq_len=L, num_examples=40)
        assert data.inputs.shape == data.labels.shape == data.mask.shape == (40, L)
        for x, y, m in zip(data.inputs.tolist(), data.labels.tolist(), data.mask.tolist()):
            binding, mask = _mqar_by_hand(x, pairs)
            assert len(binding) == pairs and all(1 <= k < V // 2 for k in binding)
            assert len(set(binding.values())) == pairs and all(V // 2 <= v < V for v in binding.values())
            asked = [t for t in range(L) if y[t] != -100]
            assert sorted(x[t] for t in asked) == sorted(binding), "every key is asked exactly once"
            assert all(t >= 2 * pairs and t % 2 == 0 and y[t] == binding[x[t]] for t in asked)
            assert m == mask
        again = task.make("test", seed, seq_len=L, num_examples=40)
        other = task.make("test", seed + 1, seq_len=L, num_examples=40)
        assert torch.equal(again.inputs, data.inputs) and torch.equal(again.labels, data.labels)
        assert not torch.equal(other.inputs, data.inputs)


def test_an_mqar_vocabulary_too_small_for_the_keys_names_the_limit_and_the_fix():
    """Keys come from [1, V/2): ``num_kv_pairs`` distinct keys need ``V >= 2 * pairs + 2``. The refusal says how
    many key ids the vocabulary holds and the smallest vocabulary that fits; that one is accepted."""
    pairs = random.randint(1, 40)
    least = 2 * pairs + 2
    for V in (least - 1, least - 2):
        with pytest.raises(OptionError) as refused:
            make("mqar", vocab_size=V, seq_len=4 * pairs, num_kv_pairs=pairs)
        message = str(refused.value)
        assert f"vocab_size {V} holds {V // 2 - 1} key ids" in message, message
        assert f"num_kv_pairs ({pairs})" in message and f"raise vocab_size to at least {least}" in message, message
    data = make("mqar", vocab_size=least, seq_len=4 * pairs, num_kv_pairs=pairs).make("train", 0, num_examples=8)
    keys = data.inputs[:, 0:2 * pairs:2]
    assert all(len(set(row)) == pairs for row in keys.tolist()) and int(keys.max()) < least // 2


@pytest.mark.parametrize("name,options,needed,knobs", [
    ("tool_trace", {"num_agents": 5}, lambda p, o: p + o["num_agents"], "num_kv_pairs or num_agents"),
    ("transfer_mix", {"num_agents": 3}, lambda p, o: p + o["num_agents"], "num_kv_pairs or num_agents"),
    ("multi_hop", {"hops": 3}, lambda p, o: p * o["hops"], "num_kv_pairs or hops"),
    ("system_prompt", {}, lambda p, o: p, "num_kv_pairs"),
])
def test_a_transfer_vocabulary_too_small_names_every_option_that_needs_keys(name, options, needed, knobs):
    """tool_trace's agents and multi_hop's hops take key ids too: the refusal names them beside num_kv_pairs (with
    agents alone over the key ids, lowering num_kv_pairs cannot help) and the smallest vocabulary that fits, which
    is accepted and draws that many distinct keys."""
    pairs = random.randint(2, 6)
    keys = needed(pairs, options)
    least = next(V for V in range(32, 10_000) if Vocab(V).keys[1] - Vocab(V).keys[0] >= keys)
    if least == 32:  # the smallest vocabulary a transfer task takes: ask for more keys than it holds
        pairs += 10
        keys = needed(pairs, options)
        least = next(V for V in range(32, 10_000) if Vocab(V).keys[1] - Vocab(V).keys[0] >= keys)
    common = {"seq_len": 512, "num_kv_pairs": pairs, **options}
    with pytest.raises(OptionError) as refused:
        make(name, vocab_size=least - 1, **common)
    message = str(refused.value)
    assert f"{keys} distinct keys are needed" in message and f"at least {least} or lower {knobs}" in message, message
    for knob, value in options.items():
        assert f"{knob} {value}" in message, message
    make(name, vocab_size=least, **common).make("test", 0, num_examples=2)


def test_a_grid_cell_with_more_pairs_than_its_length_holds_is_named(tmp_path, capsys):
    pairs = random.randint(2, 5)
    recipe = {"name": "z", "model": {"d_model": 16, "layers": ["attention"], "state_mixer": "none"},
              "task": {"name": "mqar", "vocab_size": 64, "seq_len": 4 * pairs, "num_kv_pairs": pairs,
                       "num_train": 64, "num_test": 16},
              "train": {"steps": 2, "batch_size": 8, "warmup_steps": 1, "threads": 1},
              "grid": [{"label": "fits", "task.num_kv_pairs": 1}, {"label": "too many", "task.num_kv_pairs": pairs + 1}]}
    path = tmp_path / "z.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    line = one_line_error(capsys, "check", path)
    assert "grid cell 'too many' (task.num_kv_pairs=" in line and "lower num_kv_pairs or raise seq_len" in line, line


GRID = {
    "name": "zoology grid",
    "seed": 0,
    "model": {"d_model": 16, "layers": ["attention", "attention"], "state_mixer": "none",
              "mixer_options": {"attention": {"n_heads": 2}, "mamba2": {"d_state": 4, "headdim": 8, "chunk_size": 8}}},
    "task": {"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": 2, "num_train": 128, "num_test": 32},
    "train": {"steps": 4, "batch_size": 8, "lr": 3.0e-3, "warmup_steps": 1, "threads": 1, "eval_every": 2},
}


def _tables(text: str) -> list[dict]:
    """The rows of the first markdown table of ``text``, as {column: text}."""
    block = [line for line in text.split("\n\n") if line.startswith("|")][0].splitlines()
    header = [c.strip() for c in block[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in row.strip("|").split("|")))) for row in block[2:]]


@pytest.mark.slow
def test_a_tiny_mqar_grid_puts_every_cell_in_its_row_and_draws_its_accuracy_curve(tmp_path):
    """2 mixers x 2 widths x 2 lengths through ``zoo ablate``: each table row holds the cell its label names, with
    the parameters of that width and the decode state of that length; ``python -m zoo.experiments.curves DIR`` on
    the recall grid draws each cell's test accuracy (untrained, every periodic evaluation, final) against
    step x batch x that cell's own length."""
    widths, lengths = sorted(random.sample([8, 16, 24], 2)), sorted(random.sample([8, 12, 16], 2))
    grid = {"model.layers": [["attention", "attention"], ["mamba2", "mamba2"]], "model.d_model": widths,
            "task.seq_len": lengths}
    path, out = tmp_path / "grid.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump({**GRID, "grid": grid}, sort_keys=False))
    assert main(["ablate", str(path), "--out", str(out), "--no-progress", "--no-plot"]) == 0
    rows = {r["label"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert len(rows) == 8
    for line in _tables((out / "results.md").read_text()):
        recipe = rows[line["cell"]]["recipe"]
        mixer, width, length = line["cell"].split()
        assert mixer == f"layers={line['layers']}" == "layers=" + "+".join(recipe["model"]["layers"])
        assert width == f"d_model={recipe['model']['d_model']}" and length == f"seq_len={recipe['task']['seq_len']}"
        assert float(line["test_accuracy"]) == pytest.approx(rows[line["cell"]]["metrics"]["test_accuracy"], abs=1e-4)
        if recipe["model"]["layers"][0] == "attention":  # K and V of every position, per layer
            assert int(line["state_size"]) == 2 * 2 * recipe["task"]["seq_len"] * recipe["model"]["d_model"]
    write_curves(out)
    with open(out / "curves.csv", newline="") as fh:
        drawn = list(csv.DictReader(fh))
    for label, row in rows.items():
        per_step = GRID["train"]["batch_size"] * row["recipe"]["task"]["seq_len"]
        expected = [(0, row["step0_metrics"]["test_accuracy"])]
        expected += [(h["step"] * per_step, h["test_accuracy"]) for h in row["history"]]
        expected += [(row["metrics"]["steps"] * per_step, row["metrics"]["test_accuracy"])]
        mine = [(int(p["tokens"]), float(p["test_accuracy"])) for p in drawn if p["cell"] == label]
        assert [t for t, _ in mine] == [t for t, _ in expected] == [0, 2 * per_step, 4 * per_step], label
        assert [a for _, a in mine] == pytest.approx([a for _, a in expected], abs=1e-6), label
    assert (out / "curves.png").stat().st_size > 0
