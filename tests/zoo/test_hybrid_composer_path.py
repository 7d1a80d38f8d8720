"""Composing hybrid stacks for a controlled ablation: what a grid's cells are called and where a mistake is blamed.

- a listed cell's ``label: yes`` (``no``, ``on``, ``off``, ``0.10``) is read by YAML as a boolean or a number and
  named the cell ``True`` (``0.1``): refused in one line saying to quote it;
- a mapping grid's cells are labelled so that each key can be told apart: two mixers' ``n_heads`` are
  ``attention.n_heads`` and ``gka.n_heads`` (both were ``n_heads``), a layer of the pattern is ``pattern.2`` (it
  was ``2``);
- a negative layer index (``model.layers.-1``, the last layer) is blamed on the override or grid cell that wrote
  it (the error named the recipe's ``model:`` line), and a layer index that is not a number says so;
- ``model.state_mixer_options`` left from another state mixer (a cell that sets ``model.state_mixer: none`` under
  the recipe's SwiGLU options) names the cell and says to drop them (it named the options' line and
  ``valid: ``, an empty list).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml

from zoo.cli import main
from zoo.errors import UserError
from zoo.model import HybridLM
from zoo.recipes import resolve

TASK = {"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": 2, "num_train": 64, "num_test": 16}
OPTIONS = {"attention": {"n_heads": 2}, "mamba2": {"d_state": 8, "headdim": 16, "chunk_size": 8},
           "gka": {"n_heads": 2}}


def _pick(choices, k: int = 1) -> list:
    return [choices[int(i)] for i in torch.randperm(len(choices))[:k]]


def _recipe(**model) -> dict:
    body = {"d_model": 32, "pattern": ["mamba2", "mamba2", "attention"], "n_layers": 5,
            "mixer_options": {k: dict(v) for k, v in OPTIONS.items()}}
    return {"model": {**body, **model}, "task": dict(TASK), "train": {"steps": 2, "batch_size": 8, "warmup_steps": 1}}


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hybrid.yaml"
    path.write_text(text)
    return path


def _check(capsys, path: Path, *overrides: str) -> tuple[int, str, str]:
    code = main(["check", str(path), *overrides])
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


# --------------------------------------------------------------------------------------- labels YAML reads otherwise
@pytest.mark.parametrize("written", ["yes", "no", "on", "off", "true", "False", "0.10", "1.50"])
def test_a_label_yaml_reads_as_a_boolean_or_number_is_refused_with_how_to_quote_it(tmp_path, capsys, written):
    heads = _pick([1, 2, 4], 2)
    text = yaml.safe_dump(_recipe(), sort_keys=False) + (
        f"grid:\n  - {{label: {written}, model.mixer_options.attention.n_heads: {heads[0]}}}\n"
        f"  - {{label: other, model.mixer_options.attention.n_heads: {heads[1]}}}\n")
    path = _write(tmp_path, text)
    code, _, err = _check(capsys, path)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"zoo: error: {path}:{_line_of(path, 'label: ' + written)}: grid.0.label"), err
    assert "quote it" in err and repr(yaml.safe_load(written)) in err, err
    quoted = _write(tmp_path, text.replace(f"label: {written}", f"label: '{written}'"))
    assert [c.label for c in resolve(quoted).cells] == [written, "other"]
    assert [c.recipe.layers[2].options.n_heads for c in resolve(quoted).cells] == heads


# --------------------------------------------------------------------------------------- mapping grid labels
def _value_in(label: str, name: str) -> str:
    """The value a label gives the key ``name`` (``name=value`` as one word)."""
    found = re.findall(rf"(?<!\S){re.escape(name)}=(\S+)", label)
    assert len(found) == 1, (label, name)
    return found[0]


def test_two_mixers_options_of_one_name_are_told_apart_in_a_mapping_grids_labels():
    recipe = _recipe(pattern=["mamba2", "attention", "gka"], n_layers=int(torch.randint(3, 7, ())))
    attention, gka = _pick([1, 2, 4], 2), _pick([1, 2, 4], 2)
    recipe["grid"] = {"model.mixer_options.attention.n_heads": attention, "model.mixer_options.gka.n_heads": gka}
    cells = resolve(recipe).cells
    assert len({c.label for c in cells}) == len(cells) == 4
    for cell in cells:
        built = {spec.name: spec.options.n_heads for spec in cell.recipe.layers if spec.name != "mamba2"}
        # before: "n_heads=2 n_heads=4", which does not say which mixer has 4 heads
        assert int(_value_in(cell.label, "attention.n_heads")) == built["attention"], cell.label
        assert int(_value_in(cell.label, "gka.n_heads")) == built["gka"], cell.label


def test_a_layer_of_the_pattern_swept_in_a_mapping_grid_is_labelled_by_its_place():
    pattern = ["mamba2", "mamba2", "attention"]
    n_layers = int(torch.randint(4, 9, ()))
    j = int(torch.randint(0, 3, ()))
    mixers = _pick(["attention", "gka", "mamba2", "gated_deltanet"], 3)
    recipe = _recipe(pattern=pattern, n_layers=n_layers)
    recipe["grid"] = {f"model.pattern.{j}": mixers, "train.lr": [0.01]}
    cells = resolve(recipe).cells
    for cell, mixer in zip(cells, mixers, strict=True):
        assert _value_in(cell.label, f"pattern.{j}") == mixer, cell.label   # before: "2=gka lr=0.01"
        assert _value_in(cell.label, "lr") == "0.01"
        expected = [mixer if i % 3 == j else pattern[i % 3] for i in range(n_layers)]
        assert [spec.name for spec in cell.recipe.layers] == expected


# --------------------------------------------------------------------------------------- layer indices
def test_a_negative_layer_index_sets_that_layer_and_is_blamed_on_its_override(tmp_path, capsys):
    n_layers = int(torch.randint(4, 8, ()))
    back = int(torch.randint(1, n_layers + 1, ()))
    pattern = ["mamba2", "attention"]
    path = _write(tmp_path, yaml.safe_dump(_recipe(pattern=pattern, n_layers=n_layers), sort_keys=False))
    names = [spec.name for spec in resolve(path, [f"model.layers.-{back}=gka"]).layers]
    assert names == ["gka" if i == n_layers - back else pattern[i % 2] for i in range(n_layers)]
    own = pattern[(n_layers - back) % 2]
    override = f"model.layers.-{back}.{own}.d_stat=4"
    code, _, err = _check(capsys, path, override)
    # before: "<file>:1: model.layers.<i>...d_stat: unknown option", blaming the recipe's model: line
    assert code == 2 and err.startswith(f"zoo: error: override {override!r}: "
                                        f"model.layers.{n_layers - back}.{own}.d_stat: unknown option"), err
    cell_path = _write(tmp_path, path.read_text() + f"grid:\n  - {{label: last, model.layers.-{back}.{own}.d_stat: 4}}\n"
                                                    f"  - {{label: other, train.lr: 0.01}}\n")
    code, _, err = _check(capsys, cell_path)
    assert code == 2 and err.startswith(f"zoo: error: {cell_path}:{_line_of(cell_path, 'label: last')}: grid cell "
                                        f"'last'"), err


def test_a_layer_index_that_is_not_a_number_names_the_list_and_its_indices():
    n_layers = int(torch.randint(3, 7, ()))
    word = _pick(["x", "one", "last"])[0]
    with pytest.raises(UserError, match=rf"model\.layers\.{word}: '{word}' is not an index; model\.layers is a list of "
                                        rf"{n_layers} items, indexed 0 to {n_layers - 1}"):
        resolve(_recipe(n_layers=n_layers), [f"model.layers.{word}=gka"])   # before: "index out of range"


# --------------------------------------------------------------------------------------- state mixers in a grid
def test_a_cell_that_drops_the_state_mixer_under_its_options_is_named_with_the_fix(tmp_path, capsys):
    mult = float(_pick([1.5, 2.0, 3.0])[0])
    base = _recipe(state_mixer_options={"mult": mult})
    text = yaml.safe_dump(base, sort_keys=False) + (
        "grid:\n  - {label: swiglu, model.state_mixer: swiglu}\n  - {label: bare, model.state_mixer: none}\n")
    path = _write(tmp_path, text)
    code, _, err = _check(capsys, path)
    assert code == 2 and len(err.splitlines()) == 1, err
    # before: "<file>:<options line>: model.state_mixer_options.mult: unknown option 'mult' (valid: )"
    assert err.startswith(f"zoo: error: {path}:{_line_of(path, 'label: bare')}: grid cell 'bare'"), err
    assert "none has no option 'mult' (it takes no options)" in err and "model.state_mixer_options: {}" in err, err
    fixed = _write(tmp_path, text.replace("model.state_mixer: none}", "model.state_mixer: none, "
                                                                      "model.state_mixer_options: {}}"))
    swiglu, bare = (c.recipe for c in resolve(fixed).cells)
    model = HybridLM.from_recipe(bare, TASK["vocab_size"])
    assert all(block.state_mixer is None for block in model.blocks)
    with_mlp = HybridLM.from_recipe(swiglu, TASK["vocab_size"])
    mlp = sum(p.numel() for block in with_mlp.blocks for m in (block.state_mixer, block.state_norm)
              for p in m.parameters())
    assert with_mlp.num_params() - model.num_params() == mlp > 0


def test_a_mapping_grid_crossing_a_mixer_with_its_option_names_the_grid_and_how_to_list_cells(tmp_path, capsys):
    """Crossing ``model.pattern.<j>: [attention, gka]`` with a GKA option makes attention cells that differ only in
    an option no layer takes: refused, naming the grid's line and the way out (it said "remove one of them", which a
    mapping grid cannot do, and named no file)."""
    j = int(torch.randint(0, 3, ()))
    iters = sorted(_pick([1, 2, 3, 5], 2))
    text = yaml.safe_dump(_recipe(), sort_keys=False)
    path = _write(tmp_path, text + f"grid:\n  model.pattern.{j}: [attention, gka]\n"
                                   f"  model.mixer_options.gka.num_iter: {iters}\n")
    code, _, err = _check(capsys, path)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"zoo: error: {path}:{_line_of(path, 'grid:')}: grid cells 'pattern.{j}=attention "
                          f"num_iter={iters[0]}' and 'pattern.{j}=attention num_iter={iters[1]}'"), err
    assert "list the cells to run instead" in err, err
    listed = _write(tmp_path, text + f"grid:\n  - {{label: attention, model.pattern.{j}: attention}}\n" + "".join(
        f"  - {{label: gka r={r}, model.pattern.{j}: gka, model.mixer_options.gka.num_iter: {r}}}\n" for r in iters))
    cells = resolve(listed).cells
    assert [c.label for c in cells] == ["attention"] + [f"gka r={r}" for r in iters]
    pattern = ["mamba2", "mamba2", "attention"]
    for cell, (mixer, r) in zip(cells, [("attention", None)] + [("gka", r) for r in iters], strict=True):
        names = [mixer if i % 3 == j else pattern[i % 3] for i in range(5)]
        assert [(s.name, getattr(s.options, "num_iter", None)) for s in cell.recipe.layers] == \
            [(name, r if name == "gka" else None) for name in names]
