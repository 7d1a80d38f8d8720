"""Recipes: no key silently ignored, and every one-line error blaming the place the value came from.

- a model's layers are given one way per level (``model.layers``, or ``model.pattern`` with ``model.n_layers``):
  both in one file or one set of overrides is refused, a later level (child recipe, override, grid cell)
  replaces the other way's inherited keys, and a pattern longer than ``n_layers`` is refused;
- a test-time knob no layer of the model declares is refused (a grid's shared knob: by no layer of any cell);
- an error names the override, or the grid cell and its file line, that brought the value, each prefix once;
- an option override on a layer of another mixer says what the layer is and how to replace it;
- a listed grid cell's keys are ``label`` or key paths, and a typo names ``label``.
"""
from pathlib import Path

import pytest
import torch

from zoo.errors import UserError
from zoo.recipes import resolve
from zoo.recipes.plain import recipe_mapping

from .test_recipes import check_fails

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"   # layers: [attention, mamba2]
LAYERS = "layers: [attention, mamba2]"


def _recipe(tmp_path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _tiny(tmp_path, name: str, model_lines: str) -> Path:
    """tiny.yaml with its ``layers`` line replaced by ``model_lines`` (indented under model)."""
    return _recipe(tmp_path, name, TINY.read_text().replace(LAYERS, model_lines))


def _line(path: Path, text: str) -> int:
    return next(i + 1 for i, line in enumerate(path.read_text().splitlines()) if text in line)


# --------------------------------------------------------------------------------------- layers, pattern, n_layers
def test_layers_and_pattern_in_one_file_are_refused(tmp_path, capsys):
    path = _tiny(tmp_path, "both.yaml", f"{LAYERS}\n  pattern: [mamba2]\n  n_layers: 2")
    line = check_fails(capsys, path)
    assert f"{path}:{_line(path, 'pattern:')}: model.pattern and model.n_layers are set together with model.layers " \
           f"(line {_line(path, 'layers:')})" in line, line
    assert "drop model.pattern and model.n_layers to keep model.layers, or drop model.layers" in line, line


def test_a_pattern_longer_than_n_layers_is_refused(tmp_path, capsys):
    path = _tiny(tmp_path, "long.yaml", "pattern: [mamba2, attention, attention]\n  n_layers: 2")
    line = check_fails(capsys, path)
    assert f"{path}:{_line(path, 'pattern:')}: model.pattern has 3 layers but model.n_layers is 2" in line, line
    line = check_fails(capsys, TINY, "model.layers=null", "model.pattern=[mamba2,attention,attention]",
                       "model.n_layers=2")
    assert "override 'model.pattern=[mamba2,attention,attention]' and override 'model.n_layers=2': " in line, line
    assert "would be cut short" in line, line
    # a pattern that does not divide n_layers is repeated and cut at the end, as documented
    plain = resolve(_tiny(tmp_path, "five.yaml", "pattern: [mamba2, attention]\n  n_layers: 3")).plain
    assert plain["model"]["layers"] == ["mamba2", "attention", "mamba2"]


def test_layers_given_at_a_later_level_replace_the_inherited_ones(tmp_path):
    _tiny(tmp_path, "pattern.yaml", "pattern: [mamba2, attention]\n  n_layers: 4")
    child = _recipe(tmp_path, "child.yaml", "extends: pattern.yaml\nmodel:\n  layers: [attention]\n")
    assert resolve(child).plain["model"]["layers"] == ["attention"]
    other = _recipe(tmp_path, "other.yaml", f"extends: {TINY}\nmodel:\n  pattern: [mamba2]\n  n_layers: 3\n")
    assert resolve(other).plain["model"]["layers"] == ["mamba2"] * 3
    # overrides over a recipe that sets layers, and layers over a recipe written as a pattern
    assert resolve(TINY, ["model.pattern=[mamba2]", "model.n_layers=3"]).plain["model"]["layers"] == ["mamba2"] * 3
    assert resolve(tmp_path / "pattern.yaml", ["model.layers=[mamba2]"]).plain["model"]["layers"] == ["mamba2"]
    # a grid cell over the base's pattern, and a grid cell's pattern over the base's layers
    grid = _recipe(tmp_path, "grid.yaml", "extends: pattern.yaml\ngrid:\n  - {label: a, model.layers: [attention]}\n"
                                          "  - {label: b}\n")
    assert [c.recipe.plain["model"]["layers"] for c in resolve(grid).cells] == \
           [["attention"], ["mamba2", "attention"] * 2]
    grid = _recipe(tmp_path, "grid2.yaml", f"extends: {TINY}\ngrid:\n  - {{model.pattern: [mamba2], "
                                           f"model.n_layers: 2}}\n")
    assert resolve(grid).cells[0].recipe.plain["model"]["layers"] == ["mamba2", "mamba2"]


def test_n_layers_over_layers_or_both_ways_in_one_level_are_refused(tmp_path, capsys):
    line = check_fails(capsys, TINY, "model.n_layers=3")
    assert f"override 'model.n_layers=3': model.n_layers is set together with model.layers ({TINY}:" in line, line
    assert "drop model.n_layers" in line, line
    child = _recipe(tmp_path, "child.yaml", f"extends: {TINY}\nmodel:\n  n_layers: 3\n")
    assert f"{child}:3: model.n_layers is set together with model.layers ({TINY}:" in check_fails(capsys, child)
    line = check_fails(capsys, TINY, "model.layers=[mamba2]", "model.pattern=[attention]", "model.n_layers=2")
    assert "override 'model.pattern=[attention]' and override 'model.n_layers=2': model.pattern and model.n_layers " \
           "are set together with model.layers (override 'model.layers=[mamba2]')" in line, line
    grid = _recipe(tmp_path, "grid.yaml", f"extends: {TINY}\ngrid:\n  - {{label: a, model.pattern: [mamba2], "
                                          f"model.n_layers: 2, model.layers: [mamba2]}}\n")
    line = check_fails(capsys, grid)
    assert f"{grid}:3: grid cell 'a' (model.pattern=[mamba2])" in line and "set together with model.layers" in line


def test_a_pattern_override_without_n_layers_names_what_is_missing(capsys):
    line = check_fails(capsys, TINY, "model.pattern=[mamba2]")
    assert "override 'model.pattern=[mamba2]': model.pattern is set without model.n_layers" in line, line


# --------------------------------------------------------------------------------------- test-time knobs
def test_a_knob_no_layer_of_the_model_declares_is_refused(capsys):
    line = check_fails(capsys, TINY, "eval.test_time_sweep={num_iter: [1, 2]}")
    assert "override 'eval.test_time_sweep={num_iter: [1, 2]}': eval.test_time_sweep.num_iter: no layer of this " \
           "model declares the test-time knob 'num_iter'" in line, line
    assert "(layers: attention, mamba2; the knobs they declare: none)" in line, line
    line = check_fails(capsys, TINY, "model.layers=[gka]", "eval.test_time={power: 3}")
    assert "eval.test_time.power: no layer of this model declares the test-time knob 'power'" in line, line
    assert "(layers: gka; the knobs they declare: num_iter)" in line, line


def test_a_knob_shared_by_grid_cells_needs_a_declaring_layer_in_some_cell(tmp_path, capsys):
    text = f"extends: {TINY}\neval: {{test_time_sweep: {{num_iter: [0, 2]}}}}\ngrid:\n  - {{label: a}}\n"
    some = _recipe(tmp_path, "some.yaml", text + "  - {label: g, model.layers: [gka]}\n")
    recipe = resolve(some)  # the cell without GKA leaves the columns empty
    attention_cell = recipe.cells[0].recipe
    # a recorded cell keeps its grid's knobs; an override asks this model, and it has no GKA
    assert resolve(recipe_mapping(attention_cell.plain)).key == attention_cell.key
    with pytest.raises(UserError, match="no layer of this model declares the test-time knob 'num_iter'"):
        resolve(recipe_mapping(attention_cell.plain), ["eval.test_time={num_iter: 3}"])
    none = _recipe(tmp_path, "none.yaml", text + "  - {label: m, model.layers: [mamba2]}\n")
    line = check_fails(capsys, none)
    assert f"{none}:2: eval.test_time_sweep.num_iter: no layer of any grid cell declares the test-time knob " \
           f"'num_iter'" in line, line
    own = _recipe(tmp_path, "own.yaml", f"extends: {TINY}\ngrid:\n  - {{label: g, model.layers: [gka]}}\n"
                                        f"  - {{label: a, eval.test_time: {{num_iter: 3}}}}\n")
    line = check_fails(capsys, own)
    assert f"{own}:4: grid cell 'a' (eval.test_time={{num_iter: 3}}): eval.test_time.num_iter: no layer of this " \
           f"model declares" in line, line


# --------------------------------------------------------------------------------------- the place to blame
@pytest.mark.parametrize("override,expect", [
    ("seeds=[0,0]", "seeds lists [0] more than once"),
    ("train.betas=[0.9]", "train.betas needs two values"),
    ("train.grad_accum=3", "train.batch_size (16) is not a multiple of train.grad_accum (3)"),
])
def test_a_check_across_options_blames_the_override(capsys, override, expect):
    line = check_fails(capsys, TINY, override)
    assert line == f"zoo: error: override {override!r}: {expect}" + line.split(expect, 1)[1], line
    assert str(TINY) not in line, line


def test_a_check_across_options_in_a_file_names_the_line_of_its_key(tmp_path, capsys):
    path = _recipe(tmp_path, "accum.yaml", TINY.read_text() + "seeds: [1, 1]\n")
    assert f"{path}:{_line(path, 'seeds:')}: seeds lists [1] more than once" in check_fails(capsys, path)


def test_a_constructor_refusal_names_the_override_once(capsys):
    line = check_fails(capsys, TINY, "model.d_model=33")
    assert line == "zoo: error: override 'model.d_model=33': model.layers.0 (attention): d_model=33 is not " \
                   "divisible by n_heads=2; set head_dim or change n_heads", line


def test_a_grid_cell_error_names_the_cell_its_line_and_value(tmp_path, capsys):
    grid = _recipe(tmp_path, "grid.yaml", f"extends: {TINY}\ngrid:\n  model.d_model: [32, 33]\n")
    line = check_fails(capsys, grid)
    assert line == f"zoo: error: {grid}:3: grid cell 'd_model=33' (model.d_model=33): model.layers.0 (attention): " \
                   f"d_model=33 is not divisible by n_heads=2; set head_dim or change n_heads", line
    typo = _recipe(tmp_path, "typo.yaml", f"extends: {TINY}\ngrid:\n  - {{label: a, model.dmodel: 32}}\n")
    line = check_fails(capsys, typo)
    assert f"{typo}:3: grid cell 'a' (model.dmodel=32): model.dmodel: unknown option 'dmodel'; did you mean " \
           f"'d_model'?" in line and "model.dmodel: model.dmodel" not in line, line
    mixer = _recipe(tmp_path, "mixer.yaml", f"extends: {TINY}\ngrid:\n  - {{model.layers: [mamba2, atention]}}\n")
    line = check_fails(capsys, mixer)
    assert f"{mixer}:3: grid cell 'model.layers=mamba2+atention' (model.layers=[mamba2, atention]): " \
           f"model.layers.1: unknown mixer 'atention'" in line and "model.layers: model.layers" not in line, line


# --------------------------------------------------------------------------------------- overrides and grid keys
def test_an_option_of_another_mixer_says_what_the_layer_is(tmp_path, capsys):
    line = check_fails(capsys, TINY, "model.layers.1.attention.n_heads=1")
    assert "override 'model.layers.1.attention.n_heads=1': model.layers.1 is mamba2 (a mixer name, without options " \
           "of its own), not attention" in line, line
    assert "model.layers.1.mamba2.<option>=value" in line and "model.layers.1={attention: {n_heads: 1}}" in line, line
    line = check_fails(capsys, TINY, "model.layers=[{mamba2: {d_state: 4}}]", "model.layers.0.ska.rank=2")
    assert "model.layers.0 is mamba2(d_state=4) (a mamba2 layer with options of its own), not ska" in line, line
    assert resolve(TINY, ["model.layers.1.mamba2.d_state=4"]).layers[1].options.d_state == 4


def test_a_listed_grid_cell_key_typo_suggests_label(tmp_path, capsys):
    line = check_fails(capsys, TINY, "grid=[{label: a}]", "grid.0.labl=x")
    assert "override 'grid.0.labl=x': grid.0.labl: unknown key 'labl'; did you mean 'label'" in line, line
    path = _recipe(tmp_path, "grid.yaml", f"extends: {TINY}\ngrid:\n  - {{lable: a, seed: 1}}\n")
    line = check_fails(capsys, path)
    assert f"{path}:3: grid.0.lable: unknown key 'lable'; did you mean 'label'" in line, line


# ------------------------------------------------------------------------------------------------ training options
def test_a_batch_larger_than_the_training_set_is_refused(capsys):
    n = int(torch.randint(2, 16, ()))
    line = check_fails(capsys, TINY, f"task.num_train={n}", "train.batch_size=16")
    assert f"train.batch_size: 16 exceeds task.num_train={n}" in line, line
    assert resolve(TINY, [f"task.num_train={n}", f"train.batch_size={n}"]).train.batch_size == n


def test_early_stopping_without_periodic_evaluation_is_refused(capsys):
    line = check_fails(capsys, TINY, "train.early_stop_acc=0.5")   # tiny.yaml evaluates only at the end
    assert "train.eval_every=0 runs none; set train.eval_every" in line, line
    assert resolve(TINY, ["train.early_stop_acc=0.5", "train.eval_every=3"]).train.early_stop_acc == 0.5


def test_a_check_across_the_task_options_blames_the_override(tmp_path, capsys):
    lm = Path(__file__).parents[2] / "recipes" / "lm" / "python_docs_bytes.yaml"
    line = check_fails(capsys, lm, "task.source=files", f"task.path={tmp_path}")
    assert line.startswith(f"zoo: error: override 'task.path={tmp_path}': task.path '{tmp_path}' is a folder"), line


@pytest.mark.parametrize("typo, nearest", [("improts", "imports"), ("extend", "extends"), ("trian", "train")])
def test_a_misspelt_top_level_key_of_a_mapping_names_every_section(typo, nearest):
    """A mapping's (or an override's) unknown top-level key is named with the nearest recipe section, the keys the
    reader takes before validation (``imports``, ``extends``) among them, as a recipe file's is."""
    with pytest.raises(UserError) as err:
        resolve({typo: ["x"], "task": {"name": "mqar"}})
    message = str(err.value)
    assert message.startswith(f"{typo}: unknown option {typo!r}; did you mean {nearest!r}"), message
    assert message.endswith("(valid: model, task, train, eval, seed, name, description, grid, seeds, extends, "
                            "imports)"), message


def test_extends_outside_a_file_says_where_it_is_read():
    """``extends`` in a mapping or an override has no file beside it to find the base: refused, saying so."""
    base = f"base_{int(torch.randint(10**6, ()))}.yaml"
    for recipe, overrides in (({"extends": base, "task": {"name": "mqar"}}, []), (TINY, [f"extends={base}"])):
        with pytest.raises(UserError, match="'extends' is read only at the top of a recipe file"):
            resolve(recipe, overrides)
