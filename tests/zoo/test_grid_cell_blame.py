"""A layer that cannot be built is blamed on the grid cell (or override) whose key below the layer's options caused
it, named with its label and that key, not on the recipe's ``layers:`` line."""
from pathlib import Path

from .test_recipe_errors_more import _line, _recipe
from .test_recipes import check_fails

RECIPE = """name: c
model:
  d_model: 32
  mixer_options:
    mamba2: {d_state: 8, headdim: 16, chunk_size: 8}
  layers: [attention, mamba2]
task: {name: mqar, vocab_size: 32, seq_len: 16, num_kv_pairs: 2, num_train: 256, num_test: 64}
train: {steps: 6, batch_size: 16, warmup_steps: 2}
grid:
  - {label: even, model.mixer_options.mamba2.headdim: 8}
  - {label: odd, model.mixer_options.mamba2.d_state: 4, model.mixer_options.mamba2.headdim: 12}
"""
REFUSAL = "model.layers.1 (mamba2): expand*d_model=64 is not divisible by headdim=12"


def _grid(tmp_path) -> Path:
    return _recipe(tmp_path, "c.yaml", RECIPE)


def test_a_cell_key_below_the_mixer_options_is_named_with_its_cell(tmp_path, capsys):
    path = _grid(tmp_path)
    line = check_fails(capsys, path)
    cell = f"{path}:{_line(path, 'label: odd')}: grid cell 'odd' (model.mixer_options.mamba2.headdim=12)"
    assert line.startswith(f"zoo: error: {cell}: {REFUSAL}"), line
    assert f"{path}:{_line(path, 'layers:')}:" not in line, line
    assert "d_state" not in line, line   # the cell's other key below the options is not what the build refuses


def test_a_cell_key_below_a_layer_is_named_with_its_cell(tmp_path, capsys):
    path = _recipe(tmp_path, "layer.yaml", RECIPE.replace(
        "model.mixer_options.mamba2.d_state: 4, model.mixer_options.mamba2.headdim: 12",
        "model.layers: [attention, {mamba2: {headdim: 12}}]").replace(
        "{label: even, model.mixer_options.mamba2.headdim: 8}", "{label: even, model.layers: [mamba2, attention]}"))
    line = check_fails(capsys, path)
    assert f"{path}:{_line(path, 'label: odd')}: grid cell 'odd' (model.layers=" in line and REFUSAL in line, line


def test_an_override_below_the_mixer_options_is_named(tmp_path, capsys):
    path = _recipe(tmp_path, "plain.yaml", RECIPE.split("grid:")[0])
    line = check_fails(capsys, path, "model.mixer_options.mamba2.headdim=12", "model.mixer_options.mamba2.d_state=4")
    assert line.startswith(f"zoo: error: override 'model.mixer_options.mamba2.headdim=12': {REFUSAL}"), line
    assert "d_state" not in line, line


def test_a_bad_option_in_the_file_is_still_blamed_on_its_line(tmp_path, capsys):
    path = _recipe(tmp_path, "file.yaml", RECIPE.split("grid:")[0].replace("headdim: 16", "headdim: 12"))
    line = check_fails(capsys, path, "model.mixer_options.mamba2.d_state=4")
    assert line.startswith(f"zoo: error: {path}:{_line(path, 'layers:')}: {REFUSAL}"), line
    assert "override" not in line, line
