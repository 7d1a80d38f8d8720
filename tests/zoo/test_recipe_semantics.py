"""Recipes that would silently run something other than what was written are refused.

- grid cells that build the same model and train it the same way are refused even where they write it
  differently: an option of ``model.mixer_options`` that every layer of the type sets itself, or that no layer
  takes (no layer of that mixer), or one layer's options given inline in one cell and through
  ``model.mixer_options`` in the other;
- ``zoo ablate`` with a ``seed=N`` override of a recipe that runs its cells with ``seeds``: every cell would run
  with those seeds, never N.
"""
import copy
from pathlib import Path

import pytest

from zoo.cli import main
from zoo.errors import UserError
from zoo.recipes import resolve

TINY = Path(__file__).parent / "recipes" / "tiny.yaml"   # layers: [attention, mamba2], seed 3

BASE = {"model": {"d_model": 32, "layers": [{"attention": {"n_heads": 2}}, "mamba2"],
                  "mixer_options": {"mamba2": {"d_state": 8, "headdim": 16, "chunk_size": 8}}},
        "task": {"name": "mqar", "vocab_size": 32, "seq_len": 16, "num_kv_pairs": 2, "num_train": 256, "num_test": 64},
        "train": {"steps": 6, "batch_size": 16, "warmup_steps": 2}}


def _with(**changes) -> dict:
    recipe = copy.deepcopy(BASE)
    recipe.update(changes)
    return recipe


def test_cells_differing_only_in_a_mixer_option_every_layer_sets_itself_are_refused():
    # the attention layer sets n_heads itself, so model.mixer_options.attention.n_heads changes no layer
    recipe = _with(grid={"model.mixer_options.attention.n_heads": [2, 4]})
    with pytest.raises(UserError, match=r"grid cells 'n_heads=2' and 'n_heads=4' .*same"):
        resolve(recipe)


def test_cells_differing_only_in_options_of_a_mixer_no_layer_uses_are_refused():
    recipe = _with(grid=[{"label": "gka2", "model.mixer_options.gka.n_heads": 2},
                         {"label": "gka4", "model.mixer_options.gka.n_heads": 4}])
    with pytest.raises(UserError, match=r"grid cells 'gka2' and 'gka4' .*model\.mixer_options\.gka\.n_heads"):
        resolve(recipe)


def test_one_layer_written_inline_and_through_mixer_options_in_two_cells_is_refused():
    recipe = _with(grid=[{"label": "inline", "model.layers": [{"attention": {"n_heads": 4}}, "mamba2"]},
                         {"label": "defaults", "model.layers": ["attention", "mamba2"],
                          "model.mixer_options.attention.n_heads": 4}])
    with pytest.raises(UserError, match=r"grid cells 'inline' and 'defaults' .*same"):
        resolve(recipe)


def test_cells_whose_mixer_option_reaches_a_layer_still_resolve():
    # layer 1 (mamba2) takes model.mixer_options.mamba2.d_state: the cells build different models
    cells = resolve(_with(grid={"model.mixer_options.mamba2.d_state": [8, 16]})).cells
    assert [c.recipe.layers[1].options.d_state for c in cells] == [8, 16]
    # and cells that build the same model with different seeds are distinct runs
    assert len(resolve(_with(grid={"model.mixer_options.mamba2.d_state": [8]}, seeds=[0, 1])).cells) == 2


def test_ablate_refuses_a_seed_override_that_the_recipes_seeds_would_discard(tmp_path, capsys):
    recipe = tmp_path / "seeded.yaml"
    recipe.write_text(TINY.read_text() + "seeds: [0, 1]\n")
    assert [c.recipe.seed for c in resolve(recipe, ["seed=5"]).cells] == [0, 1]  # the cells never run seed 5
    code = main(["ablate", str(recipe), "--out", str(tmp_path / "out"), "--no-progress", "--no-plot", "seed=5"])
    err = capsys.readouterr().err
    assert code == 2 and "seed=5" in err and "seeds" in err and "Traceback" not in err, err
    assert not (tmp_path / "out" / "results.jsonl").exists()
    # zoo train runs the base recipe alone: there the override is the seed it runs with
    assert resolve(recipe, ["seed=5"]).seed == 5
