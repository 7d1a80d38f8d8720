"""A layer that cannot contribute at a recipe's lengths is named in the recipe's words: a model written as
``model.pattern`` has no ``model.layers``, so the layer is ``model.pattern.<j>`` (its place in the pattern, whichever
repetition of it), with the key that holds its options where it has some. Before, every refusal said
``model.layers.<i>``, a key a pattern recipe does not have."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zoo.cli import main
from zoo.recipes import resolve

RECIPE = """name: pattern
seed: 3
model:
  d_model: 32
  pattern: {pattern}
  n_layers: {n_layers}
  mixer_options:
    attention: {{n_heads: 2}}
task: {{name: mqar, vocab_size: 32, seq_len: 16, num_kv_pairs: 2, num_train: 64, num_test: 16}}
train: {{steps: 2, batch_size: 8, lr: 3.0e-3, warmup_steps: 1, threads: 1}}
"""
#: an ska layer with its default chunk_size (64) reads nothing at seq_len 16: it is dead there
DEAD = "ska"


def _pattern_recipe(tmp_path: Path, dead_entry: str) -> tuple[Path, int]:
    """A pattern recipe of attention layers with ``dead_entry`` at a random place of a pattern of random length,
    repeated to a random number of layers; the path and the dead entry's place in the pattern."""
    length = int(torch.randint(2, 5, ()))
    place = int(torch.randint(0, length, ()))
    pattern = ", ".join(dead_entry if j == place else "attention" for j in range(length))
    n_layers = length + int(torch.randint(0, 2 * length, ()))
    path = tmp_path / "pattern.yaml"
    path.write_text(RECIPE.format(pattern=f"[{pattern}]", n_layers=n_layers))
    return path, place


def _refusal(capsys, command: str, path: Path, *overrides: str) -> str:
    args = [command, str(path), *overrides] + (["--no-progress", "--out", str(path.parent / "out")]
                                               if command == "train" else [])
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "cannot contribute" in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["check", "train"])
def test_a_dead_layer_of_a_pattern_is_named_by_its_place_in_the_pattern(tmp_path, capsys, command):
    path, place = _pattern_recipe(tmp_path, DEAD)
    err = _refusal(capsys, command, path)
    assert f"model.pattern.{place} (ska) cannot contribute" in err and "model.layers" not in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.pt"))   # nothing trained


def test_the_key_holding_a_dead_layers_options_is_named(tmp_path, capsys):
    path, place = _pattern_recipe(tmp_path, DEAD)
    err = _refusal(capsys, "check", path, "model.mixer_options.ska.chunk_size=32")
    assert f"model.pattern.{place} (ska, options in model.mixer_options.ska)" in err, err
    path, place = _pattern_recipe(tmp_path, "{ska: {chunk_size: 32}}")
    err = _refusal(capsys, "check", path)
    assert f"model.pattern.{place} (ska, options in model.pattern.{place}.ska)" in err, err
    err = _refusal(capsys, "check", path, "model.mixer_options.ska.power=1")
    assert (f"model.pattern.{place} (ska, options in model.pattern.{place}.ska, over the defaults of "
            f"model.mixer_options.ska)") in err, err


def test_layer_names_follow_the_written_layers():
    from zoo.preflight import layer_names

    recipe = resolve({"model": {"d_model": 32, "layers": ["attention", {"ska": {"chunk_size": 8}}],
                                "mixer_options": {"attention": {"n_heads": 2}}},
                      "task": {"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": 2}})
    assert layer_names(recipe.model) == ["model.layers.0 (attention, options in model.mixer_options.attention)",
                                         "model.layers.1 (ska, options in model.layers.1.ska)"]
