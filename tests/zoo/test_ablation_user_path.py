"""The ablation path as the README walks it: a labelled grid with seeds through ``zoo ablate``, its tables checked
against numbers worked out here from ``results.jsonl`` and from the models rebuilt from each row's recipe (the
parameter count, and the decode state measured by stepping the layers), a renamed / added / removed cell, and a
test-time sweep compared with evaluating the same checkpoint at each knob value."""
import csv
import json
import math
import random

import pytest
import torch
import yaml

import zoo
from zoo.cli import main

BASE = {
    "name": "user path",
    "model": {"d_model": 16, "layers": ["attention", "attention"], "state_mixer": "swiglu",
              "mixer_options": {"attention": {"n_heads": 2}, "mamba2": {"d_state": 4, "headdim": 8, "chunk_size": 8},
                                "gka": {"num_iter": 2}}},
    "task": {"name": "mqar", "vocab_size": 32, "seq_len": 12, "num_kv_pairs": 2, "num_train": 128, "num_test": 32},
    "train": {"steps": 4, "batch_size": 8, "lr": 3.0e-3, "warmup_steps": 1, "threads": 1},
}


def _ablate(tmp_path, grid, seeds, name="grid.yaml", **extra):
    recipe = {**BASE, **extra, "seeds": seeds, "grid": grid}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    out = tmp_path / "out"
    assert main(["ablate", str(path), "--out", str(out), "--no-progress", "--no-plot"]) == 0
    return out


def _rows(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


def _tables(out) -> list[list[dict]]:
    """Every markdown table of results.md, as a list of {column: text} rows."""
    tables, lines = [], (out / "results.md").read_text().splitlines() + [""]
    block: list[str] = []
    for line in lines:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            header = [c.strip() for c in block[0].strip("|").split("|")]
            tables.append([dict(zip(header, (c.strip() for c in row.strip("|").split("|")))) for row in block[2:]])
            block = []
    return tables


def _mean_sample_std(values):
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _rebuilt(recipe_dict: dict, folder):
    """The untrained model of a row's recorded recipe, loaded afresh from a file of its model and task."""
    model = {k: recipe_dict["model"][k] for k in ("d_model", "layers", "state_mixer", "mixer_options",
                                                   "state_mixer_options")}
    path = folder / f"rebuilt{len(list(folder.glob('rebuilt*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump({"model": model, "task": recipe_dict["task"], "seed": recipe_dict["seed"]}))
    return zoo.build_model(zoo.load(str(path)))


def _stepped_state_elements(recipe_dict: dict, folder) -> int:
    """The decode state of the model a row's recipe builds, counted tensor by tensor after stepping each layer
    through a sequence of the training length."""
    model = _rebuilt(recipe_dict, folder)
    length, width = recipe_dict["task"]["seq_len"], recipe_dict["model"]["d_model"]

    def count(state):
        if isinstance(state, torch.Tensor):
            return state.numel()
        if isinstance(state, dict):
            return sum(count(v) for v in state.values())
        if isinstance(state, (list, tuple)):
            return sum(count(v) for v in state)
        return 0

    total = 0
    with torch.no_grad():
        for block in model.blocks:
            state = block.mixer.init_state(1)
            for _ in range(length):
                _, state = block.mixer.step(torch.randn(1, width), state)
            total += count(state)
    return total


def test_the_seed_summary_the_per_seed_rows_and_the_csv_are_what_results_jsonl_and_the_models_say(tmp_path):
    seeds = random.sample(range(1000), 2)
    out = _ablate(tmp_path, [{"label": "attn", "model.layers": ["attention", "attention"]},
                             {"label": "m2", "model.layers": ["mamba2", "mamba2"]},
                             {"label": "hybrid", "model.layers": ["mamba2", "attention"]}], seeds)
    rows = _rows(out)
    assert sorted((r["label"], r["seed"]) for r in rows) == sorted((c, s) for c in ("attn", "m2", "hybrid")
                                                                    for s in seeds)
    summary, per_seed = _tables(out)[:2]
    assert [line["cell"] for line in summary] == ["attn", "m2", "hybrid"]
    for line in summary:
        group = [r for r in rows if r["label"] == line["cell"]]
        assert line["seeds"] == f"2 ({', '.join(map(str, sorted(seeds)))})"
        for column in ("test_accuracy", "train_seconds"):
            mean, std = _mean_sample_std([r["metrics"][column] for r in group])
            shown_mean, shown_std = (float(x) for x in line[column].split("±"))
            assert shown_mean == pytest.approx(mean, abs=6e-5) and shown_std == pytest.approx(std, abs=6e-5)
        params = {sum(p.numel() for p in _rebuilt(r["recipe"], tmp_path).parameters()) for r in group}
        assert params == {int(line["params"])}
        assert {_stepped_state_elements(r["recipe"], tmp_path) for r in group} == {int(line["state_size"])}
    assert {(line["cell"], int(line["seed"])) for line in per_seed} == {(r["label"], r["seed"]) for r in rows}
    with open(out / "results.csv", newline="") as fh:
        lines = list(csv.DictReader(fh))
    by_run = {(r["label"], r["seed"]): r for r in rows}
    assert len(lines) == len(rows)
    for line in lines:
        row = by_run[(line["cell"], int(line["seed"]))]
        assert float(line["test_accuracy"]) == pytest.approx(row["metrics"]["test_accuracy"], abs=6e-5)
        assert int(line["params"]) == row["metrics"]["params"]


def test_a_renamed_cell_keeps_its_rows_an_added_cell_runs_and_a_removed_cell_is_listed_apart(tmp_path):
    seed = random.randrange(1000)
    out = _ablate(tmp_path, [{"label": "attn", "model.layers": ["attention", "attention"]},
                             {"label": "m2", "model.layers": ["mamba2", "mamba2"]}], [seed])
    first = _rows(out)
    out = _ablate(tmp_path, [{"label": "softmax", "model.layers": ["attention", "attention"]},
                             {"label": "hybrid", "model.layers": ["mamba2", "attention"]}], [seed])
    rows = _rows(out)
    assert rows[:2] == first and [r["label"] for r in rows[2:]] == ["hybrid"]  # nothing retrained, one cell added
    tables = _tables(out)
    shown = {line["cell"] for line in tables[0]}
    assert shown == {"softmax", "hybrid"}
    assert [line["cell"] for line in tables[-1]] == ["m2"]  # the removed cell, in the table of other rows
    assert float(tables[0][0]["test_accuracy"]) == pytest.approx(first[0]["metrics"]["test_accuracy"], abs=6e-5)


def test_a_test_time_sweep_column_is_the_checkpoint_evaluated_at_that_value_at_the_training_length(tmp_path):
    values = sorted(random.sample(range(0, 6), 2))
    out = _ablate(tmp_path, [{"label": "gka", "model.layers": ["gka", "attention"]},
                             {"label": "attn", "model.layers": ["attention", "attention"]}],
                  [random.randrange(1000)], eval={"seq_lens": [24], "test_time_sweep": {"num_iter": values}})
    gka, attn = _rows(out)
    assert not any("num_iter" in k for k in attn["metrics"])  # a cell without the knob has no sweep columns
    # one column per value, at the training length only (none at the eval.seq_lens length)
    assert {k for k in gka["metrics"] if "num_iter" in k} == {f"test_accuracy@num_iter={v}" for v in values}
    checkpoint = out / "checkpoints" / gka["recipe_key"]
    for value in values:
        assert main(["eval", str(checkpoint), f"eval.test_time={{num_iter: {value}}}", "eval.test_time_sweep={}",
                     "eval.seq_lens=[]"]) == 0
        again = _rows(checkpoint)[-1]["metrics"]
        assert gka["metrics"][f"test_accuracy@num_iter={value}"] == again["test_accuracy"]
    summary = _tables(out)[0]
    empty = [line for line in summary if line["cell"] == "attn"][0]
    assert all(empty[f"test_accuracy@num_iter={v}"] == "" for v in values)
